"""Per-algorithm cost formulas of the NCCL model: step counts, bus factors, latency and bandwidth.

Everything here works on plain numbers (a :class:`Topo` of the group on the cluster and the
:class:`NcclParams`), so it is cheap enough for the search's hot loop. The structure follows NCCL's
tuner (src/graph/tuning.cc): ``time = latency + bytes / algbw`` per (algorithm, protocol), where
latency is a base latency plus one hop latency per step of the algorithm on the tier the step
crosses, and algbw is the bottleneck bandwidth times protocol factors divided by the collective's
bus factor. Constants and their sources are in ``echo_plan/data/nccl.yaml``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_plan.cost.base import Algorithm, Protocol_
from echo_plan.cost.nccl_params import PROTOCOLS, NcclParams
from echo_plan.trace.records import CollectiveKind

LL, LL128, SIMPLE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Topo:
    """How one group lands on the cluster, reduced to the numbers the formulas need."""

    n: int  # ranks in the group
    ppn: int  # ranks of the group per server
    nodes: int  # servers spanned
    nvl_GBps: float  # NVLink bandwidth per GPU, one direction (after efficiency)
    net_rank_GBps: float  # network bandwidth one rank can count on, one direction
    bus_GBps: float  # bottleneck bandwidth of a ring/tree over the group
    intra_lat_scale: float  # cluster NVLink latency / NCCL's reference
    inter_lat_scale: float  # cluster network latency / NCCL's reference
    sm_arch: int
    nvls: bool  # NVLink SHARP usable for this group
    p2p_intra: bool  # a send/recv between neighbours of the group stays inside a server


@dataclass(frozen=True, slots=True)
class Line:
    """One (algorithm, protocol) as a cost line: ``time_us = latency_us + bytes / (1000 x algbw)``.

    ``tree_proto`` is the protocol index when NCCL's tree size correction applies, else -1.
    Lines depend on the group and cluster only, so a model computes them once per group.
    """

    algorithm: Algorithm
    protocol: Protocol_
    latency_us: float
    algbw_GBps: float
    tree_proto: int = -1


def line_time_us(line: Line, nbytes: int, p: NcclParams) -> float:
    bw = line.algbw_GBps
    if line.tree_proto >= 0:
        bw *= tree_correction(p, line.tree_proto, nbytes)
    return line.latency_us + nbytes / (1000.0 * bw)


def bus_factor(kind: CollectiveKind, n: int) -> float:
    """nccl-tests' busbw / algbw for a collective on ``n`` ranks."""
    if n <= 1:
        return 1.0
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0  # broadcast, send/recv


def ring_steps(kind: CollectiveKind, n: int, nodes: int) -> tuple[int, int]:
    """(all steps, steps that cross the network) of a ring collective over n ranks on ``nodes`` servers."""
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (n - 1), (2 * (nodes - 1) if nodes > 1 else 0)
    # all-gather, reduce-scatter, and broadcast as a pipelined chain: n-1 hops
    return n - 1, nodes - 1


def _ll_cap(p: NcclParams, topo: Topo) -> float:
    if topo.nodes == 1:
        table = p.ll_max_bw_single
        arch = max((a for a in table if a <= topo.sm_arch), default=min(table))
        return table[arch]
    return p.ll_max_bw_two_nodes if topo.nodes == 2 else p.ll_max_bw_more_nodes


def _intra_hop(p: NcclParams, topo: Topo, algo: str, proto: int) -> float:
    hop = p.nvlink_hop_us[algo][proto] * topo.intra_lat_scale * p.nvlink_latency_scale[proto]
    if topo.nodes > 1:  # a multi-node ring/tree still posts a network op per step
        overhead = p.net_overhead_us * (p.net_overhead_simple_multiplier if proto == SIMPLE else 1.0)
        hop = max(hop, overhead)
    return hop


