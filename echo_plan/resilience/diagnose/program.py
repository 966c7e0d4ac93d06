"""What each rank of a simulated job issues in one step, and how long each op takes on it.

The step comes from ``interop.chakra_step.build_step_graph`` (simulate's own step costs: traced
layers cut at their collectives, the pipeline schedule's sends and receives, DP buckets, the
optimizer), one graph per pipeline stage, walked in its build order as one sequence per rank:
compute segments, collectives (with their group resolved to global ranks by
``interop.chakra_export.group_of``) and point-to-point sends and receives. Overlap between streams
is not kept: a rank's ops run one after another, which is what its records show in the order it
issued them. TP ring exchanges of overlapped TP communication (userbuffers) are left out.

Collective times come from the cluster's collective model; a fault's slower NIC or NVLink times
the collectives that use it on the cluster as ``resilience.faults.slowed_cluster`` slows it, and a
compute fault scales its GPU's compute segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from echo_plan.specs.faults import Fault, FaultKind, StageEffect, nic_ranks, slowed_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.interop.chakra_step import NodeKind

COMP, COLL, SEND, RECV = 0, 1, 2, 3


@dataclass(frozen=True)
class RankFaults:
    """Per rank and per server, what the faults do."""

    compute: np.ndarray  # per rank: compute slower by this factor
    net: np.ndarray  # per rank: its NIC at this fraction of its rate
    nvlink: np.ndarray  # per server: NVLink at this fraction
    gpu_hang: frozenset[int]
    nic_hang: frozenset[int]


def rank_faults(faults: tuple[Fault, ...], world: int, cluster) -> RankFaults:
    gpn = cluster.gpus_per_node
    compute, net = np.ones(world), np.ones(world)
    nvl = np.ones(max(1, -(-world // gpn)))
    gpu_hang: set[int] = set()
    nic_hang: set[int] = set()
    for f in faults:
        if f.kind is FaultKind.STRAGGLER:
            r = int(f.get("rank"))
            compute[r] = max(compute[r], f.get("compute"))
        elif f.kind is FaultKind.NODE:
            n = int(f.get("node"))
            sl = slice(n * gpn, min(world, (n + 1) * gpn))
            compute[sl] = np.maximum(compute[sl], f.get("compute"))
        elif f.kind is FaultKind.NVLINK:
            n = int(f.get("node"))
            if n < nvl.size:
                nvl[n] = min(nvl[n], f.get("bw"))
        elif f.kind is FaultKind.LINK:
            for r in nic_ranks(int(f.get("node")), int(f.get("nic")), cluster):
                if r < world:
                    net[r] = min(net[r], f.get("bw"))
        elif f.kind is FaultKind.GPU_HANG:
            gpu_hang.add(int(f.get("rank")))
        elif f.kind is FaultKind.NIC_HANG:
            nic_hang.update(r for r in nic_ranks(int(f.get("node")), int(f.get("nic")), cluster) if r < world)
    return RankFaults(compute, net, nvl, frozenset(gpu_hang), frozenset(nic_hang))


def stage_programs(graph) -> tuple[tuple[tuple, ...], ...]:
    """Per pipeline stage, its ops in order: (COMP, seconds) | (COLL, kind, group ref, bytes) |
    (SEND or RECV, peer stage, bytes); consecutive compute segments merged."""
    out = []
    for nodes in graph.stages:
        prog: list[tuple] = []
        for n in nodes:
            if n.ring:
                continue
            if n.kind is NodeKind.COMP:
                if prog and prog[-1][0] == COMP:
                    prog[-1] = (COMP, prog[-1][1] + n.duration_s)
                else:
                    prog.append((COMP, n.duration_s))
            elif n.kind is NodeKind.COLL:
                prog.append((COLL, n.coll, n.group, n.nbytes))
            elif n.kind is NodeKind.SEND:
                prog.append((SEND, n.peer_stage, n.nbytes))
            else:
                prog.append((RECV, n.peer_stage, n.nbytes))
        out.append(tuple(prog))
    return tuple(out)


def comm_group(ranks: tuple[int, ...], kind: GroupKind) -> CommGroup:
    rs = sorted(ranks)
    stride = rs[1] - rs[0] if len(rs) > 1 else 1
    return CommGroup(kind, len(rs), max(1, stride), rs[0])


class OpTimer:
    """Collective and transfer times on the cluster as a group's slowest member sees it (cached)."""

    def __init__(self, cluster, comm, gpn: int) -> None:
        self.cluster, self.comm, self.gpn = cluster, comm, gpn
        self._cache: dict[tuple, float] = {}
        self._clusters: dict[tuple[float, float], object] = {}

    def time(self, kind: CollectiveKind, nbytes: int, ranks: tuple[int, ...], gkind: GroupKind,
             net: float = 1.0, nvl: float = 1.0) -> float:
        rs = tuple(sorted(ranks))
        key = (kind, nbytes, rs[1] - rs[0] if len(rs) > 1 else 1, len(rs), rs[0] // self.gpn == rs[-1] // self.gpn,
               net, nvl)
        t = self._cache.get(key)
        if t is None:
            c = self._clusters.get((net, nvl))
            if c is None:
                c = self._clusters[(net, nvl)] = slowed_cluster(self.cluster, StageEffect(1.0, net, nvl))
            t = self._cache[key] = self.comm.time(kind, max(1, nbytes), comm_group(rs, gkind), c).time_s
        return t
