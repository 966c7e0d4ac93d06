"""Fault sensitivity: what one slow GPU, NIC, NVLink domain or server costs a plan.

For each kind of fault and severity the fault is placed on the first GPU of a few pipeline stages
(the first, the middle and the last; every stage when there are at most four) and the plan is
simulated with it; the loss is 1 - healthy step / faulty step (the share of throughput lost), and
the report gives the worst and the best placement. A NIC fault needs more than one server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from echo_plan.specs.faults import Fault, FaultKind, fault_from_mapping

SEVERITIES: dict[FaultKind, tuple[float, ...]] = {
    FaultKind.STRAGGLER: (1.1, 1.25, 1.5),  # compute slower by this factor
    FaultKind.LINK: (0.75, 0.5, 0.25),  # NIC at this fraction of its rate
    FaultKind.NVLINK: (0.75, 0.5, 0.25),
    FaultKind.NODE: (1.1, 1.25, 1.5),
    FaultKind.UPLINK: (1, 8, 16),  # uplinks of one leaf down (under --routing ecmp|planned only)
}
HEADLINE_SEVERITY: dict[FaultKind, float] = {FaultKind.STRAGGLER: 1.25, FaultKind.LINK: 0.5, FaultKind.NVLINK: 0.5,
                                             FaultKind.NODE: 1.25, FaultKind.UPLINK: 8}
WHAT = {FaultKind.STRAGGLER: "one GPU {v:g}x slower", FaultKind.LINK: "one NIC at {v:.0%} rate",
        FaultKind.NVLINK: "one server's NVLink at {v:.0%}", FaultKind.NODE: "one server {v:g}x slower",
        FaultKind.UPLINK: "{v:g} uplink(s) of one leaf down"}


@dataclass(frozen=True, slots=True)
class SensitivityRow:
    kind: FaultKind
    severity: float
    worst_loss: float  # share of throughput lost with the fault at its worst placement
    worst_stage: int
    best_loss: float
    best_stage: int

    @property
    def what(self) -> str:
        return WHAT[self.kind].format(v=self.severity)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "severity": self.severity, "what": self.what,
                "worst_loss": self.worst_loss, "worst_stage": self.worst_stage,
                "best_loss": self.best_loss, "best_stage": self.best_stage}


def placements(pp: int) -> tuple[int, ...]:
    return tuple(range(pp)) if pp <= 4 else tuple(sorted({0, pp // 2, pp - 1}))


def fault_at(kind: FaultKind, severity: float, stage: int, plan, cluster) -> Fault:
    rank = stage * plan.stage_ranks
    node, local = divmod(rank, cluster.gpus_per_node)
    if kind is FaultKind.UPLINK:  # the leaf above the stage's first server
        leaf = int(cluster.leaf_of(node))
        return fault_from_mapping({"kind": kind.value, "leaf": leaf, "down": int(severity)}, "sensitivity")
    key = "bw" if kind in (FaultKind.LINK, FaultKind.NVLINK) else "compute"
    data: dict[str, Any] = {"kind": kind.value, key: severity}
    if kind is FaultKind.STRAGGLER:
        data["rank"] = rank
    else:
        data["node"] = node
    if kind is FaultKind.LINK:
        data["nic"] = local * cluster.network.nics_per_node // cluster.gpus_per_node
    return fault_from_mapping(data, "sensitivity")


def applies(kind: FaultKind, cluster) -> bool:
    """A NIC fault needs several servers; an uplink fault the leaf/spine model and several leaves."""
    if kind is FaultKind.LINK:
        return cluster.num_nodes > 1
    if kind is FaultKind.UPLINK:
        return cluster.network.routing.value != "none" and cluster.num_leaves > 1 and cluster.network.leaf_uplinks > 1
    return True


def sensitivity(plan, cluster, step: Callable[[tuple[Fault, ...]], float],
                kinds: tuple[FaultKind, ...] | None = None, severities: dict | None = None,
                progress: Callable[[int, int, str], None] | None = None) -> tuple[float, tuple[SensitivityRow, ...]]:
    """(healthy step, rows); ``step(faults)`` is the simulated step time with those faults."""
    kinds = kinds or tuple(k for k in SEVERITIES if not k.hang and applies(k, cluster))
    severities = severities or SEVERITIES
    healthy = step(())
    rows = []
    up = cluster.network.leaf_uplinks
    todo = [(k, s) for k in kinds if k in severities
            for s in (sorted({min(v, up - 1) for v in severities[k]}) if k is FaultKind.UPLINK else severities[k])]
    for i, (kind, sev) in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), WHAT[kind].format(v=sev))
        losses = [(1.0 - healthy / step((fault_at(kind, sev, st, plan, cluster),)), st) for st in placements(plan.pp)]
        worst, best = max(losses), min(losses)
        rows.append(SensitivityRow(kind, sev, worst[0], worst[1], best[0], best[1]))
    return healthy, tuple(rows)
