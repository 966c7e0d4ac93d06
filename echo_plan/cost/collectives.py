"""The analytical NCCL collective model: :class:`NcclModel` implements ``CollectiveModel``.

For a collective of ``nbytes`` (nccl-tests' size convention) on a :class:`CommGroup`, the group's
placement on servers decides the tiers: a group inside one server uses NVLink only; a group with
one rank per server uses the network for every hop with that rank's share of the NICs (one NIC
per GPU on the usual 8-NIC servers); a group spanning servers with several ranks per server is
hierarchical (the ring crosses the network bottleneck, the tree is an intra-server chain plus an
inter-server tree). Every (algorithm, protocol) NCCL would consider is costed as NCCL's tuner does
(``echo_plan/cost/nccl_algos.py``, constants in ``echo_plan/data/nccl.yaml``) and the fastest
wins, except send/recv and all-to-all whose protocol NCCL picks by a size threshold.

``collective_model_for(cluster)`` applies a calibration written by ``echo-plan calibrate nccl``
(``cluster.calibration["nccl"]["params"]``) when the cluster carries one.
"""

from __future__ import annotations

from typing import Any, Mapping

from echo_plan.cost import nccl_algos as algos
from echo_plan.cost.base import Algorithm, CollectiveEstimate, CollectiveModel, Protocol_
from echo_plan.cost.nccl_algos import Line, Topo, bus_factor
from echo_plan.cost.nccl_params import PROTOCOLS, NcclParams, load_default_params
from echo_plan.errors import SpecError
from echo_plan.specs.cluster import ClusterSpec, Fabric, Routing
from echo_plan.trace.records import CollectiveKind, CommGroup

_ZERO = CollectiveEstimate(0.0, Algorithm.LOCAL, Protocol_.SIMPLE, 0.0, 0.0)
_ALLREDUCE_LIKE = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                   CollectiveKind.BROADCAST)


def net_rank_GBps(cluster: ClusterSpec, efficiency: float = 1.0) -> float:
    """Network bandwidth one rank can count on when every GPU of its server communicates.

    The server's usable NIC bandwidth shared by its GPUs (a server's NICs serve its own GPUs, also
    inside an NVLink domain of several servers). A rail-optimised fabric keeps NCCL's
    traffic on one rail (same-index NICs under the same rail switches), so its spine's
    oversubscription is not charged; a fat-tree's is. Under ``--routing ecmp|planned`` the leaf/spine
    layer is modelled instead (``make_topo``), so no flat oversubscription is charged.
    """
    net = cluster.network
    node = net.nics_per_node * net.nic_GBps * net.nic_efficiency * efficiency
    if net.fabric is Fabric.FAT_TREE and net.routing is Routing.NONE:
        node /= net.oversubscription
    return node / cluster.gpus_per_node


def make_topo(group: CommGroup, cluster: ClusterSpec, params: NcclParams, kind: CollectiveKind | None = None,
              tree: bool = False) -> Topo:
    """The group's tiers on the cluster. With ``kind`` and a cluster routing other than ``none``, the
    network side is slowed by the leaf/spine crossing of the group's flows (``cost/fabric.py``: the
    slowest flow paces the ring or tree; ``tree`` picks the tree's flows)."""
    gpn = cluster.domain_gpus  # NVLink reaches the whole domain (one server, or an NVL72 rack)
    ppn, nodes = group.placement(gpn)
    nvl = cluster.gpu.nvlink_uni_GBps * params.nvlink_bw_efficiency
    if ppn >= 2:
        nvl *= 1.0 - params.nvlink_group_loss / ppn
    rank_net = net_rank_GBps(cluster, params.net_bw_efficiency)
    if kind is not None and cluster.network.routing is not Routing.NONE:
        from echo_plan.cost.fabric import routing_factor  # deferred: loads numpy

        rank_net /= routing_factor(kind, group, cluster, tree)
    if nodes == 1:
        bus = nvl
    elif ppn == 1:
        bus = rank_net
    else:
        bus = min(nvl, ppn * rank_net)
    return Topo(
        n=group.size, ppn=ppn, nodes=nodes, nvl_GBps=nvl, net_rank_GBps=rank_net, bus_GBps=bus,
        intra_lat_scale=cluster.nvlink_latency_us / params.reference_nvlink_latency_us,
        inter_lat_scale=cluster.network.latency_us / params.reference_net_latency_us,
        sm_arch=cluster.gpu.sm_arch, nvls=cluster.gpu.nvls and nodes == 1 and ppn >= 2,
        p2p_intra=gpn > 1 and group.stride < gpn,
    )


