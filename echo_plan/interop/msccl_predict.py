"""Predict how long an MSCCL-IR algorithm takes on a cluster: an event-driven, flow-level replay.

Model
-----
* MSCCL GPU ``i`` is rank ``group.ranks()[i]``; ranks fill servers in order, so two GPUs talk over
  NVLink when they share a server and over their NICs otherwise.
* Each thread block runs its steps in order; a step also waits for the steps it names in
  ``depid``/``deps``. A receiving step waits for the matching message (the k-th send from GPU a to
  b on a channel meets the k-th receive); a step that receives and sends (rcs, rrs, rrcs) forwards
  once its message has arrived (store and forward per step). Senders do not wait for receivers
  (NCCL connections have buffers).
* A message of ``cnt`` chunks (``chunk = size / nchunksperloop``) flows over resources: the
  sender's NVLink egress and the receiver's NVLink ingress inside a server, the sender's and the
  receiver's NIC across servers. Concurrent messages share each resource max-min fairly (a fluid
  model, recomputed whenever a message starts or ends). A sender's step ends when its bytes have
  left; the message arrives one per-step latency later.
* Local steps (cpy, re) stream through HBM: a copy reads and writes the chunk, a reduction reads
  two and writes one. nop only waits.
* The protocol (``proto`` of the algorithm) scales bandwidth (LL sends flags with every 8 bytes of
  data) and sets latencies; one base latency per collective call is added, as NCCL's model does.

Assumed, not modelled: a single thread block is taken to drive its link at full rate (real MSCCL
needs several channels/instances for that on NVLink, so single-channel algorithms are predicted
optimistic), message pipelining across MSCCL loops, PCIe and switch contention.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from echo_plan.errors import FileFormatError, SpecError
from echo_plan.interop.msccl import MscclAlgorithm, Step, StepType, connections
from echo_plan.specs.cluster import ClusterSpec, Fabric
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.cost.collectives import params_from_calibration

if TYPE_CHECKING:
    from echo_plan.cost.nccl_params import NcclParams

PROTO_INDEX = {"LL": 0, "LL128": 1, "Simple": 2}  # order of the NCCL model's per-protocol triples

BUS_FACTOR = {  # nccl-tests: busbw = algbw x this (n ranks)
    CollectiveKind.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    CollectiveKind.ALL_GATHER: lambda n: (n - 1) / n,
    CollectiveKind.REDUCE_SCATTER: lambda n: (n - 1) / n,
    CollectiveKind.ALL_TO_ALL: lambda n: (n - 1) / n,
    CollectiveKind.BROADCAST: lambda n: 1.0,
}


@dataclass(frozen=True, slots=True)
class LinkParams:
    """Bandwidths (GB/s, one direction) and latencies (s) the prediction uses, with the protocol's."""

    nvlink_GBps: float  # per GPU, NCCL's links x per-link rate
    nic_GBps: float  # per NIC, usable
    hbm_GBps: float
    nvlink_step_s: float
    net_step_s: float
    base_s: float
    bw_factor: float

    @classmethod
    def from_cluster(cls, cluster: ClusterSpec, proto: str, params: "NcclParams | None" = None) -> "LinkParams":
        """The NCCL model's numbers (ring column, since an MSCCL step is a ring-like hop), with the
        cluster's calibration applied, so MSCCL and NCCL predictions share their constants
        (NCCL tuning.cc, see echo_plan/data/nccl.yaml)."""
        p = params if params is not None else params_from_calibration(cluster.calibration, context=cluster.name)
        i = PROTO_INDEX[proto]
        net = cluster.network
        nic = net.nic_GBps * net.nic_efficiency * p.net_bw_efficiency
        if net.fabric is Fabric.FAT_TREE:  # as the NCCL model: a rail-optimised fabric keeps traffic on its rail
            nic /= net.oversubscription
        ppn = cluster.gpus_per_node  # the algorithms here span whole servers
        return cls(
            nvlink_GBps=cluster.gpu.nvlink_uni_GBps * p.nvlink_bw_efficiency
            * ((1.0 - p.nvlink_group_loss / ppn) if ppn >= 2 else 1.0),
            nic_GBps=nic,
            hbm_GBps=cluster.gpu.hbm_bw_GBps,
            nvlink_step_s=p.nvlink_hop_us["ring"][i] * cluster.nvlink_latency_us / p.reference_nvlink_latency_us
            * p.nvlink_latency_scale[i] * 1e-6,
            net_step_s=p.net_hop_us["ring"][i] * net.latency_us / p.reference_net_latency_us
            * p.net_latency_scale[i] * 1e-6,
            base_s=p.base_latency_us["ring"][i] * p.base_latency_scale[i] * 1e-6,
            bw_factor=p.ring_protocol_factor[i] * p.protocol_bw_scale[i],
        )


