"""Level 1: one traced layer (or embedding / output stage) replayed on its GPU's streams.

Each phase (forward; backward with its recompute ops) is replayed on its own, starting at 0:

* every op becomes an engine task on its traced stream: compute ops on ``compute`` for
  ``compute.op_time(op, gpu, dtype)`` seconds, collectives on ``tp_comm`` (or whichever
  communication stream the tracer gave them) for ``comm.time(kind, nbytes, group, cluster)``;
* ops are issued in trace order and each stream runs its ops in that order (CUDA stream FIFO);
  an op waits only for the ops whose outputs it reads (``op.deps``). So a collective whose result
  the next compute op reads (Megatron-LM's row-parallel all-reduce in forward) leaves the compute
  stream idle until it ends: that idle time is *exposed* TP communication. A collective that the
  traced code issues before independent work (the input-gradient all-reduce beside the
  weight-gradient GEMM in a column-parallel backward) runs beside it, and both slow down by the
  interference model's factors.
* VIEW ops (views, reshapes, ``wait_tensor``) launch no kernel: they are left out and their
  dependencies passed through, so they never hold a stream. Dependencies on ops of another phase
  are already satisfied (forward ends before backward starts).

The accounting of a phase: ``compute_s`` is the isolated compute work; the time the compute stream
waits for communication *without* interference (the no-interference replay's duration minus
``compute_s``) splits into ``ep_comm_exposed_s``, what the expert exchange adds (the MoE dispatch and
combine on the expert-parallel group and the expert-TP gathers: the no-interference replay with
those collectives taking no time is that much shorter), and ``tp_comm_exposed_s``, the rest;
``interference_s`` is what interference adds (the real replay's duration minus the no-interference
one, never negative); ``host_exposed_s``, what the host adds to an MoE layer's forward after the
dispatcher's synchronisation (``host.py``). Hence ``duration_s == compute_s + tp_comm_exposed_s +
ep_comm_exposed_s + interference_s + host_exposed_s``.

Nothing is cached here; callers may cache a LayerTiming by the trace key plus the models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echo_plan.cost.base import CollectiveModel, ComputeModel
from echo_plan.replay.engine import ReplayResult, Task, replay
from echo_plan.replay.host import HostIssue, host_exposed_s
from echo_plan.replay.interference import InterferenceModel, Mix
from echo_plan.replay.kinds import TaskKind
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.trace.records import GroupKind, LayerTrace, OpKind, OpRecord, Phase, Stream

__all__ = ["Span", "PhaseTiming", "LayerTiming", "replay_layer", "phase_tasks", "EXPERT_GROUPS"]

EXPERT_GROUPS = (GroupKind.EP, GroupKind.ETP)  # the expert exchange: dispatch, combine, expert-TP gathers


@dataclass(frozen=True, slots=True)
class Span:
    """One op as it ran in the phase replay, for the timeline (offsets from the phase start)."""

    stream: str
    name: str
    start_s: float
    duration_s: float
    kind: TaskKind


@dataclass(frozen=True, slots=True)
class PhaseTiming:
    duration_s: float
    compute_s: float  # isolated compute work (sum of op times on the compute stream)
    tp_comm_exposed_s: float  # compute stream waiting on collectives other than the expert exchange
    interference_s: float  # what interference added to the duration (>= 0)
    tp_comm_s: float  # isolated time of all collectives, exposed or hidden
    work_by_kind: tuple[tuple[TaskKind, float], ...]  # isolated compute seconds by kernel kind
    spans: tuple[Span, ...]
    ops: int = 0  # kernels replayed (views left out)
    ep_comm_exposed_s: float = 0.0  # compute stream waiting on the expert exchange (MoE dispatch/combine)
    host_exposed_s: float = 0.0  # GPU waiting for the host after the MoE dispatcher's synchronisation (replay/host.py)

    @property
    def mix(self) -> Mix | None:
        """Compute work shares by kind (for an aggregated level-2 task); None without compute."""
        total = sum(w for _, w in self.work_by_kind)
        if total <= 0.0:
            return None
        return tuple((k, w / total) for k, w in self.work_by_kind if w > 0.0)

    @property
    def tp_comm_hidden_s(self) -> float:
        """Collective time that ran beside compute instead of on the critical path."""
        return max(0.0, self.tp_comm_s - self.tp_comm_exposed_s - self.ep_comm_exposed_s)


@dataclass(frozen=True, slots=True)
class LayerTiming:
    forward: PhaseTiming
    backward: PhaseTiming  # includes the recompute ops when the trace has them
    per_step_s: float = 0.0  # compute the layer runs once per step, not per micro-batch (FP8 weight casts)

    @property
    def total_s(self) -> float:
        return self.forward.duration_s + self.backward.duration_s


def replay_layer(trace: LayerTrace, compute: ComputeModel, comm: CollectiveModel, cluster: ClusterSpec,
                 dtype: DType, interference: InterferenceModel, host: HostIssue | None = None) -> LayerTiming:
    """Forward and backward timing of one traced stage on one GPU (rules in the module docstring); ``host``: the
    pace at which the host issues an MoE layer's forward after the dispatcher's synchronisation (replay/host.py)."""
    fwd = [op for op in trace.ops if op.phase is Phase.FORWARD]
    bwd = [op for op in trace.ops if op.phase in (Phase.BACKWARD, Phase.RECOMPUTE)]
    once = sum(compute.op_time(op, cluster.gpu, dtype) for op in trace.ops
               if op.phase is Phase.STEP and op.kind is not OpKind.VIEW)
    return LayerTiming(
        forward=_phase(fwd, compute, comm, cluster, dtype, interference, host),
        backward=_phase(bwd, compute, comm, cluster, dtype, interference),
        per_step_s=once,
    )


def phase_tasks(ops: list[OpRecord], compute: ComputeModel, comm: CollectiveModel, cluster: ClusterSpec,
                dtype: DType) -> list[Task]:
    """Engine tasks for the ops of one phase, in trace order; task id = op index."""
    members = {op.index for op in ops}
    by_index = {op.index: op for op in ops}
    passthrough: dict[int, tuple[int, ...]] = {}  # view op -> the kernels it stands for

    def resolve(deps: tuple[int, ...]) -> tuple[int, ...]:
        out: list[int] = []
        for d in deps:
            if d not in members:
                continue  # another phase: already done
            if d in passthrough:
                out.extend(passthrough[d])
            elif by_index[d].kind is not OpKind.VIEW:
                out.append(d)
        return tuple(dict.fromkeys(out))

    tasks: list[Task] = []
    gpu = cluster.gpu
    for op in ops:
        deps = resolve(op.deps)
        if op.kind is OpKind.VIEW:
            passthrough[op.index] = deps
            continue
        if op.collective is not None:
            info = op.collective
            work = comm.time(info.kind, info.nbytes, info.group, cluster).time_s
            kind = TaskKind.from_collective(info.kind)
            stream = op.stream.value if op.stream is not Stream.COMPUTE else Stream.TP_COMM.value
        elif op.kind is OpKind.COLLECTIVE:
            raise ValueError(f"op {op.index} ({op.name}) is a collective without CollectiveInfo")
        else:
            work = compute.op_time(op, gpu, dtype)
            kind = TaskKind.from_op_kind(op.kind)
            stream = op.stream.value
        tasks.append(Task(op.index, 0, stream, float(work), kind, deps=deps, name=op.name,
                          category=op.phase.value))
    return tasks


def _phase(ops: list[OpRecord], compute: ComputeModel, comm: CollectiveModel, cluster: ClusterSpec,
           dtype: DType, interference: InterferenceModel, host: HostIssue | None = None) -> PhaseTiming:
    tasks = phase_tasks(ops, compute, comm, cluster, dtype)
    host_s = host_exposed_s(ops, tasks, host) if host is not None else 0.0
    plain = replay(tasks, InterferenceModel.none())
    real = plain if interference.is_none else replay(tasks, interference)
    expert = {op.index for op in ops if op.collective is not None and op.collective.group.kind in EXPERT_GROUPS}
    ep_exposed = 0.0
    if expert:  # what the expert exchange adds: the same replay with it taking no time
        without = replay([replace(t, work_s=0.0) if t.id in expert else t for t in tasks], InterferenceModel.none())
        ep_exposed = max(0.0, plain.makespan_s - without.makespan_s)
    by_kind: dict[TaskKind, float] = {}
    compute_s = comm_s = 0.0
    for t in tasks:
        if t.kind.is_comm:
            comm_s += t.work_s
        elif t.kind.is_compute:
            compute_s += t.work_s
            by_kind[t.kind] = by_kind.get(t.kind, 0.0) + t.work_s
    exposed = max(0.0, plain.makespan_s - compute_s)
    ep_exposed = min(ep_exposed, exposed)
    return PhaseTiming(
        duration_s=real.makespan_s + host_s,
        compute_s=compute_s,
        tp_comm_exposed_s=exposed - ep_exposed,
        ep_comm_exposed_s=ep_exposed,
        interference_s=max(0.0, real.makespan_s - plain.makespan_s),
        tp_comm_s=comm_s,
        work_by_kind=tuple((k, by_kind[k]) for k in (TaskKind.GEMM, TaskKind.ATTENTION, TaskKind.MEMORY)
                           if k in by_kind),
        spans=_spans(real),
        ops=len(tasks),
        host_exposed_s=host_s,
    )


def _spans(r: ReplayResult) -> tuple[Span, ...]:
    return tuple(Span(t.stream, t.name, r.start_s[t.id], r.end_s[t.id] - r.start_s[t.id], t.kind)
                 for t in r.tasks)