def _inter_hop(p: NcclParams, topo: Topo, algo: str, proto: int) -> float:
    # with one rank per server every latency is exposed: NCCL uses the tree's network latency
    table = p.net_hop_us["tree" if topo.ppn == 1 else algo]
    return table[proto] * topo.inter_lat_scale * p.net_latency_scale[proto]


def _base(p: NcclParams, algo: str, proto: int) -> float:
    return p.base_latency_us[algo][proto] * p.base_latency_scale[proto]


def tree_correction(p: NcclParams, proto: int, nbytes: int) -> float:
    """NCCL's medium-size tree slowdown, interpolated in log2(size) so time stays monotone."""
    table = p.tree_correction[proto]
    x = math.log2(max(nbytes, 64) / 64.0)
    if x >= len(table) - 1:
        return table[-1]
    i = int(x)
    frac = x - i
    return table[i] * (1.0 - frac) + table[i + 1] * frac


def _tiered_bw(topo: Topo, factor: float, scale: float) -> float:
    """Bottleneck bandwidth of a protocol: NCCL's protocol ``factor`` on every tier, and the
    calibrated ``scale`` on the NVLink side only (where NCCL's own per-channel protocol caps live):
    a group spanning servers is limited by the slower of its NVLink and network sides."""
    if topo.nodes == 1:
        return topo.nvl_GBps * factor * scale
    if topo.ppn == 1:
        return topo.bus_GBps * factor
    return min(topo.nvl_GBps * factor * scale, topo.ppn * topo.net_rank_GBps * factor)


def ring(kind: CollectiveKind, topo: Topo, p: NcclParams) -> list[Line]:
    steps, inter = ring_steps(kind, topo.n, topo.nodes)
    intra = steps - inter
    bf = bus_factor(kind, topo.n)
    ll_cap = _ll_cap(p, topo)
    out = []
    for proto in (LL, LL128, SIMPLE):
        scale = p.protocol_bw_scale[proto]
        bw = _tiered_bw(topo, p.ring_protocol_factor[proto], scale)
        if proto == LL:
            bw = min(bw, ll_cap * scale)  # calibration scales NCCL's LL bandwidth, cap included
        algbw = bw / bf
        lat = _base(p, "ring", proto) + intra * _intra_hop(p, topo, "ring", proto) \
            + inter * _inter_hop(p, topo, "ring", proto)
        if kind is CollectiveKind.ALL_REDUCE and proto == SIMPLE and topo.nodes > 1:
            lat *= p.ring_plateau_sm80_plus if topo.sm_arch >= 80 else p.ring_plateau_pre_sm80
        out.append(Line(Algorithm.RING, PROTOCOLS[proto], lat, algbw))
    return out


def tree(topo: Topo, p: NcclParams) -> list[Line]:
    """All-reduce over a chain inside each server and a (double binary) tree across servers."""
    factors = p.tree_protocol_factor_single if topo.nodes == 1 else p.tree_protocol_factor_multi
    ll_cap = _ll_cap(p, topo)
    depth = int(math.log2(topo.nodes)) if topo.nodes > 1 else 0
    out = []
    for proto in (LL, LL128, SIMPLE):
        scale = p.protocol_bw_scale[proto]
        bw = _tiered_bw(topo, p.tree_allreduce_factor * factors[proto], scale)
        if proto == LL:
            bw = min(bw, ll_cap * scale)
        algbw = bw * p.tree_algbw_ratio
        lat = _base(p, "tree", proto) + 2.0 * (
            (topo.ppn - 1) * _intra_hop(p, topo, "tree", proto) + depth * _inter_hop(p, topo, "tree", proto))
        out.append(Line(Algorithm.TREE, PROTOCOLS[proto], lat, algbw, tree_proto=proto))
    return out


