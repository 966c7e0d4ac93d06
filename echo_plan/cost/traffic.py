"""What ECMP collisions cost each collective group of a simulated step (``simulate --routing``).

For every (collective, group) the step times, at its largest message: the ECMP slowdown of its
slowest cross-leaf flow (expected over hash draws, 99th percentile, worst case) and the planned
bound, from ``cost/fabric.py``, and the collective's time under planned routing and under ECMP
(expected), both through the NCCL model so that the algorithm NCCL would pick is costed.
"""

from __future__ import annotations

from typing import Any, Iterable

from echo_plan.cost.base import Algorithm
from echo_plan.cost.collectives import collective_model_for
from echo_plan.cost.fabric import group_slowdown
from echo_plan.specs.cluster import ClusterSpec, Routing
from echo_plan.trace.records import CollectiveKind, CommGroup
from echo_plan.specs.faults import StageEffect, slowed_cluster


def step_collectives(traces, timed: Iterable[tuple[CollectiveKind, int, CommGroup]]) -> dict:
    """(kind, group) -> largest message, over the traced stages' collectives and those timed at level 2."""
    out: dict[tuple[CollectiveKind, CommGroup], int] = {}

    def add(kind: CollectiveKind, nbytes: int, group: CommGroup) -> None:
        if group.size > 1 and nbytes > 0:
            key = (kind, group)
            out[key] = max(out.get(key, 0), int(nbytes))

    stage_traces = [traces.block, traces.embedding, traces.output] + [t for _, t in traces.blocks]
    for t in stage_traces:
        for op in t.collectives:
            c = op.collective
            add(c.kind, c.nbytes, c.group)
    for kind, nbytes, group in timed:
        add(kind, nbytes, group)
    return out


def group_label(kind: CollectiveKind, group: CommGroup) -> str:
    return f"{group.kind.value} {kind.value} n={group.size} s={group.stride}"


def traffic_report(cluster: ClusterSpec, collectives: dict) -> dict[str, Any]:
    """The routing and, per collective group, its slowdowns and times (JSON-ready)."""
    net = cluster.network
    pc, ec = cluster.with_routing(Routing.PLANNED.value), cluster.with_routing(Routing.ECMP.value)
    planned, ecmp = collective_model_for(pc), collective_model_for(ec)
    rows = []
    for (kind, group), nbytes in sorted(collectives.items(), key=lambda kv: (kv[0][1].kind.value, kv[0][0].value,
                                                                              kv[0][1].size, kv[0][1].stride)):
        est_e = ecmp.time(kind, nbytes, group, ec)
        est_p = planned.time(kind, nbytes, group, pc)
        s = group_slowdown(kind, group, ec, tree=est_e.algorithm is Algorithm.TREE)
        rows.append({"group": group_label(kind, group), "group_kind": group.kind.value, "collective": kind.value,
                     "ranks": group.size, "stride": group.stride, "bytes": nbytes,
                     "algorithm": est_e.algorithm.value, "slowdown": s.as_json(), "crosses_leaves": s.flows > 0,
                     "time_planned_s": est_p.time_s, "time_ecmp_expected_s": est_e.time_s})
    return {"routing": net.routing.value, "flows_per_connection": net.flows_per_connection,
            "leaf_radix": net.leaf_radix, "uplinks_per_leaf": net.leaf_uplinks,
            "servers_per_leaf": net.servers_per_leaf, "leaves_per_plane": cluster.num_leaves,
            "placement": net.placement.value,
            "failed_uplinks": [list(p) for p in net.failed_uplinks], "groups": rows}


def step_traffic(cluster: ClusterSpec, effects, traces, timed) -> tuple[dict[str, Any], str]:
    """``simulate``'s traffic section and its note; ``effects`` (the faults' stage effects, or None)
    carry failed uplinks, so the section shows the fabric the faulty step sees."""
    fabric = cluster
    if effects and effects[0].failed_uplinks:
        fabric = slowed_cluster(cluster, StageEffect(failed_uplinks=effects[0].failed_uplinks))
    report = traffic_report(fabric, step_collectives(traces, timed))
    crossing = [g for g in report["groups"] if g["crosses_leaves"]]
    worst = max(crossing, key=lambda g: g["slowdown"]["expected"], default=None)
    note = f"routing {cluster.network.routing.value}: {len(crossing)} collective group(s) cross leaves"
    if worst:
        note += (f"; worst under ECMP {worst['group']} x{worst['slowdown']['expected']:.2f} expected, "
                 f"x{worst['slowdown']['p99']:.2f} at p99")
    return report, note


def traffic_table(report: dict[str, Any]):
    """The report as a rich table (``simulate`` without --json)."""
    from rich.table import Table

    crossing = [r for r in report["groups"] if r["slowdown"]["cross_leaf_flows"]]
    inside = len(report["groups"]) - len(crossing)
    t = Table(title=f"Cross-leaf traffic, routing {report['routing']}, {report['flows_per_connection']} flow(s) per "
                    f"connection; {report['leaves_per_plane']} leaf switch(es) per plane ({report['placement']}), "
                    f"{report['servers_per_leaf']} "
                    f"servers and {report['uplinks_per_leaf']} uplinks each. The slowest flow's slowdown under ECMP "
                    "(expected over hash draws, 99th percentile, worst case) and planned routing (C4P); "
                    f"{inside} other group(s) stay inside one leaf (n ranks, stride s)", title_justify="left")
    for col in ("group", "flows", "ECMP", "p99", "worst", "planned", "ms planned", "ms ECMP"):
        t.add_column(col, justify="left" if col == "group" else "right", no_wrap=col == "group")
    for r in crossing:
        s = r["slowdown"]
        t.add_row(r["group"], f"{s['cross_leaf_flows']:,}", f"{s['expected']:.3f}x", f"{s['p99']:.2f}x",
                  f"{s['worst']:.1f}x", f"{s['planned']:.2f}x", f"{r['time_planned_s'] * 1e3:.3f}",
                  f"{r['time_ecmp_expected_s'] * 1e3:.3f}")
    return t
