"""Which flows of a collective cross leaf switches, and the slowdown routing gives them.

The fabric is two tiers (``NetworkSpec``: leaf radix, uplinks per leaf, rail-optimised or not):
servers fill leaves in order (``servers_per_leaf``; or round-robin, ``network.placement``), on a
rail-optimised fabric one leaf per rail plane (NIC ``i`` of every server on plane ``i``), on a
fat-tree one leaf for all a server's NICs.

A group stands for all its copies in the plan (``CommGroup`` is the copy at rank 0; the replay
times every copy alike), so the flows counted are those of every copy that tiles the cluster
(translates by ``0 .. stride-1`` within a block of ``stride x size`` ranks, and every block; a
two-rank send/recv group: every pair ``(r, r + stride)``, both ways, as 1F1B sends activations and
gradients at once), all at the same time (a judgement: the copies of a data-parallel reduction run
in the same phase of the step, not at the same instant). The traffic of one copy on servers:

* ring collectives: one connection from each rank to the next (wrapping round), as NCCL's ring;
* tree all-reduce: the edges of a binary tree over the copy's servers and of its mirror (NCCL's
  double binary tree), both ways;
* all-to-all: every rank to every rank of another server, carried on the receiver's rail (PXN);
* send/recv: the pair.

Connections between two servers on one rail add up (several ranks share a NIC), each asks its NIC's
rate split among that NIC's connections (the sender's or the receiver's, whichever has more), and
opens ``flows_per_connection`` flows that split it.
Every leaf's uplinks (flows that leave it) and downlinks (flows that enter it) are one bin set of
``ecmp.slowdown``; a leaf of ``failed_uplinks`` (plane 0) has fewer live links. A group inside one
leaf has no cross-leaf flow and no slowdown under any routing.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from echo_plan.cost.ecmp import NO_SLOWDOWN, BinSet, Slowdown, planned_load, slowdown
from echo_plan.specs.cluster import ClusterSpec, Fabric, Routing
from echo_plan.trace.records import CollectiveKind, CommGroup


def group_copies(group: CommGroup, num_gpus: int, pairwise: bool) -> list[tuple[int, ...]]:
    """Every copy of ``group`` in a cluster of ``num_gpus`` GPUs (ranks of each)."""
    n, s = group.size, group.stride
    span = (n - 1) * s
    if pairwise:
        return [(r, r + s) for r in range(0, num_gpus - s)]
    block = s * n
    out = []
    for base in range(0, num_gpus, block):
        for off in range(s):
            first = base + off
            if first + span < num_gpus:
                out.append(tuple(first + i * s for i in range(n)))
    return out


def _tree_edges(nodes: list[int]) -> list[tuple[int, int]]:
    """Parent-child edges of a balanced in-order binary tree over ``nodes``."""
    edges: list[tuple[int, int]] = []

    def build(lo: int, hi: int) -> int | None:
        if lo > hi:
            return None
        mid = (lo + hi) // 2
        for child in (build(lo, mid - 1), build(mid + 1, hi)):
            if child is not None:
                edges.append((nodes[mid], child))
        return nodes[mid]

    build(0, len(nodes) - 1)
    return edges


Conns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # source server, destination server, rail, weight


def connections(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> Conns:
    """Server-to-server connections of all copies of the group, one entry per (source, destination,
    rail) with its weight (how many rank pairs share it)."""
    gpn = cluster.gpus_per_node
    nics = cluster.network.nics_per_node
    planes = nics if cluster.network.fabric is Fabric.RAIL_OPTIMIZED else 1

    def rail(rank):
        return (rank % gpn) * nics // gpn if planes > 1 else rank * 0

    parts: list[tuple] = []
    pairwise = kind is CollectiveKind.SEND_RECV and group.size == 2
    copies = group_copies(group, cluster.num_gpus, pairwise)
    if pairwise or not (tree or kind is CollectiveKind.ALL_TO_ALL):  # pairs both ways, or rings
        arr = np.array(copies, dtype=np.int64).reshape(len(copies), -1)
        a = arr.ravel()
        b = (np.stack([arr[:, 1], arr[:, 0]], axis=1) if pairwise else np.roll(arr, -1, axis=1)).ravel()
        parts.append((a // gpn, b // gpn, rail(b), np.ones(a.size)))
    elif kind is CollectiveKind.ALL_TO_ALL:  # every rank to every rank of another server, on the receiver's rail
        for ranks in copies:
            r = np.array(ranks, dtype=np.int64)
            nodes, idx = np.unique(r // gpn, return_inverse=True)
            per = np.zeros((nodes.size, planes))
            np.add.at(per, (idx, rail(r)), 1.0)
            size = per.sum(axis=1)
            w = size[:, None, None] * per[None, :, :]  # [source, destination, rail]
            w[np.arange(nodes.size), np.arange(nodes.size), :] = 0.0
            si, di, ri = np.nonzero(w)
            parts.append((nodes[si], nodes[di], ri, w[si, di, ri]))
    else:  # tree all-reduce: a binary tree over the copy's servers and its shifted mirror, both ways
        src, dst, rl = [], [], []
        for ranks in copies:
            first: dict[int, int] = {}
            for r in ranks:
                first.setdefault(r // gpn, r)
            nodes = sorted(first)
            for order in (nodes, nodes[1:] + nodes[:1]):
                for x, y in _tree_edges(order):
                    src += [x, y]
                    dst += [y, x]
                    rl += [int(rail(first[y])), int(rail(first[x]))]
        parts.append((np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64), np.array(rl, dtype=np.int64),
                      np.ones(len(src))))
    src, dst, rl, w = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0) for i in range(4))
    keep = src != dst
    src, dst, rl, w = src[keep].astype(np.int64), dst[keep].astype(np.int64), rl[keep].astype(np.int64), w[keep]
    key = (src * cluster.num_nodes + dst) * planes + rl
    uniq, inv = np.unique(key, return_inverse=True)
    weight = np.bincount(inv, weights=w, minlength=uniq.size)
    return uniq // planes // cluster.num_nodes, uniq // planes % cluster.num_nodes, uniq % planes, weight


def bin_sets(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> list[BinSet]:
    """The uplink and downlink sets of every leaf that flows of the group cross."""
    net = cluster.network
    if group.size <= 1 or cluster.num_leaves <= 1:
        return []
    if group.placement(cluster.gpus_per_node)[1] <= 1 and kind is not CollectiveKind.SEND_RECV:
        return []
    src, dst, rail, w = connections(kind, group, cluster, tree)
    if src.size == 0:
        return []
    planes = int(rail.max()) + 1
    out_w = np.bincount(src * planes + rail, weights=w)
    in_w = np.bincount(dst * planes + rail, weights=w)
    cap = (net.uplink_bw_Gbps or net.nic_bw_Gbps) / net.nic_bw_Gbps
    k = net.flows_per_connection
    ls, ld = cluster.leaf_of(src), cluster.leaf_of(dst)
    cross = ls != ld
    if not cross.any():
        return []
    demand = np.round(w / np.maximum(out_w[src * planes + rail], in_w[dst * planes + rail]) / k / cap, 12)[cross]
    leaves = cluster.num_leaves
    sets: dict[int, Counter] = defaultdict(Counter)  # set id: (direction, rail, leaf)
    levels, level = np.unique(demand, return_inverse=True)
    for direction, leaf in ((0, ls[cross]), (1, ld[cross])):
        ids = (direction * planes + rail[cross]) * leaves + leaf
        keys, counts = np.unique(ids * levels.size + level, return_counts=True)
        for key, n in zip(keys.tolist(), counts.tolist()):
            sets[key // levels.size][float(levels[key % levels.size])] += n * k
    failed = dict(net.failed_uplinks)
    shapes: Counter = Counter()
    for sid, c in sets.items():
        leaf, plane = sid % leaves, (sid // leaves) % planes
        down = failed.get(leaf, 0) if plane == 0 else 0
        shapes[(tuple(sorted(c.items())), down)] += 1
    up = net.leaf_uplinks
    return [BinSet(up, fl, down, copies) for (fl, down), copies in sorted(shapes.items())]


def group_slowdown(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> Slowdown:
    """ECMP and planned slowdowns of the group's slowest cross-leaf flow (1 inside one leaf)."""
    sets = bin_sets(kind, group, cluster, tree)
    if not sets:
        return NO_SLOWDOWN
    return slowdown(sets, seed=cluster.network.ecmp_seed)


def routing_factor(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> float:
    """What the cluster's routing divides the group's network bandwidth by: 1 for ``none``; the
    planned bound for ``planned``; the expected ECMP slowdown for ``ecmp``."""
    routing = cluster.network.routing
    if routing is Routing.NONE:
        return 1.0
    if routing is Routing.PLANNED:  # the bound alone: no distribution needed
        sets = bin_sets(kind, group, cluster, tree)
        return max([1.0] + [planned_load(s) for s in sets if s.count])
    return group_slowdown(kind, group, cluster, tree).expected
