"""Which flows of a collective cross leaf switches, and the slowdown routing gives them.

The fabric is two tiers (``NetworkSpec``: leaf radix, uplinks per leaf, rail-optimised or not):
servers fill leaves in order (``servers_per_leaf``), on a rail-optimised fabric one leaf per rail
plane (NIC ``i`` of every server on plane ``i``), on a fat-tree one leaf for all a server's NICs.

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

from echo_plan.cost.ecmp import NO_SLOWDOWN, BinSet, Slowdown, planned_load, slowdown
from echo_plan.specs.cluster import ClusterSpec, Fabric, Routing
from echo_plan.trace.records import CollectiveKind, CommGroup

RING_KINDS = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
              CollectiveKind.BROADCAST)
MAX_COPY_RANKS = 1 << 17  # ranks enumerated per group; beyond this the copies are sampled by stride


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


def connections(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> Counter:
    """(source server, destination server, rail) -> weight, for all copies of the group."""
    gpn = cluster.gpus_per_node
    nics = cluster.network.nics_per_node
    rail_optimised = cluster.network.fabric is Fabric.RAIL_OPTIMIZED

    def rail(rank: int) -> int:
        return (rank % gpn) * nics // gpn if rail_optimised else 0

    out: Counter = Counter()
    pairwise = kind is CollectiveKind.SEND_RECV and group.size == 2
    for ranks in group_copies(group, cluster.num_gpus, pairwise):
        if pairwise:
            a, b = ranks
            if a // gpn != b // gpn:
                out[(a // gpn, b // gpn, rail(b))] += 1
                out[(b // gpn, a // gpn, rail(a))] += 1
        elif kind is CollectiveKind.ALL_TO_ALL:
            by_node: dict[int, list[int]] = defaultdict(list)
            for r in ranks:
                by_node[r // gpn].append(r)
            for src, mine in by_node.items():
                for dst, theirs in by_node.items():
                    if src != dst:
                        for r in theirs:
                            out[(src, dst, rail(r))] += len(mine)
        elif tree:
            nodes = sorted({r // gpn for r in ranks})
            first = {}
            for r in ranks:
                first.setdefault(r // gpn, r)
            for order in (nodes, nodes[1:] + nodes[:1]):  # the double binary tree: a tree and a shifted one
                for a, b in _tree_edges(order):
                    out[(a, b, rail(first[a]))] += 1
                    out[(b, a, rail(first[b]))] += 1
        else:  # a ring (also a send/recv chain)
            for i, a in enumerate(ranks):
                b = ranks[(i + 1) % len(ranks)]
                if a // gpn != b // gpn:
                    out[(a // gpn, b // gpn, rail(b))] += 1
    return out


def bin_sets(kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec, tree: bool = False) -> list[BinSet]:
    """The uplink and downlink sets of every leaf that flows of the group cross."""
    net = cluster.network
    if group.size <= 1 or cluster.num_leaves <= 1:
        return []
    per_leaf = net.servers_per_leaf
    nodes_spanned = group.placement(cluster.gpus_per_node)[1]
    if nodes_spanned <= 1 and kind is not CollectiveKind.SEND_RECV:
        return []
    conns = connections(kind, group, cluster, tree)
    out_weight: Counter = Counter()
    in_weight: Counter = Counter()
    for (src, dst, rail), w in conns.items():
        out_weight[(src, rail)] += w
        in_weight[(dst, rail)] += w
    cap = (net.uplink_bw_Gbps or net.nic_bw_Gbps) / net.nic_bw_Gbps
    k = net.flows_per_connection
    flows: dict[tuple, Counter] = defaultdict(Counter)
    for (src, dst, rail), w in conns.items():
        ls, ld = src // per_leaf, dst // per_leaf
        if ls == ld:
            continue
        demand = round(w / max(out_weight[(src, rail)], in_weight[(dst, rail)]) / k / cap, 12)
        flows[(rail, ls, "up")][demand] += k
        flows[(rail, ld, "down")][demand] += k
    failed = dict(net.failed_uplinks)
    shapes: Counter = Counter()
    for (rail, leaf, _dir), c in flows.items():
        down = failed.get(leaf, 0) if rail == 0 else 0
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
