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
  sends as well (the send only: see ``pp_gather``).
* ``pp_gather``: without sequence parallelism a message travels as 1/tp parts and the receiving
  stage all-gathers it over TP before its compute uses it (Megatron-LM's scatter/gather).
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
* with parameters sharded (``costs.fsdp``), a chunk's buckets are its FSDP units and a pass that
  gathers or reduces runs as one compute piece per unit, its all-gathers one unit ahead and its
  reduce-scatters after each piece on the ``dp_comm`` stream (``fsdp.py`` says which passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from echo_plan.replay.engine import ReplayResult, Task, replay_columns
from echo_plan.replay.fsdp import NO_PIECES, FsdpPass, fsdp_pass, with_copies
from echo_plan.replay.step_model import DpBucket, PhaseCost, StageCosts, StepCosts, overlapped
from echo_plan.replay.interference import InterferenceModel, Mix
from echo_plan.replay.kinds import TaskKind
from echo_plan.layout.schedules import Pass

__all__ = ["COMPUTE", "PP_FWD", "PP_BWD", "DP", "PP_GATHER", "Category", "PhaseCost", "DpBucket", "StageCosts",
           "StepCosts", "TaskInfo", "StepTasks", "build_tasks", "overlapped"]  # the data types: step_model.py

COMPUTE, PP_FWD, PP_BWD, DP = "compute", "pp_fwd", "pp_bwd", "dp_comm"
PP_GATHER = "pp_gather"  # the receiving stage's TP all-gather of a message sent scattered over TP


class Category(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    INPUT_GRAD = "backward-input"  # zero-bubble B: the input gradient
    WEIGHT_GRAD = "backward-weight"  # zero-bubble W: the weight gradients
    P2P = "p2p"
    DP = "dp"
    OPTIMIZER = "optimizer"


P2P_VALUE = Category.P2P.value


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """What a task stands for, for the breakdown and the timeline."""

    category: Category
    rank: int
    phase: PhaseCost | None = None  # compute pieces: the whole phase they are a share of
    share: float = 1.0  # compute pieces: their share of the phase
    extra_s: float = 0.0  # FSDP2 pieces: the unit's copy kernels run with it (compute, beside the phase's share)


class StepTasks:
    """The tasks of one step as parallel lists; task ``i`` has id ``i`` (its position). ``tasks``
    (the Task objects, with their names) is built on first use: the search only replays."""

    __slots__ = ("device", "stream", "work", "kind", "mix", "deps", "category", "info", "optimizer_ids",
                 "_names", "_tasks")

    def __init__(self, device: list[int], stream: list[str], work: list[float], kind: list[TaskKind],
                 mix: list[Mix | None], deps: list[tuple[int, ...]], category: list[str], names: list,
                 info: list[TaskInfo], optimizer_ids: tuple[int, ...]) -> None:
        self.device, self.stream, self.work, self.kind, self.mix, self.deps = device, stream, work, kind, mix, deps
        self.category, self._names, self.info, self.optimizer_ids = category, names, info, optimizer_ids
        self._tasks: tuple[Task, ...] | None = None

    @property
    def tasks(self) -> tuple[Task, ...]:
        if self._tasks is None:
            self._tasks = tuple(Task(i, d, s, w, k, deps, _name(nm), cat, m) for i, (d, s, w, k, deps, nm, cat, m)
                                in enumerate(zip(self.device, self.stream, self.work, self.kind, self.deps,
                                                 self._names, self.category, self.mix)))
        return self._tasks

    def replay(self, interference: InterferenceModel | None, compiled=None) -> ReplayResult:  # noqa: ANN001
        """``replay(self.tasks, interference, compiled)``, without building the Task objects."""
        return replay_columns(self.device, self.stream, self.work, self.kind, self.mix, self.deps, interference,
                              lambda: self.tasks, compiled)


def _name(nm: str | tuple) -> str:
    """A task's name from the parts build_tasks stored: formatted only when asked for."""
    if nm.__class__ is str:
        return nm  # type: ignore[return-value]
    if len(nm) == 3:
        return f"send {nm[0]} mb{nm[1]} -> stage {nm[2]}"
    kv, mb, c, label, k, npieces = nm
    base = f"{kv} mb{mb} chunk{c} {label}"
    return f"{base} (part {k}/{npieces})" if npieces else base


def build_tasks(costs: StepCosts) -> StepTasks:
    """All tasks of one step, per stream in execution order (see the module docstring).

    Order: every rank's compute and p2p tasks (rank by rank, in action order), then per rank its
    optimizer followed by its DP stream. Ids are positions, computed ahead (a first pass counts
    each rank's tasks) so that a dependency on a later task needs no lookup table."""
    sched = costs.schedule
    pp = sched.pp
    if len(costs.stages) != pp:
        raise ValueError(f"need costs for {pp} pipeline ranks, got {len(costs.stages)}")
    v, m = sched.virtual_stages, sched.num_microbatches
    FWD, WGT = Pass.FORWARD, Pass.WEIGHT_GRAD
    # per (rank, chunk): the (rank, chunk) a forward receives from / sends to (None at an end)
    prev_of = [[sched.neighbour(r, c, -1) for c in range(v)] for r in range(pp)]
    next_of = [[sched.neighbour(r, c, +1) for c in range(v)] for r in range(pp)]
    tied_on = costs.tied_allreduce_s > 0 and pp > 1
    overlap_grad, overlap_gather, sync = costs.overlap_grad_reduce, costs.overlap_param_gather, costs.sync_p2p
    recv_s = costs.p2p_recv_s

    # first pass: where every send lands, and how many tasks each rank's DP stream gets
    send_at = [0] * (pp * v * 2 * m)  # ((rank * v + chunk) * 2 + forward) * m + microbatch -> position
    firsts, lasts, gathered_first, ndp = [], [], [], []
    fs = costs.fsdp
    kept_of = [[tuple(b.kept for b in bs) for bs in st.buckets] for st in costs.stages] if fs is not None else []
    fsdp_passes: list[list[FsdpPass]] = []  # per rank, per action (FSDP only)
    pos = 0
    for r in range(pp):
        st = costs.stages[r]
        acts = sched.actions[r]
        first_f: dict[int, int] = {}  # chunk -> position of its first forward in the rank's list
        last_b: dict[int, int] = {}  # chunk -> position of the pass that completes its weight gradients
        for k, a in enumerate(acts):
            if a.kind is FWD:
                first_f.setdefault(a.chunk, k)
            elif a.kind.grads_ready:
                last_b[a.chunk] = k
        go = fs is None and overlap_gather and any(b.gather_s > 0 for bs in st.buckets for b in bs)
        firsts.append(first_f)
        lasts.append(last_b)
        gathered_first.append(go)
        nb = [len(bs) for bs in st.buckets]
        passes: list[FsdpPass] = []
        fsdp_dp = 0
        for k, a in enumerate(acts):
            fwd = a.kind is FWD
            c, mb = a.chunk, a.microbatch
            if a.kind is not WGT and recv_s > 0 and (prev_of if fwd else next_of)[r][c] is not None:
                pos += 1  # the TP all-gather of the received message
            if fs is not None:
                fp = fsdp_pass(fs, kept_of[r][c], fwd, first_f.get(c) == k, last_b.get(c) == k)
                passes.append(fp)
                pos += nb[c] if fp.pieces else 1
                fsdp_dp += fp.tasks(nb[c])
            elif fwd:
                pos += nb[c] if go and first_f[c] == k else 1
            else:
                pos += nb[c] if overlap_grad and nb[c] and last_b.get(c) == k else 1
            if a.kind is not WGT and (next_of if fwd else prev_of)[r][c] is not None:
                send_at[((r * v + c) * 2 + fwd) * m + mb] = pos
                pos += 1
        fsdp_passes.append(passes)
        if fs is not None:
            ndp.append(fsdp_dp + (1 if tied_on and r == pp - 1 else 0))
            continue
        ndp.append((sum(nb[c] for c in first_f) if go else 0) + sum(nb[c] for c in last_b)
                   + (1 if tied_on and r == pp - 1 else 0)
                   + (0 if overlap_gather else sum(1 for bs in st.buckets for b in bs if b.gather_s > 0)))
    dp_base = []  # position of each rank's optimizer; its DP stream follows
    for r in range(pp):
        dp_base.append(pos)
        pos += 1 + ndp[r]
    total = pos

    device: list[int] = []
    stream: list[str] = []
    work_l: list[float] = []
    kind_l: list[TaskKind] = []
    mix_l: list[Mix | None] = []
    deps_l: list[tuple[int, ...]] = []
    cat_l: list[str] = []
    names: list = []
    info: list[TaskInfo] = []
    add_dev, add_stream, add_work, add_kind, add_mix, add_deps, add_cat, add_name, add_info = (
        device.append, stream.append, work_l.append, kind_l.append, mix_l.append, deps_l.append, cat_l.append,
        names.append, info.append)
    dp_rows: list[list[tuple]] = [[] for _ in range(pp)]  # per rank: its DP stream, in order
    reduce_ids: list[list[int]] = [[] for _ in range(pp)]
    last_compute: list[int] = [-1] * pp  # each rank's latest compute task (-1: none yet)

    def dp_task(r: int, work: float, kind: TaskKind, deps: tuple[int, ...], name: str) -> int:
        rows = dp_rows[r]
        i = dp_base[r] + 1 + len(rows)
        rows.append((work, kind, deps, name))
        return i

    def reduce_task(r: int, c: int, b_i: int, b: DpBucket, deps: tuple[int, ...]) -> int:
        what = "reduce-scatter" if b.reduce_kind is TaskKind.REDUCE_SCATTER else "all-reduce"
        i = dp_task(r, b.reduce_s, b.reduce_kind, deps, f"DP {what} chunk{c} bucket {b_i}")
        reduce_ids[r].append(i)
        return i

    def gather_task(r: int, c: int, b_i: int, b: DpBucket, deps: tuple[int, ...] = ()) -> int:
        return dp_task(r, b.gather_s, TaskKind.ALL_GATHER, deps, f"DP param all-gather chunk{c} bucket {b_i}")

    def fsdp_pieces(r: int, fp: FsdpPass, buckets, fwd: bool, deps: tuple[int, ...], ctx) -> int:
        """One compute piece per FSDP unit of the pass, with its all-gathers (one unit ahead) and
        reduce-scatters on the DP stream (replay/fsdp.py); returns the last piece's id."""
        work, kind, mix, cat, cat_value, kv, mb, c, label, phase, scale = ctx
        order = list(reversed(range(len(buckets)))) if fwd else list(range(len(buckets)))
        shares = [(buckets[i].fwd_share if fwd else buckets[i].bwd_share) for i in order]
        tot = sum(shares)
        if tot <= 0:
            shares, tot = [float(buckets[i].params) for i in order], float(sum(buckets[i].params for i in order) or 1)
        pre = (last_compute[r],) if last_compute[r] >= 0 else ()
        gather_ids: dict[int, int] = {}

        def gather(j: int, after: tuple[int, ...]) -> None:
            if j < len(order) and j in fp.gathered and j not in gather_ids:
                i = order[j]
                gather_ids[j] = dp_task(r, buckets[i].gather_s, TaskKind.ALL_GATHER, after,
                                        f"FSDP all-gather chunk{c} unit {i} ({'fwd' if fwd else 'bwd'} mb{mb})")
        ids: list[int] = []
        for j, i in enumerate(order):
            gather(j, pre if j < 2 else (ids[j - 2],))
            gather(j + 1, (ids[j - 1],) if j >= 1 else pre)
            share = shares[j] / tot
            piece = len(work_l)
            extra = (gather_ids[j],) if j in gather_ids else ()
            copies = fp.copies_s(buckets[i], j) * scale  # FSDP2's copy kernels, before and after the unit
            piece_mix = with_copies(mix, kind, share * scale, work * share, copies) if copies > 0 else mix
            add_dev(r), add_stream(COMPUTE), add_work(work * share + copies), add_kind(kind), add_mix(piece_mix)
            add_deps(deps + extra), add_cat(cat_value), add_name((kv, mb, c, label, j + 1, len(order)))
            add_info(TaskInfo(cat, r, phase, share * scale, copies))
            deps = (piece,)
            ids.append(piece)
            if fp.reduces:
                reduce_task(r, c, i, buckets[i], (piece,))
        return ids[-1]

    for r in range(pp):
        p2p_s = costs.p2p_by_stage[r] if costs.p2p_by_stage else costs.p2p_s
        st = costs.stages[r]
        scale = costs.work_scale[r] if costs.work_scale else 1.0
        acts = sched.actions[r]
        first_f, last_b, go = firsts[r], lasts[r], gathered_first[r]
        gather_at: dict[tuple[int, int], int] = {}
        if go:  # in order of first use: chunks in forward order, each from its first layers
            for c in sorted(first_f, key=first_f.__getitem__):
                for b in reversed(range(len(st.buckets[c]))):
                    gather_at[(c, b)] = gather_task(r, c, b, st.buckets[c][b])
        # per (pass, chunk): what every action of that kind needs, computed once
        per = {}
        for kind_ in Pass:
            if kind_.split and st.input_grad is None:
                continue
            fwd = kind_ is FWD
            for c in range(v):
                phase = {FWD: st.forward, Pass.BACKWARD: st.backward, Pass.INPUT_GRAD: st.input_grad,
                         WGT: st.weight_grad}[kind_][c]
                cat = _CATEGORY[kind_]
                src_rc = (prev_of if fwd else next_of)[r][c]
                dst_rc = (next_of if fwd else prev_of)[r][c]
                if kind_ is WGT:
                    src_rc = dst_rc = None
                src = (src_rc[0] * v + src_rc[1]) * 2 + fwd if src_rc is not None else -1
                dst = dst_rc[0] if dst_rc is not None else -1
                per[(kind_, c)] = (phase, phase.work_s * scale, _compute_kind(phase), cat, cat.value,
                                   TaskInfo(cat, r, phase, scale), src, dst, kind_.value,
                                   st.chunk_labels[c], phase.mix)
        p2p_info = TaskInfo(Category.P2P, r)
        prev_sends: tuple[int, ...] = ()
        pair_rest: PhaseCost | None = None  # DualPipe: the paired backward's cost, set by its forward
        for k_a, a in enumerate(acts):
            fwd = a.kind is FWD
            c, mb = a.chunk, a.microbatch
            phase, work, kind, cat, cat_value, whole_info, src, dst, kv, label, mix = per[(a.kind, c)]
            deps: tuple[int, ...] = prev_sends if sync else ()
            if a.paired and k_a + 1 < len(acts):  # DualPipe: this forward runs overlapped with the next backward
                nxt = acts[k_a + 1]
                other = per[(nxt.kind, nxt.chunk)][0]
                saved = st.pair_saving_s[c][nxt.chunk] if st.pair_saving_s else 0.0
                phase, pair_rest = overlapped(phase, other, saved)
                work, whole_info = phase.work_s * scale, TaskInfo(cat, r, phase, scale)
                b_src = per[(nxt.kind, nxt.chunk)][6]
                if b_src >= 0:  # the pair starts when both inputs are in
                    deps = (*deps, send_at[b_src * m + nxt.microbatch])
            elif pair_rest is not None:
                phase, pair_rest = pair_rest, None
                work, whole_info = phase.work_s * scale, TaskInfo(cat, r, phase, scale)
            if src >= 0:
                got = send_at[src * m + mb]
                if recv_s > 0:  # Megatron-LM's scatter/gather: all-gather on the receiver, after the recv
                    g = len(work_l)
                    add_dev(r), add_stream(PP_GATHER), add_work(recv_s), add_kind(TaskKind.ALL_GATHER)
                    add_mix(None), add_deps((got,)), add_cat(P2P_VALUE)
                    add_name(f"TP all-gather of received {'act' if fwd else 'grad'} mb{mb}"), add_info(p2p_info)
                    got = g
                deps = (*deps, got)
            buckets = st.buckets[c]
            fp = fsdp_passes[r][k_a] if fs is not None else NO_PIECES
            if fp.pieces:
                pieces = None
                last = fsdp_pieces(r, fp, buckets, fwd, deps, (work, kind, mix, cat, cat_value, kv, mb, c, label,
                                                                phase, scale))
            elif fwd and go and first_f[c] == k_a:
                pieces = [(b.params, (gather_at[(c, b_i)],)) for b_i, b in reversed(list(enumerate(buckets)))]
            elif not fwd and fs is None and overlap_grad and buckets and last_b.get(c) == k_a:
                pieces = [(b.params, ()) for b in buckets]
            else:
                pieces = None
            if fp.pieces:
                pass
            elif pieces is None:  # the common case: one task for the whole action
                last = len(work_l)
                add_dev(r), add_stream(COMPUTE), add_work(work), add_kind(kind), add_mix(mix), add_deps(deps)
                add_cat(cat_value), add_name((kv, mb, c, label, 0, 0)), add_info(whole_info)
            else:
                tot = sum(p for p, _ in pieces) or 1
                piece_ids = []
                for k, (params, extra) in enumerate(pieces):
                    share = params / tot
                    last = len(work_l)
                    add_dev(r), add_stream(COMPUTE), add_work(work * share), add_kind(kind), add_mix(mix)
                    add_deps(deps + extra), add_cat(cat_value), add_name((kv, mb, c, label, k + 1, len(pieces)))
                    add_info(TaskInfo(cat, r, phase, share * scale))
                    deps = (last,)
                    piece_ids.append(last)
                if not fwd and a.kind.grads_ready:
                    for b_i, (b, pid) in enumerate(zip(buckets, piece_ids)):
                        reduce_task(r, c, b_i, b, (pid,))
            last_compute[r] = last
            if dst >= 0:
                i = len(work_l)
                add_dev(r), add_stream(PP_FWD if fwd else PP_BWD), add_work(p2p_s), add_kind(TaskKind.P2P)
                add_mix(None), add_deps((last,)), add_cat(P2P_VALUE), add_name(("act" if fwd else "grad", mb, dst))
                add_info(p2p_info)
                prev_sends = (i,)
            else:
                prev_sends = ()
        if not overlap_grad and fs is None:
            for c in sorted(last_b, key=last_b.__getitem__):
                for b_i, b in enumerate(st.buckets[c]):
                    reduce_task(r, c, b_i, b, (last_compute[r],))

    tied = None
    if tied_on:
        tied = dp_task(pp - 1, costs.tied_allreduce_s, TaskKind.ALL_REDUCE,
                       tuple(reduce_ids[0] + reduce_ids[pp - 1]) + (last_compute[0], last_compute[pp - 1]),
                       "tied embedding grad all-reduce (first <-> last stage)")

    opt_ids = []
    for r in range(pp):
        st = costs.stages[r]
        scale = costs.work_scale[r] if costs.work_scale else 1.0
        i = dp_base[r]
        if not overlap_gather and fs is None:
            for c, bs in enumerate(st.buckets):
                for b_i, b in enumerate(bs):
                    if b.gather_s > 0:
                        gather_task(r, c, b_i, b, (i,))
        if len(work_l) != i or len(dp_rows[r]) != ndp[r]:
            raise ValueError("internal: task positions counted ahead do not match the tasks built")
        add_dev(r), add_stream(COMPUTE), add_work(st.optimizer_time(scale)), add_kind(TaskKind.MEMORY), add_mix(None)
        add_deps((last_compute[r], *reduce_ids[r], *((tied,) if tied is not None and r in (0, pp - 1) else ())))
        add_cat(Category.OPTIMIZER.value), add_name("optimizer"), add_info(TaskInfo(Category.OPTIMIZER, r, share=scale))
        opt_ids.append(i)
        dp_info = TaskInfo(Category.DP, r)
        for work, kind, deps, name in dp_rows[r]:
            add_dev(r), add_stream(DP), add_work(work), add_kind(kind), add_mix(None), add_deps(deps)
            add_cat(Category.DP.value), add_name(name), add_info(dp_info)
    if len(work_l) != total:
        raise ValueError("internal: task positions counted ahead do not match the tasks built")
    return StepTasks(device, stream, work_l, kind_l, mix_l, deps_l, cat_l, names, info, tuple(opt_ids))


_CATEGORY = {Pass.FORWARD: Category.FORWARD, Pass.BACKWARD: Category.BACKWARD, Pass.INPUT_GRAD: Category.INPUT_GRAD,
             Pass.WEIGHT_GRAD: Category.WEIGHT_GRAD}




def _compute_kind(phase: PhaseCost) -> TaskKind:
    if not phase.mix:
        return TaskKind.GEMM
    return max(phase.mix, key=lambda kw: kw[1])[0]