class NcclModel:
    """NCCL-style collective cost model.

    Two explicit caches live in the instance: the cost lines of each (kind, group, cluster) (they
    do not depend on the size) and the estimates per (kind, nbytes, group, cluster). Entries keep a
    reference to their cluster, so a cluster object's id cannot be reused while it is cached.
    """

    def __init__(self, params: NcclParams | None = None, max_cache: int = 500_000) -> None:
        self.params = params if params is not None else load_default_params()
        self.max_cache = max_cache
        self._memo: dict[tuple, tuple[ClusterSpec, CollectiveEstimate]] = {}
        self._lines: dict[tuple, tuple[ClusterSpec, Topo, list[Line]]] = {}

    # -- public API -------------------------------------------------------------------------
    def time(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> CollectiveEstimate:
        key = (kind, nbytes, group, id(cluster))
        hit = self._memo.get(key)
        if hit is not None and hit[0] is cluster:
            return hit[1]
        if group.size <= 1 or nbytes <= 0:
            return _ZERO
        topo, lines = self._lines_for(kind, group, cluster)
        p = self.params
        if kind is CollectiveKind.SEND_RECV:
            best, t = self._by_threshold(lines, p, nbytes, nbytes)
        elif kind is CollectiveKind.ALL_TO_ALL:
            best, t = self._by_threshold(lines, p, nbytes, nbytes / topo.n)
        else:
            best, t = lines[0], algos.line_time_us(lines[0], nbytes, p)
            for line in lines[1:]:
                lt = algos.line_time_us(line, nbytes, p)
                if lt < t:
                    best, t = line, lt
        est = _estimate(kind, nbytes, topo.n, best, t)
        if len(self._memo) >= self.max_cache:
            self._memo.clear()
        self._memo[key] = (cluster, est)
        return est

    def candidates(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> list[CollectiveEstimate]:
        """Every (algorithm, protocol) considered, fastest first (``comm --all``)."""
        if group.size <= 1 or nbytes <= 0:
            return [_ZERO]
        topo, lines = self._lines_for(kind, group, cluster)
        ests = [_estimate(kind, nbytes, topo.n, line, algos.line_time_us(line, nbytes, self.params)) for line in lines]
        return sorted(ests, key=lambda e: e.time_s)

    def lines(self, kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec) -> tuple[Topo, list[Line]]:
        """The cost lines (one per algorithm/protocol) of ``kind`` on ``group`` (for vectorised fits)."""
        return self._lines_for(kind, group, cluster)

    def clear(self) -> None:
        self._memo.clear()
        self._lines.clear()

    # -- internals --------------------------------------------------------------------------
    @staticmethod
    def _by_threshold(lines: list[Line], p: NcclParams, nbytes: int, per_peer: float) -> tuple[Line, float]:
        want = PROTOCOLS[algos.p2p_protocol(p, per_peer)]
        line = next(ln for ln in lines if ln.protocol is want)
        return line, algos.line_time_us(line, nbytes, p)

    def _lines_for(self, kind: CollectiveKind, group: CommGroup, cluster: ClusterSpec) -> tuple[Topo, list[Line]]:
        key = (kind, group, id(cluster))
        entry = self._lines.get(key)
        if entry is not None and entry[0] is cluster:
            return entry[1], entry[2]
        if group.size > cluster.num_gpus:
            raise SpecError("group.size", group.size, f"at most the cluster's {cluster.num_gpus} GPUs", cluster.name)
        topo = make_topo(group, cluster, self.params, kind)
        p = self.params
        if kind is CollectiveKind.SEND_RECV:
            lines = [algos.send_recv(topo, p, proto) for proto in (algos.LL, algos.SIMPLE)]
        elif kind is CollectiveKind.ALL_TO_ALL:
            lines = [algos.all_to_all(topo, p, proto) for proto in (algos.LL, algos.SIMPLE)]
        else:
            lines = algos.ring(kind, topo, p)
            if kind is CollectiveKind.ALL_REDUCE:
                crossed = cluster.network.routing is not Routing.NONE and topo.nodes > 1
                lines += algos.tree(make_topo(group, cluster, p, kind, tree=True) if crossed else topo, p)
            if topo.nvls:
                lines += algos.nvls(kind, topo, p)
        if len(self._lines) >= self.max_cache:
            self._lines.clear()
        self._lines[key] = (cluster, topo, lines)
        return topo, lines


def _estimate(kind: CollectiveKind, nbytes: int, n: int, line: Line, time_us: float) -> CollectiveEstimate:
    algbw = nbytes / (time_us * 1000.0)  # bytes/us / 1000 = GB/s
    return CollectiveEstimate(time_us * 1e-6, line.algorithm, line.protocol, algbw, algbw * bus_factor(kind, n))


def params_from_calibration(calibration: Mapping[str, Any], base: NcclParams | None = None,
                            context: str = "cluster calibration") -> NcclParams:
    """NcclParams with the fitted values of ``calibration["nccl"]["params"]`` applied (if any)."""
    params = base if base is not None else load_default_params()
    nccl = calibration.get("nccl") if isinstance(calibration, Mapping) else None
    if nccl is None:
        return params
    if not isinstance(nccl, Mapping) or not isinstance(nccl.get("params"), Mapping):
        raise SpecError("calibration.nccl.params", nccl, "a mapping of fitted NCCL model parameters", context)
    return params.with_calibration(nccl["params"], context=f"{context}: calibration.nccl.params")


def collective_model_for(cluster: ClusterSpec) -> NcclModel:
    """The NCCL model for ``cluster``, calibrated when the cluster file carries a calibration."""
    return NcclModel(params_from_calibration(cluster.calibration, context=cluster.name))


class CollectiveTimes:
    """``(kind, nbytes, group) -> seconds`` of one collective model on one cluster, remembered in
    ``store``: a dict its owner keeps and may share between instances (the simulation memo keeps one
    for every model and cluster it sees), keyed by the model, the cluster's key and the collective."""

    __slots__ = ("model", "cluster", "cluster_key", "store")

    def __init__(self, model: CollectiveModel, cluster: ClusterSpec, cluster_key: str, store: dict) -> None:
        self.model, self.cluster, self.cluster_key, self.store = model, cluster, cluster_key, store

    @staticmethod
    def timed(store: dict, cluster_key: str) -> list[tuple[CollectiveKind, int, CommGroup]]:
        """(kind, nbytes, group) of every collective timed into ``store`` on that cluster, by any model."""
        return [(k[2], k[3], k[4]) for k in store if k[1] == cluster_key]

    def __call__(self, kind: CollectiveKind, nbytes: int, group: CommGroup) -> float:
        key = (self.model, self.cluster_key, kind, nbytes, group)  # the layout ``timed`` reads
        t = self.store.get(key)
        if t is None:
            t = self.store[key] = self.model.time(kind, nbytes, group, self.cluster).time_s
        return t
