"""``echo-plan comm``: predict one collective on N GPUs of a cluster (placed on consecutive servers)."""

from __future__ import annotations

import typer

from echo_plan.commands.common import ClusterOpt, FlowsOpt, JsonOpt, RoutingOpt, print_json
from echo_plan.cost.collectives import collective_model_for
from echo_plan.errors import SpecError
from echo_plan.specs import load_cluster, parse_size
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.limits import MAX_GPUS, check_int
from echo_plan.cost.base import Algorithm
from echo_plan.interop.msccl_model import compare_with_nccl


def _estimate_dict(est, nbytes: int) -> dict:
    return {
        "time_us": round(est.time_s * 1e6, 3),
        "algbw_GBps": round(est.algbw_GBps, 3),
        "busbw_GBps": round(est.busbw_GBps, 3),
        "algorithm": est.algorithm.value,
        "protocol": est.protocol.value,
        "size_bytes": nbytes,
    }


def register(app: typer.Typer) -> None:
    @app.command("comm")
    def comm(
        cluster: str = ClusterOpt,
        gpus: int = typer.Option(..., "--gpus", "-n", help="GPUs in the group, filling servers in order"),
        op: str = typer.Option("all_reduce", "--op",
                               help="all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send_recv"),
        size: str = typer.Option(..., "--size", "-s", help="bytes, nccl-tests convention: 1048576, 64MB, 1GiB"),
        show_all: bool = typer.Option(False, "--all", help="show every algorithm/protocol considered"),
        as_json: bool = JsonOpt,
        algorithm: str = typer.Option(None, "--algorithm",
                                      help="an MSCCL-IR XML algorithm to predict beside NCCL's ring and tree"),
        routing: str = RoutingOpt,
        flows_per_connection: int = FlowsOpt,
    ) -> None:
        """Time, algorithm, protocol, algbw and busbw (nccl-tests sense) of one collective."""
        try:
            kind = CollectiveKind(op.replace("-", "_").lower())
        except ValueError:
            raise SpecError("--op", op, ", ".join(k.value for k in CollectiveKind)) from None

        check_int("--gpus", gpus, 1, MAX_GPUS, "GPUs in the group")
        nbytes = parse_size(size)
        spec = load_cluster(cluster)
        nodes = -(-gpus // spec.gpus_per_node)
        if nodes > spec.num_nodes:
            spec = spec.replace(num_nodes=nodes)
        spec = spec.with_routing(routing, flows_per_connection)
        group = CommGroup(GroupKind.WORLD, gpus)
        model = collective_model_for(spec)
        est = model.time(kind, nbytes, group, spec)
        fabric = None
        if spec.network.routing.value != "none":
            from echo_plan.cost.fabric import group_slowdown  # deferred: loads numpy

            fabric = group_slowdown(kind, group, spec, tree=est.algorithm is Algorithm.TREE).as_json()
        cands = model.candidates(kind, nbytes, group, spec) if show_all else []
        per_node, spanned = group.placement(spec.domain_gpus)  # servers, or NVLink domains of several servers
        unit = "server" if spec.domain_gpus == spec.gpus_per_node else "NVLink domain"
        calibrated = "nccl" in spec.calibration
        if algorithm is not None:
            cmp = compare_with_nccl(algorithm, kind, nbytes, group, spec, model)
            if as_json:
                print_json({"op": kind.value, "gpus": gpus, "cluster": spec.name, "size_bytes": nbytes, **cmp})
                return
            typer.echo(f"{kind.value} of {nbytes} B on {gpus} GPUs of {spec.name} ({per_node} per {unit}, "
                       f"{spanned} {unit}{'s' if spanned > 1 else ''})")
            for row in cmp["rows"]:
                typer.echo(f"  {row['name']:<34} {row['protocol']:<7} {row['time_us']:12.2f} us  "
                           f"algbw {row['algbw_GBps']:8.2f}  busbw {row['busbw_GBps']:8.2f} GB/s")
            return
        if as_json:
            out = {"op": kind.value, "gpus": gpus, "cluster": spec.name, "ranks_per_node": per_node,
                   "nodes": spanned, "calibrated": calibrated, **_estimate_dict(est, nbytes)}
            if show_all:
                out["candidates"] = [_estimate_dict(c, nbytes) for c in cands]
            if fabric is not None:
                out["routing"] = spec.network.routing.value
                out["ecmp_slowdown"] = fabric
            print_json(out)
            return
        typer.echo(f"{kind.value} of {nbytes} B on {gpus} GPUs of {spec.name} ({per_node} per {unit}, {spanned} "
                   f"{unit}{'s' if spanned > 1 else ''}; {'calibrated' if calibrated else 'uncalibrated'} NCCL model)")
        typer.echo(f"  time   {est.time_s * 1e6:12.2f} us")
        typer.echo(f"  choice {est.algorithm.value}/{est.protocol.value}")
        typer.echo(f"  algbw  {est.algbw_GBps:12.2f} GB/s")
        typer.echo(f"  busbw  {est.busbw_GBps:12.2f} GB/s")
        if fabric is not None:
            typer.echo(f"  routing {spec.network.routing.value}: {fabric['cross_leaf_flows']:,} cross-leaf flows; ECMP "
                       f"slowdown x{fabric['expected']:.3f} expected, x{fabric['p99']:.2f} p99, x{fabric['worst']:.1f} "
                       f"worst; planned x{fabric['planned']:.2f}")
        if show_all:
            typer.echo("  candidates (fastest first):")
            for c in cands:
                typer.echo(f"    {c.algorithm.value + '/' + c.protocol.value:<14} {c.time_s * 1e6:12.2f} us  "
                           f"busbw {c.busbw_GBps:9.2f} GB/s")