@dataclass(frozen=True, slots=True)
class MscclPrediction:
    algorithm: str
    kind: CollectiveKind
    nbytes: int
    ngpus: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    messages: int
    nvlink_bytes: float  # bytes moved over NVLink, all GPUs together
    network_bytes: float
    gpu_end_s: tuple[float, ...]  # when each GPU finished its last step (base latency excluded)


def default_group(algo: MscclAlgorithm) -> CommGroup:
    return CommGroup(GroupKind.WORLD, algo.ngpus, 1, 0)


def predict(algo: MscclAlgorithm, nbytes: int, cluster: ClusterSpec, group: CommGroup | None = None,
            params: "NcclParams | None" = None) -> MscclPrediction:
    """Time of ``algo`` moving ``nbytes`` (nccl-tests size) with its GPUs placed as ``group``."""
    kind = algo.kind
    if kind is None:  # parse_msccl already refuses these
        raise FileFormatError(algo.path, f"collective {algo.coll!r} is not supported")
    group = group or default_group(algo)
    if group.size != algo.ngpus:
        raise SpecError("group size", group.size, f"the algorithm {algo.name} is written for {algo.ngpus} GPUs")
    ranks = group.ranks()
    if max(ranks) >= cluster.num_gpus:
        raise SpecError("cluster", cluster.name, f"needs at least {max(ranks) + 1} GPUs for this placement, "
                                                 f"has {cluster.num_gpus}")
    if nbytes < 0:
        raise SpecError("size", nbytes, "a size in bytes >= 0")
    return _Replay(algo, nbytes, cluster, ranks, LinkParams.from_cluster(cluster, algo.proto, params)).run()


