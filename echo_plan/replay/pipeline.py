"""Level 2: one training step as engine tasks (pipeline schedule, p2p, DP buckets, optimizer).

Input is :class:`StepCosts`: the schedule's per-rank action lists and, per pipeline rank, the
isolated cost of each chunk's forward and backward (from level 1), its DP gradient buckets and
its optimizer step. One device per pipeline rank stands for all its TP and DP peers (they are
symmetric); ``work_scale`` breaks that symmetry for a what-if (a rank whose GPU is slower).

What becomes a task, and on which stream of the rank's device:

* ``compute``: the forward or backward of one (micro-batch, chunk), aggregated over its layers
  (``mix`` gives the interference blend); then the optimizer step.
* ``pp_fwd`` / ``pp_bwd``: sending an activation to the next virtual stage / a gradient to the
  previous one. The receiver's compute depends on it. Megatron-LM's p2p is synchronous (batched
  isend/irecv followed by a wait), so with ``sync_p2p`` the sender's next compute waits for its
  sends as well.
* ``dp_comm``: gradient buckets (all-reduce, or reduce-scatter with the distributed optimizer),
  and the distributed optimizer's parameter all-gather. With ``overlap_grad_reduce`` the last
  backward of each chunk is split into one piece per bucket and a bucket's reduction starts when
  its piece ends (Megatron-LM launches a bucket when all its gradients are ready); without it all
  reductions run after the rank's last backward. With ``overlap_param_gather`` the all-gather
  that Megatron-LM issues after the previous optimizer step overlaps this step's first forward of
  each chunk (split into pieces, piece k waiting for the bucket holding its layers); without it
  the all-gather runs after the optimizer step. In steady state both are the same time per step.
* the tied-embedding gradient all-reduce between the first and the last stage runs on the last
  stage's ``dp_comm`` stream after both stages' backward, before both optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from echo_plan.replay.engine import Task
from echo_plan.replay.interference import Mix
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.schedules import Action, Pass, PipelineSchedule

COMPUTE, PP_FWD, PP_BWD, DP = "compute", "pp_fwd", "pp_bwd", "dp_comm"


class Category(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    P2P = "p2p"
    DP = "dp"
    OPTIMIZER = "optimizer"


P2P_VALUE = Category.P2P.value


@dataclass(frozen=True, slots=True)
class PhaseCost:
    """Isolated cost of a chunk's forward or backward: ``work_s`` = compute + tp exposed + level-1 interference."""

    work_s: float
    compute_s: float
    tp_comm_exposed_s: float
    interference_s: float
    mix: Mix | None = None


@dataclass(frozen=True, slots=True)
class DpBucket:
    params: int  # parameters (of this rank) in the bucket
    reduce_s: float  # all-reduce, or reduce-scatter with the distributed optimizer
    reduce_kind: TaskKind
    gather_s: float = 0.0  # parameter all-gather (distributed optimizer), else 0


@dataclass(frozen=True, slots=True)
class StageCosts:
    """One pipeline rank: per chunk forward/backward, layer range and DP buckets; its optimizer."""

    forward: tuple[PhaseCost, ...]
    backward: tuple[PhaseCost, ...]
    chunk_labels: tuple[str, ...]  # e.g. "layers 12-23" (+ "+embedding" / "+output")
    buckets: tuple[tuple[DpBucket, ...], ...]  # per chunk, in the order gradients become ready
    optimizer_s: float


@dataclass(frozen=True, slots=True)
class StepCosts:
    schedule: PipelineSchedule
    stages: tuple[StageCosts, ...]
    p2p_s: float  # one activation or gradient message between adjacent virtual stages
    tied_allreduce_s: float = 0.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    sync_p2p: bool = True
    work_scale: tuple[float, ...] | None = None  # per pipeline rank compute multiplier (what-if)


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """What a task stands for, for the breakdown and the timeline."""

    category: Category
    rank: int
    phase: PhaseCost | None = None  # compute pieces: the whole phase they are a share of
    share: float = 1.0  # compute pieces: their share of the phase


@dataclass(frozen=True, slots=True)
class StepTasks:
    tasks: tuple[Task, ...]
    info: dict[int, TaskInfo]
    optimizer_ids: tuple[int, ...]  # per rank


class _Ids:
    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}

    def __call__(self, key: tuple) -> int:
        i = self.ids.get(key)
        if i is None:
            i = self.ids[key] = len(self.ids)
        return i


