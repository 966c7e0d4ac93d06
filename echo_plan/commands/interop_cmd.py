"""``echo-plan export chakra | chakra-collective`` and ``echo-plan import chakra``: Chakra ET files."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import (
    CacheDirOpt, ClusterOpt, GpusOpt, JsonOpt, NodesOpt, print_json,
)
from echo_plan.commands.launch_cmd import register_launch
from echo_plan.commands.plan_flags import PlanFlags, build_plan, plan_options
from echo_plan.commands.common import check_cache_dir
from echo_plan.interop.chakra_step import build_step_graph
from echo_plan.output_paths import check_output_prefix
from echo_plan.trace.cache import TraceCache
from echo_plan.interop.msccl import load_msccl
from echo_plan.specs import parse_size
from echo_plan.replay.interference import InterferenceModel
from echo_plan.specs import load_cluster


# what a Chakra trace of echo-plan's step does not express
CHAKRA_REFUSES = {"dp_comm": "the Chakra export writes the dense data-parallel exchange only; not with --dp-comm",
                  "density": "the Chakra export writes the dense data-parallel exchange only; not with --density"}


def register(app: typer.Typer) -> None:
    export_app = typer.Typer(help="Write echo-plan's workloads and plans in other tools' formats (Chakra ET, launch configs).",
                             no_args_is_help=True)
    import_app = typer.Typer(help="Read other tools' workloads (Chakra ET) and running jobs' launch configs.", no_args_is_help=True)
    app.add_typer(export_app, name="export")
    app.add_typer(import_app, name="import")
    register_launch(export_app, import_app)

    @export_app.command("chakra")
    @plan_options
    def export_chakra_cmd(
        flags: PlanFlags,
        out: str = typer.Option(..., "-o", "--output", help="DIR/NAME: writes DIR/NAME.<rank>.et and NAME.comm_groups.json"),
        ranks: Optional[str] = typer.Option(None, "--ranks", help="only these ranks, e.g. 0,1,8-15 (default: all)"),
        cache_dir: Optional[str] = CacheDirOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Write the simulated step of a plan as Chakra execution traces, one file per rank."""
        from echo_plan.interop.chakra_export import export_chakra, parse_ranks  # deferred: loads google.protobuf

        check_output_prefix(out, "--output")
        check_cache_dir(cache_dir)
        inputs = build_plan(flags, refuse=CHAKRA_REFUSES)
        model_spec, cluster_spec, stack_spec, plan = inputs.model, inputs.cluster, inputs.stack, inputs.plan
        chosen = parse_ranks(ranks, plan.world_size)
        graph = build_step_graph(model_spec, cluster_spec, plan, cache=TraceCache(cache_dir), stack=stack_spec)
        paths = export_chakra(graph, out, chosen, {"model": model_spec.name, "cluster": cluster_spec.name,
                                                   "stack": stack_spec.name})
        summary = {"files": [str(p) for p in paths], "ranks": len(chosen),
                   "nodes_per_stage": [len(s) for s in graph.stages], "simulated_step_s": graph.simulated_step_s}
        if as_json:
            print_json(summary)
            return
        typer.echo(f"wrote {len(chosen)} Chakra trace(s) and {paths[-1].name} next to {out}")
        typer.echo(f"  plan {plan.short()} on {cluster_spec.num_gpus} GPUs; nodes per pipeline stage: "
                   f"{', '.join(str(n) for n in summary['nodes_per_stage'])}")
        typer.echo(f"  simulated step time {graph.simulated_step_s * 1e3:.3f} ms")

    @export_app.command("chakra-collective")
    def export_collective_cmd(
        algorithm: str = typer.Argument(..., help="MSCCL-IR XML file"),
        out: str = typer.Option(..., "-o", "--output", help="DIR/NAME: writes DIR/NAME.<gpu>.et"),
        size: str = typer.Option("1MiB", "--size", "-s", help="collective size (nccl-tests convention)"),
    ) -> None:
        """Convert an MSCCL-IR algorithm to Chakra graphs of sends, receives and reductions, one per GPU."""
        from echo_plan.interop.chakra_collective import export_collective  # deferred: loads google.protobuf

        check_output_prefix(out, "--output")
        algo = load_msccl(algorithm)
        paths = export_collective(algo, parse_size(size), out)
        typer.echo(f"wrote {len(paths)} Chakra graph(s) for {algo.name} ({algo.coll}, {algo.ngpus} GPUs, "
                   f"{algo.num_steps} steps) next to {out}")

    @import_app.command("chakra")
    def import_chakra_cmd(
        prefix: str = typer.Argument(..., help="DIR/NAME of NAME.<rank>.et files (+ NAME.comm_groups.json)"),
        cluster: str = ClusterOpt,
        nodes: Optional[int] = NodesOpt,
        gpus: Optional[int] = GpusOpt,
        no_interference: bool = typer.Option(False, "--no-interference", help="ignore compute/comm interference"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Replay Chakra execution traces with echo-plan's cost models; print the step time per rank."""
        from echo_plan.interop.chakra_import import import_chakra  # deferred: loads google.protobuf

        spec = load_cluster(cluster, nodes=nodes, gpus=gpus)
        result = import_chakra(prefix, spec, interference=InterferenceModel.none() if no_interference else None)
        if as_json:
            print_json({"step_time_s": result.step_time_s, "recorded_step_s": result.recorded_step_s,
                        "rank_time_s": {str(k): v for k, v in result.rank_time_s.items()},
                        "nodes": result.nodes, "notes": list(result.notes)})
            return
        typer.echo(f"{len(result.rank_time_s)} rank(s) on {spec.name}: step time {result.step_time_s * 1e3:.3f} ms")
        if result.recorded_step_s:
            typer.echo(f"  the producer recorded {result.recorded_step_s * 1e3:.3f} ms "
                       f"({(result.step_time_s / result.recorded_step_s - 1) * 100:+.2f}%)")
        typer.echo("  nodes: " + ", ".join(f"{k} {v}" for k, v in result.nodes.items()))
        for rank, t in result.rank_time_s.items():
            typer.echo(f"  rank {rank:>5}  {t * 1e3:10.3f} ms")
        for note in result.notes:
            typer.echo(f"  note: {note}")