def nvls(kind: CollectiveKind, topo: Topo, p: NcclParams) -> list[Line]:
    """NVLink SHARP inside one server (Simple only): the switch reduces, so all-reduce moves half."""
    eff = max((v for a, v in p.nvls_efficiency.items() if a <= topo.sm_arch), default=0.0)
    if eff <= 0.0 or topo.nodes != 1 or topo.n < 2:
        return []
    if kind is CollectiveKind.ALL_REDUCE:
        algbw = topo.nvl_GBps * eff * 2.0 / bus_factor(kind, topo.n)
    elif kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        algbw = topo.nvl_GBps * eff * (topo.ppn - 1) / topo.ppn / bus_factor(kind, topo.n)
    else:
        return []
    algbw *= p.protocol_bw_scale[SIMPLE]
    lat = _base(p, "nvls", SIMPLE) + p.nvlink_hop_us["nvls"][SIMPLE] * topo.intra_lat_scale \
        * p.nvlink_latency_scale[SIMPLE]
    return [Line(Algorithm.NVLS, Protocol_.SIMPLE, lat, algbw)]


def p2p_protocol(p: NcclParams, bytes_per_peer: float) -> int:
    """NCCL's send/recv protocol: LL up to the P2P LL threshold, Simple above."""
    return LL if bytes_per_peer <= p.p2p_ll_threshold_bytes else SIMPLE


def send_recv(topo: Topo, p: NcclParams, proto: int) -> Line:
    if topo.p2p_intra:
        hop = p.nvlink_hop_us["ring"][proto] * topo.intra_lat_scale * p.nvlink_latency_scale[proto]
        bw = topo.nvl_GBps
    else:
        hop = p.net_hop_us["ring"][proto] * topo.inter_lat_scale * p.net_latency_scale[proto]
        bw = topo.net_rank_GBps
    bw *= p.ring_protocol_factor[proto] * p.protocol_bw_scale[proto]
    lat = _base(p, "ring", proto) + hop
    return Line(Algorithm.P2P, PROTOCOLS[proto], lat, bw)


def all_to_all(topo: Topo, p: NcclParams, proto: int) -> Line:
    """Grouped send/recv to every peer: NVLink carries the peers in the server, the NICs the rest.

    Latency: the protocol's base latency and one hop of the protocol (pipeline fill), plus a
    posting latency per peer (the LL hop of the tier the peer is on), as peers are visited in turn.
    Bandwidth: each tier's, times the share an all-to-all reaches of it inside a training step
    (``all_to_all_nvlink_efficiency`` / ``all_to_all_net_efficiency``: 1 in NCCL's own model,
    calibrated per cluster; nccl.yaml).
    """
    n, ppn = topo.n, topo.ppn
    intra_peers, inter_peers = ppn - 1, n - ppn
    f = p.ring_protocol_factor[proto] * p.protocol_bw_scale[proto]
    inv = 0.0  # seconds per byte of the slower tier, in 1/GBps: the tiers run concurrently
    if intra_peers:
        inv = max(inv, intra_peers / n / (topo.nvl_GBps * f * p.all_to_all_nvlink_efficiency))
    if inter_peers:
        inv = max(inv, inter_peers / n / (topo.net_rank_GBps * f * p.all_to_all_net_efficiency))
    nv_ll = p.nvlink_hop_us["ring"][LL] * topo.intra_lat_scale * p.nvlink_latency_scale[LL]
    net_ll = p.net_hop_us["ring"][LL] * topo.inter_lat_scale * p.net_latency_scale[LL]
    if inter_peers:
        fill = p.net_hop_us["ring"][proto] * topo.inter_lat_scale * p.net_latency_scale[proto]
    else:
        fill = p.nvlink_hop_us["ring"][proto] * topo.intra_lat_scale * p.nvlink_latency_scale[proto]
    lat = _base(p, "ring", proto) + fill + intra_peers * nv_ll + inter_peers * net_ll
    return Line(Algorithm.P2P, PROTOCOLS[proto], lat, 1.0 / inv)
