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
from echo_plan.cost.base import Algorithm, CollectiveEstimate, Protocol_
from echo_plan.cost.nccl_algos import Candidate, Topo, bus_factor
from echo_plan.cost.nccl_params import NcclParams, load_default_params
from echo_plan.errors import SpecError
from echo_plan.specs.cluster import ClusterSpec, Fabric
from echo_plan.trace.records import CollectiveKind, CommGroup

_ZERO = CollectiveEstimate(0.0, Algorithm.LOCAL, Protocol_.SIMPLE, 0.0, 0.0)
_ALLREDUCE_LIKE = (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                   CollectiveKind.BROADCAST)


def net_rank_GBps(cluster: ClusterSpec, efficiency: float = 1.0) -> float:
    """Network bandwidth one rank can count on when every GPU of its server communicates.

    The server's usable NIC bandwidth shared by its GPUs. A rail-optimised fabric keeps NCCL's
    traffic on one rail (same-index NICs under the same rail switches), so its spine's
    oversubscription is not charged; a fat-tree's is.
    """
    net = cluster.network
    node = net.nics_per_node * net.nic_GBps * net.nic_efficiency * efficiency
    if net.fabric is Fabric.FAT_TREE:
        node /= net.oversubscription
    return node / cluster.gpus_per_node


def make_topo(group: CommGroup, cluster: ClusterSpec, params: NcclParams) -> Topo:
    gpn = cluster.gpus_per_node
    ppn, nodes = group.placement(gpn)
    nvl = cluster.gpu.nvlink_uni_GBps * params.nvlink_bw_efficiency
    rank_net = net_rank_GBps(cluster, params.net_bw_efficiency)
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
    """NCCL-style collective cost model; memoises per (kind, nbytes, group, cluster) in the instance."""

    def __init__(self, params: NcclParams | None = None, max_cache: int = 500_000) -> None:
        self.params = params if params is not None else load_default_params()
        self.max_cache = max_cache
        self._memo: dict[tuple, CollectiveEstimate] = {}
        self._topos: dict[tuple[int, CommGroup], tuple[ClusterSpec, Topo]] = {}

    # -- public API -------------------------------------------------------------------------
    def time(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> CollectiveEstimate:
        key = (kind, nbytes, group, id(cluster))
        hit = self._memo.get(key)
        if hit is not None and self._topos.get((id(cluster), group), (None,))[0] is cluster:
            return hit
        if group.size <= 1 or nbytes <= 0:
            return _ZERO
        topo = self._topo(group, cluster)
        best = self._choose(kind, nbytes, topo)
        est = self._estimate(kind, nbytes, topo.n, best)
        if len(self._memo) >= self.max_cache:
            self._memo.clear()
        self._memo[key] = est
        return est

    def candidates(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> list[CollectiveEstimate]:
        """Every (algorithm, protocol) considered, fastest first (``comm --all``)."""
        if group.size <= 1 or nbytes <= 0:
            return [_ZERO]
        topo = self._topo(group, cluster)
        cands = self._all(kind, nbytes, topo)
        return [self._estimate(kind, nbytes, topo.n, c) for c in sorted(cands, key=lambda c: c.time_us)]

    def clear(self) -> None:
        self._memo.clear()
        self._topos.clear()

    # -- internals --------------------------------------------------------------------------
    def _topo(self, group: CommGroup, cluster: ClusterSpec) -> Topo:
        key = (id(cluster), group)
        entry = self._topos.get(key)
        if entry is not None and entry[0] is cluster:  # the reference kept in the entry pins the id
            return entry[1]
        if group.size > cluster.num_gpus:
            raise SpecError("group.size", group.size, f"at most the cluster's {cluster.num_gpus} GPUs", cluster.name)
        topo = make_topo(group, cluster, self.params)
        if len(self._topos) >= self.max_cache:
            self._topos.clear()
        self._topos[key] = (cluster, topo)
        return topo

    def _all(self, kind: CollectiveKind, nbytes: int, topo: Topo) -> list[Candidate]:
        p = self.params
        if kind is CollectiveKind.SEND_RECV:
            return [algos.send_recv(nbytes, topo, p, proto) for proto in (algos.LL, algos.SIMPLE)]
        if kind is CollectiveKind.ALL_TO_ALL:
            return [algos.all_to_all(nbytes, topo, p, proto) for proto in (algos.LL, algos.SIMPLE)]
        cands = algos.ring(kind, nbytes, topo, p)
        if kind is CollectiveKind.ALL_REDUCE:
            cands += algos.tree(nbytes, topo, p)
        if topo.nvls:
            cands += algos.nvls(kind, nbytes, topo, p)
        return cands

    def _choose(self, kind: CollectiveKind, nbytes: int, topo: Topo) -> Candidate:
        p = self.params
        if kind is CollectiveKind.SEND_RECV:
            return algos.send_recv(nbytes, topo, p, algos.p2p_protocol(p, nbytes))
        if kind is CollectiveKind.ALL_TO_ALL:
            return algos.all_to_all(nbytes, topo, p, algos.p2p_protocol(p, nbytes / topo.n))
        return min(self._all(kind, nbytes, topo), key=lambda c: c.time_us)

    @staticmethod
    def _estimate(kind: CollectiveKind, nbytes: int, n: int, c: Candidate) -> CollectiveEstimate:
        algbw = nbytes / (c.time_us * 1000.0)  # B/us / 1000 = GB/s
        return CollectiveEstimate(c.time_us * 1e-6, c.algorithm, c.protocol, algbw, algbw * bus_factor(kind, n))


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
