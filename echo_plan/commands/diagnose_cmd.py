"""``echo-plan diagnose``: read per-rank collective records, name the syndrome and the suspect (C4D)."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import JsonOpt, print_json
from echo_plan.errors import SpecError
from echo_plan.limits import MAX_GPUS_PER_NODE, check_int
from echo_plan.specs import load_cluster


def register(app: typer.Typer) -> None:
    @app.command("diagnose")
    def diagnose_cmd(
        records: list[str] = typer.Argument(..., help="record files or folders: torch flight-recorder dumps "
                                                      "(nccl_trace_rank_N), .jsonl or .csv (docs/diagnose.md)"),
        cluster: Optional[str] = typer.Option(
            None, "--cluster", "-c", help="cluster preset or YAML: its GPUs per server place ranks on servers "
                                          "where the records do not (flight-recorder dumps never do)"),
        gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node",
                                                    help="GPUs per server, instead of --cluster"),
        tp: Optional[int] = typer.Option(None, "--tp", help="the job's tensor-parallel degree (with --cp/--pp/--dp: "
                                                           "names each group's kind, expects every rank of the job)"),
        cp: Optional[int] = typer.Option(None, "--cp", help="the job's context-parallel degree"),
        pp: Optional[int] = typer.Option(None, "--pp", help="the job's pipeline-parallel degree"),
        dp: Optional[int] = typer.Option(None, "--dp", help="the job's data-parallel degree (default: from the "
                                                           "highest rank in the records)"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Healthy, or which syndrome (communication or non-communication hang or slowdown), the suspect
        rank/server and component (gpu, nic, nvlink, link), the evidence and a confidence. Never simulates."""
        from echo_plan.resilience.diagnose.analyze import diagnose_paths  # deferred: loads numpy

        if cluster is not None and gpus_per_node is not None:
            raise SpecError("--gpus-per-node", gpus_per_node, "not together with --cluster")
        gpn = None
        if gpus_per_node is not None:
            gpn = check_int("--gpus-per-node", gpus_per_node, 1, MAX_GPUS_PER_NODE)
        elif cluster is not None:
            gpn = load_cluster(cluster).gpus_per_node
        result = diagnose_paths(records, gpn, (tp, cp, pp, dp))
        if as_json:
            print_json(result.as_json())
            return
        _print(result)


def _print(d) -> None:
    echo = typer.echo
    echo(f"verdict: {d.verdict}")
    echo(f"syndrome: {d.syndrome.value}")
    echo(f"records: {d.records:,} from {d.ranks_present} ranks"
         + (f"; missing ranks: {_short(d.missing_ranks)}" if d.missing_ranks else ""))
    if d.suspects:
        echo("suspects (most likely first):")
        for s in d.suspects[:10]:
            where = f"rank {s.rank}" if s.rank is not None else "-"
            node = f"node {s.node}" if s.node is not None else "node ?"
            peer = f" -> rank {s.peer}" if s.peer is not None else ""
            echo(f"  {s.confidence:5.0%}  {s.component.value:<6} {where}{peer} ({node}): {s.why}")
        if len(d.suspects) > 10:
            echo(f"  ... {len(d.suspects) - 10} more (--json lists all)")
    ev = d.evidence
    if "never_entered" in ev:
        echo(f"never entered: ranks {_short(ev['never_entered'])}")
    for h in ev.get("hung_collectives", [])[:3]:
        echo(f"hung: {h['op']} #{h['seq']} of {h['group']} ({h['members']} ranks, {h['waiting_ranks']} waiting in it)")
    if "last_arriving" in ev:
        la = ev["last_arriving"]
        line = f"last to arrive: rank {la['rank']} in {la['last_share']:.0%} of its collectives, by {la['late_by_s'] * 1e3:.3g} ms"
        if la.get("median_wait_s") is not None and la.get("group_median_wait_s") is not None:
            line += (f"; waits {la['median_wait_s'] * 1e3:.3g} ms in them against "
                     f"{la['group_median_wait_s'] * 1e3:.3g} ms for the others")
        echo(line)
    m = ev.get("delay_matrix")
    if m:
        if m["rows"]:
            echo("delay matrix, slow rows (senders): " + ", ".join(f"rank {r['rank']}" for r in m["rows"][:8]))
        if m["columns"]:
            echo("delay matrix, slow columns (receivers): " + ", ".join(f"rank {r['rank']}" for r in m["columns"][:8]))
        echo("delay matrix, slow cells: " + ", ".join(f"{c['src']}->{c['dst']} x{c['value']:.2f}" for c in m["cells"][:8]))
    for g in ev.get("slow_groups", [])[:4]:
        echo(f"slow group: {g['group']} x{g['ratio']:.2f} its peers' transfer time")
    for n in d.notes:
        echo(f"note: {n}")


def _short(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks[:16])) + (f" (+{len(ranks) - 16} more)" if len(ranks) > 16 else "")