def build_tasks(costs: StepCosts) -> StepTasks:
    """All tasks of one step, per stream in execution order (see the module docstring)."""
    sched = costs.schedule
    pp = sched.pp
    if len(costs.stages) != pp:
        raise ValueError(f"need costs for {pp} pipeline ranks, got {len(costs.stages)}")
    tid = _Ids()
    tasks: list[Task] = []
    info: dict[int, TaskInfo] = {}
    last_vs = sched.num_virtual_stages - 1
    reduce_ids: list[list[int]] = [[] for _ in range(pp)]
    last_compute: list[int] = [0] * pp
    dp_streams: list[list[Task]] = [[] for _ in range(pp)]  # appended at the end, in order

    for r in range(pp):
        st = costs.stages[r]
        scale = costs.work_scale[r] if costs.work_scale else 1.0
        acts = sched.actions[r]
        first_f = {}
        last_b = {}
        for a in acts:
            if a.kind is Pass.FORWARD:
                first_f.setdefault(a.chunk, a.microbatch)
            else:
                last_b[a.chunk] = a.microbatch
        gathers_overlapped = costs.overlap_param_gather and any(b.gather_s > 0 for bs in st.buckets for b in bs)
        if gathers_overlapped:  # in order of first use: chunks in forward order, each from its first layers
            for c in sorted(first_f, key=lambda c: _position(acts, Action(Pass.FORWARD, first_f[c], c))):
                for b in reversed(range(len(st.buckets[c]))):
                    _gather_task(dp_streams[r], info, tid, r, c, b, st.buckets[c][b])
        # per (pass, chunk): what every action of that kind needs, computed once
        per = {}
        for fwd in (True, False):
            for c in range(sched.virtual_stages):
                phase = st.forward[c] if fwd else st.backward[c]
                cat = Category.FORWARD if fwd else Category.BACKWARD
                per[(fwd, c)] = (phase, phase.work_s * scale, _compute_kind(phase), cat, cat.value,
                                 TaskInfo(cat, r, phase, scale), sched.virtual_stage(r, c))
        stage_labels = st.chunk_labels
        prev_sends: tuple[int, ...] = ()
        sync = costs.sync_p2p
        overlap_grad = costs.overlap_grad_reduce
        for a in acts:
            fwd = a.kind is Pass.FORWARD
            c, mb = a.chunk, a.microbatch
            phase, work, kind, cat, cat_value, whole_info, vs = per[(fwd, c)]
            deps: list[int] = list(prev_sends) if sync else []
            if fwd and vs > 0:
                pr, pc = sched.rank_chunk(vs - 1)
                deps.append(tid(("P", pr, True, mb, pc)))
            if not fwd and vs < last_vs:
                nr, nc = sched.rank_chunk(vs + 1)
                deps.append(tid(("P", nr, False, mb, nc)))
            buckets = st.buckets[c]
            name = f"{a.kind.value} mb{mb} chunk{c} {stage_labels[c]}"
            if fwd and gathers_overlapped and first_f[c] == mb:
                pieces = [(b.params, (tid(("G", r, c, b_i)),)) for b_i, b in reversed(list(enumerate(buckets)))]
            elif not fwd and overlap_grad and buckets and last_b[c] == mb:
                pieces = [(b.params, ()) for b in buckets]
            else:
                pieces = None
            if pieces is None:  # the common case: one task for the whole action
                i = tid(("C", r, fwd, mb, c, 0))
                tasks.append(Task(i, r, COMPUTE, work, kind, tuple(deps), name, cat_value, phase.mix))
                info[i] = whole_info
                piece_ids = [i]
            else:
                total = sum(p for p, _ in pieces) or 1
                piece_ids = []
                for k, (params, extra) in enumerate(pieces):
                    share = params / total
                    i = tid(("C", r, fwd, mb, c, k))
                    tasks.append(Task(i, r, COMPUTE, work * share, kind, tuple(deps) + extra,
                                      f"{name} (part {k + 1}/{len(pieces)})", cat_value, phase.mix))
                    info[i] = TaskInfo(cat, r, phase, share * scale)
                    deps = [i]
                    piece_ids.append(i)
                if not fwd:
                    for b_i, (b, pid) in enumerate(zip(buckets, piece_ids)):
                        reduce_ids[r].append(_reduce_task(dp_streams[r], info, tid, r, c, b_i, b, (pid,)))
            last = piece_ids[-1]
            last_compute[r] = last
            if fwd and vs < last_vs:
                i = tid(("P", r, True, mb, c))
                tasks.append(Task(i, r, PP_FWD, costs.p2p_s, TaskKind.P2P, (last,),
                                  f"send act mb{mb} -> stage {(vs + 1) % pp}", P2P_VALUE))
                info[i] = TaskInfo(Category.P2P, r)
                prev_sends = (i,)
            elif not fwd and vs > 0:
                i = tid(("P", r, False, mb, c))
                tasks.append(Task(i, r, PP_BWD, costs.p2p_s, TaskKind.P2P, (last,),
                                  f"send grad mb{mb} -> stage {(vs - 1) % pp}", P2P_VALUE))
                info[i] = TaskInfo(Category.P2P, r)
                prev_sends = (i,)
            else:
                prev_sends = ()
        if not costs.overlap_grad_reduce:
            for c in sorted(last_b, key=lambda c: _position(acts, Action(Pass.BACKWARD, last_b[c], c))):
                for b_i, b in enumerate(st.buckets[c]):
                    reduce_ids[r].append(_reduce_task(dp_streams[r], info, tid, r, c, b_i, b, (last_compute[r],)))

    tied = None
    if costs.tied_allreduce_s > 0 and pp > 1:
        tied = tid(("T",))
        deps = tuple(reduce_ids[0] + reduce_ids[pp - 1]) + (last_compute[0], last_compute[pp - 1])
        dp_streams[pp - 1].append(Task(tied, pp - 1, DP, costs.tied_allreduce_s, TaskKind.ALL_REDUCE, deps,
                                       "tied embedding grad all-reduce (first <-> last stage)", Category.DP.value))
        info[tied] = TaskInfo(Category.DP, pp - 1)

    opt_ids = []
    for r in range(pp):
        st = costs.stages[r]
        scale = costs.work_scale[r] if costs.work_scale else 1.0
        i = tid(("O", r))
        deps = (last_compute[r], *reduce_ids[r], *((tied,) if tied is not None and r in (0, pp - 1) else ()))
        tasks.append(Task(i, r, COMPUTE, st.optimizer_s * scale, TaskKind.MEMORY, deps, "optimizer",
                          Category.OPTIMIZER.value))
        info[i] = TaskInfo(Category.OPTIMIZER, r, share=scale)
        opt_ids.append(i)
        if not costs.overlap_param_gather:
            for c, bs in enumerate(st.buckets):
                for b_i, b in enumerate(bs):
                    if b.gather_s > 0:
                        _gather_task(dp_streams[r], info, tid, r, c, b_i, b, (i,))
        tasks.extend(dp_streams[r])
    if len(tid.ids) != len(tasks):
        missing = set(tid.ids.values()) - {t.id for t in tasks}
        raise ValueError(f"internal: {len(missing)} task ids referenced but never built")
    return StepTasks(tuple(tasks), info, tuple(opt_ids))