class _Replay:
    def __init__(self, algo: MscclAlgorithm, nbytes: int, cluster: ClusterSpec, ranks: tuple[int, ...],
                 link: LinkParams) -> None:
        self.algo = algo
        self.nbytes = nbytes
        self.chunk = algo.chunk_bytes(nbytes)
        self.p = link
        gpn, nics = cluster.gpus_per_node, cluster.network.nics_per_node
        self.node = [r // gpn for r in ranks]
        self.nic = [(r // gpn, (r % gpn) * nics // gpn) for r in ranks]
        # message matching: (src, dst, chan) -> index of each step among that connection's sends/receives
        self.send_msg: dict[tuple[int, int, int], tuple[tuple[int, int, int], int]] = {}
        self.recv_msg: dict[tuple[int, int, int], tuple[tuple[int, int, int], int]] = {}
        for conn, (sends, recvs) in connections(algo).items():
            for k, (ref, _) in enumerate(sends):
                self.send_msg[ref] = (conn, k)
            for k, (ref, _) in enumerate(recvs):
                self.recv_msg[ref] = (conn, k)
        self.now = 0.0
        self.done: set[tuple[int, int, int]] = set()  # (gpu, tb, step)
        self.arrived: set[tuple[tuple[int, int, int], int]] = set()
        self.pos = {(g.id, tb.id): 0 for g in algo.gpus for tb in g.tbs}
        self.phase = {key: "start" for key in self.pos}  # start -> recv -> busy
        self.tbs = {(g.id, tb.id): tb for g in algo.gpus for tb in g.tbs}
        self.dep_waiters: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        self.msg_waiters: dict[tuple[tuple[int, int, int], int], tuple[int, int]] = {}
        self.flows: dict[int, list] = {}  # id -> [remaining bytes, resources, tb key, message, latency]
        self.timers: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.gpu_end = [0.0] * algo.ngpus
        self.messages = 0
        self.nvlink_bytes = 0.0
        self.network_bytes = 0.0

    # -- the state machine of one thread block ----------------------------------------------
    def pump(self, key: tuple[int, int]) -> None:
        gpu, _ = key
        tb = self.tbs[key]
        while self.pos[key] < len(tb.steps):
            step = tb.steps[self.pos[key]]
            phase = self.phase[key]
            if phase == "busy":
                return
            if phase == "start":
                missing = [(gpu, t, s) for t, s in step.deps if (gpu, t, s) not in self.done]
                if missing:
                    self.dep_waiters.setdefault(missing[0], []).append(key)
                    return
                self.phase[key] = phase = "recv" if step.type.receives else "go"
            if phase == "recv":
                msg = self.recv_msg[(gpu, key[1], step.index)]
                if msg not in self.arrived:
                    self.msg_waiters[msg] = key
                    return
            if step.type.sends:
                self._start_flow(key, step)
                self.phase[key] = "busy"
                return
            if step.type in (StepType.COPY, StepType.REDUCE):
                passes = 2 if step.type is StepType.COPY else 3
                self._timer(self.now + passes * step.cnt * self.chunk / (self.p.hbm_GBps * 1e9), "local", key)
                self.phase[key] = "busy"
                return
            self._complete(key)  # receive-only steps and nop

    def _complete(self, key: tuple[int, int]) -> None:
        gpu, tb_id = key
        s = self.pos[key]
        self.done.add((gpu, tb_id, s))
        self.gpu_end[gpu] = max(self.gpu_end[gpu], self.now)
        self.pos[key] = s + 1
        self.phase[key] = "start"
        for waiter in self.dep_waiters.pop((gpu, tb_id, s), []):
            if waiter != key:
                self.pump(waiter)

    # -- messages --------------------------------------------------------------------------
    def _start_flow(self, key: tuple[int, int], step: Step) -> None:
        gpu, _ = key
        msg = self.send_msg[(gpu, key[1], step.index)]
        dst = msg[0][1]
        nbytes = step.cnt * self.chunk / self.p.bw_factor
        if self.node[gpu] == self.node[dst]:
            res = (("nvl_out", gpu), ("nvl_in", dst))
            latency = self.p.nvlink_step_s
            self.nvlink_bytes += step.cnt * self.chunk
        else:
            res = (("nic_out", self.nic[gpu]), ("nic_in", self.nic[dst]))
            latency = self.p.net_step_s
            self.network_bytes += step.cnt * self.chunk
        self.messages += 1
        self.seq += 1
        self.flows[self.seq] = [nbytes, res, key, msg, latency]

    def _capacity(self, resource: tuple) -> float:
        return (self.p.nvlink_GBps if resource[0].startswith("nvl") else self.p.nic_GBps) * 1e9

    def _rates(self) -> dict[int, float]:
        """Max-min fair rates by progressive filling over the shared resources."""
        left: dict[tuple, float] = {}
        users: dict[tuple, set[int]] = {}
        for fid, (_, res, *_rest) in self.flows.items():
            for r in res:
                left.setdefault(r, self._capacity(r))
                users.setdefault(r, set()).add(fid)
        rates: dict[int, float] = {}
        while users:
            r_min = min(users, key=lambda r: left[r] / len(users[r]))
            share = left[r_min] / len(users[r_min])
            for fid in list(users[r_min]):
                rates[fid] = share
                for r in self.flows[fid][1]:
                    left[r] -= share
                    users[r].discard(fid)
            users = {r: u for r, u in users.items() if u}
        return rates

    def _timer(self, when: float, what: str, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (when, self.seq, what, payload))

    # -- the event loop --------------------------------------------------------------------
    def run(self) -> MscclPrediction:
        for key in sorted(self.pos):
            self.pump(key)
        while self.flows or self.timers:
            rates = self._rates() if self.flows else {}
            t_end = {fid: self.now + f[0] / rates[fid] for fid, f in self.flows.items()}
            t_next = min(min(t_end.values(), default=float("inf")), self.timers[0][0] if self.timers else float("inf"))
            dt = t_next - self.now
            finished = []
            for fid, f in self.flows.items():
                f[0] -= rates[fid] * dt
                if t_end[fid] <= t_next * (1 + 1e-12):
                    finished.append(fid)
            self.now = t_next
            for fid in finished:
                _, _, key, msg, latency = self.flows.pop(fid)
                self._timer(self.now + latency, "arrive", msg)
                self._complete(key)
                self.pump(key)
            while self.timers and self.timers[0][0] <= self.now:
                _, _, what, payload = heapq.heappop(self.timers)
                if what == "arrive":
                    self.arrived.add(payload)  # type: ignore[arg-type]
                    waiter = self.msg_waiters.pop(payload, None)  # type: ignore[arg-type]
                    if waiter is not None:
                        self.pump(waiter)
                else:
                    self._complete(payload)  # type: ignore[arg-type]
                    self.pump(payload)  # type: ignore[arg-type]
        stuck = [(k, self.pos[k]) for k, tb in self.tbs.items() if self.pos[k] < len(tb.steps)]
        if stuck:
            (g, t), s = stuck[0]
            raise FileFormatError(self.algo.path, f"deadlock: gpu {g} tb {t} step {s} can never run "
                                                  f"({len(stuck)} thread block(s) stuck)",
                                  line=self.tbs[(g, t)].steps[s].line)
        kind = self.algo.kind or CollectiveKind.ALL_REDUCE  # parse_msccl guarantees a known kind
        time_s = max(self.gpu_end, default=0.0) + self.p.base_s
        algbw = self.nbytes / time_s / 1e9 if time_s > 0 else 0.0
        return MscclPrediction(
            algorithm=self.algo.name, kind=kind, nbytes=self.nbytes, ngpus=self.algo.ngpus, time_s=time_s,
            algbw_GBps=algbw, busbw_GBps=algbw * BUS_FACTOR[kind](self.algo.ngpus), messages=self.messages,
            nvlink_bytes=self.nvlink_bytes, network_bytes=self.network_bytes, gpu_end_s=tuple(self.gpu_end),
        )