def _position(acts: tuple[Action, ...], a: Action) -> int:
    return acts.index(a)


def _compute_kind(phase: PhaseCost) -> TaskKind:
    if not phase.mix:
        return TaskKind.GEMM
    return max(phase.mix, key=lambda kw: kw[1])[0]


def _reduce_task(stream: list[Task], info: dict, tid: _Ids, r: int, c: int, b_i: int, b: DpBucket,
                 deps: tuple[int, ...]) -> int:
    i = tid(("R", r, c, b_i))
    what = "reduce-scatter" if b.reduce_kind is TaskKind.REDUCE_SCATTER else "all-reduce"
    stream.append(Task(i, r, DP, b.reduce_s, b.reduce_kind, deps, f"DP {what} chunk{c} bucket {b_i}",
                       Category.DP.value))
    info[i] = TaskInfo(Category.DP, r)
    return i


def _gather_task(stream: list[Task], info: dict, tid: _Ids, r: int, c: int, b_i: int, b: DpBucket,
                 deps: tuple[int, ...] = ()) -> int:
    i = tid(("G", r, c, b_i))
    stream.append(Task(i, r, DP, b.gather_s, TaskKind.ALL_GATHER, deps, f"DP param all-gather chunk{c} bucket {b_i}",
                       Category.DP.value))
    info[i] = TaskInfo(Category.DP, r)
    return i
