"""Level 2 in compiled code: build a step's tasks straight into the event loop's arrays and replay them.

``build_tasks`` (``pipeline.py``) builds a step as Python lists, one entry per task, and the
compiled event loop (``event_loop.py``) then turns those lists into arrays: in a search that is most of
the time of a plan (tens of thousands of tasks per replay, three replays per plan), spent in Python
on work the loop itself does in a fraction of it. :func:`replay_step` builds the same tasks (same
order, same work, same dependencies, same stream and profile numbering) in compiled code
(``build_kernel.py``), runs the same loop on them and gives the same replay, so the step time and
breakdown are the same bit for bit (tested against ``build_tasks`` + ``replay``).

It runs where the switch hands it the kernels (``switch.py``: once the compiled loop is loaded, so
in a search, not a single ``simulate``), with interference on, for steps without FSDP's per-block
pieces (replay/fsdp.py builds those in Python); otherwise (and for a step whose replay is wrong: a deadlock, a
bad work value) it returns None and the caller takes the Python path, which raises the error with the
task's name. The timeline always comes from the
Python path (it needs the tasks' names).
"""

from __future__ import annotations

from typing import Any, Callable

from echo_plan.replay.compiled.event_loop import MAX_KEY, run_arrays
from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.outcome import ReplayResult
from echo_plan.replay.results import Breakdown
from echo_plan.replay.pipeline import (Category, DpBucket, PhaseCost, StageCosts, StepCosts, TaskInfo, _compute_kind,
                                      overlapped, build_tasks)
from echo_plan.layout.schedules import Action, Pass, PipelineSchedule, build_schedule
from echo_plan.layout.schedules_zb import _zb_v
from echo_plan.specs.plan import Schedule

_PASS_CODE = {Pass.FORWARD: 0, Pass.BACKWARD: 1, Pass.INPUT_GRAD: 2, Pass.WEIGHT_GRAD: 3}
_CATEGORIES = (Category.FORWARD, Category.BACKWARD, Category.INPUT_GRAD, Category.WEIGHT_GRAD, Category.P2P,
               Category.DP, Category.OPTIMIZER)
_STREAMS = ("compute", "pp_fwd", "pp_bwd", "dp_comm", "pp_gather")
_KINDS = tuple(TaskKind)
_KIND_CODE = {k: j for j, k in enumerate(_KINDS)}

def check_build(kernels) -> bool:  # noqa: ANN001
    """Whether the compiled build gives what ``build_tasks`` + ``replay`` give on a small step, and ZB-V's
    compiled list order what :func:`layout.schedules_zb._zb_v` gives (which also compiles them, or loads
    them from Numba's cache). The switch's loader asks."""
    ph = PhaseCost(1.0, 0.8, 0.1, 0.1, ((TaskKind.GEMM, 0.7), (TaskKind.MEMORY, 0.3)))
    bucket = DpBucket(10, 0.2, TaskKind.REDUCE_SCATTER, 0.1)
    stage = StageCosts((ph,), (ph,), ("layers",), ((bucket, bucket),), 0.1)
    costs = StepCosts(build_schedule(Schedule.ONE_F_ONE_B, 2, 4, 1), (stage, stage), 0.05, 0.02)
    model = load_interference(None)
    fast = replay_step(costs, model, schedule_arrays, lambda: build_tasks(costs).tasks, kernels=kernels)
    slow = build_tasks(costs).replay(model)
    out, nout, ok = kernels.build.zb_v(2, 4, 1.0, 1.5, 0.5)
    return fast is not None and fast.result().end_at == slow.end_at and bool(ok) and int(nout.sum()) == sum(
        map(len, _zb_v(2, 4, (1.0, 1.5, 0.5))))


class FastStep:
    """A replayed step: its task count, makespan, critical rank and breakdown (what the steady state
    reads), and the replay's arrays, from which ``result()`` and ``info`` give what ``replay`` and
    ``build_tasks`` give (for tests and checks; the search never asks)."""

    __slots__ = ("n", "makespan_s", "rank", "breakdown", "_arrays", "info", "_make_tasks")

    def __init__(self, n: int, makespan_s: float, rank: int, breakdown: Breakdown, arrays: tuple, info: "_Info",
                 make_tasks: Callable[[], Any]) -> None:
        self.n, self.makespan_s, self.rank, self.breakdown = n, makespan_s, rank, breakdown
        self._arrays, self.info, self._make_tasks = arrays, info, make_tasks

    def result(self) -> ReplayResult:
        start, end, work, keys, qptr, order, prev, waited = self._arrays
        order_l, qp = order.tolist(), qptr.tolist()
        queues = [order_l[qp[s]:qp[s + 1]] for s in range(len(qp) - 1)]
        stream_keys = [(k // 5, _STREAMS[k % 5]) for k in keys.tolist()]
        result = ReplayResult(self._make_tasks, range(self.n), start.tolist(), end.tolist(), work.tolist(), [], [],
                              stream_keys, queues)
        result._lazy["waited_at"] = waited.tolist()
        result._lazy["prev_at"] = prev.tolist()
        return result


class _Info:
    """``StepTasks.info`` of the compiled build: a TaskInfo made when a task is looked at."""

    __slots__ = ("cat", "dev", "slot", "share", "phases")

    def __init__(self, cat: Any, dev: Any, slot: Any, share: Any, phases: list) -> None:
        self.cat, self.dev, self.slot, self.share, self.phases = cat, dev, slot, share, phases  # numpy arrays

    def __getitem__(self, i: int) -> TaskInfo:
        c = int(self.cat[i])
        if c < 4:
            return TaskInfo(_CATEGORIES[c], int(self.dev[i]), self.phases[int(self.slot[i])], float(self.share[i]))
        if c == 6:
            return TaskInfo(Category.OPTIMIZER, int(self.dev[i]), share=float(self.share[i]))
        return TaskInfo(_CATEGORIES[c], int(self.dev[i]))

    def __len__(self) -> int:
        return len(self.cat)


def schedule_arrays(sched: PipelineSchedule) -> tuple:
    """A schedule's actions and neighbours as arrays, and DualPipe's overlapped pairs: per action its
    pair (an index into the returned (pass, chunk, next pass, next chunk) list, -1 for none) and role
    (0 the paired forward, 1 the action that runs the rest of the pair), as ``build_tasks`` reads them."""
    import numpy as np

    pp, v = sched.pp, sched.virtual_stages
    ptr, kind, chunk, mb, pair, combo, role = [0], [], [], [], [], [], []
    combos: dict[tuple[int, int, int, int], int] = {}
    for acts in sched.actions:
        rest = -1  # the pair whose rest the next action runs (build_tasks' pair_rest)
        for k, a in enumerate(acts):
            kind.append(_PASS_CODE[a.kind])
            chunk.append(a.chunk)
            mb.append(a.microbatch)
            if a.paired and k + 1 < len(acts):
                nxt = acts[k + 1]
                key = (_PASS_CODE[a.kind], a.chunk, _PASS_CODE[nxt.kind], nxt.chunk)
                j = combos.setdefault(key, len(combos))
                pair.append(1)
                combo.append(j)
                role.append(0)
                rest = j
            else:
                pair.append(0)
                combo.append(rest)
                role.append(1)
                rest = -1
        ptr.append(len(kind))
    nbr = np.full((4, pp, v), -1, dtype=np.int64)  # prev rank, prev chunk, next rank, next chunk
    for r in range(pp):
        for c in range(v):
            for j, step in ((0, -1), (2, 1)):
                rc = sched.neighbour(r, c, step)
                if rc is not None:
                    nbr[j, r, c], nbr[j + 1, r, c] = rc
    i64 = np.int64
    act_rank = np.repeat(np.arange(pp, dtype=i64), np.diff(np.asarray(ptr, dtype=i64)))
    return (np.asarray(ptr, dtype=i64), np.asarray(kind, dtype=i64), np.asarray(chunk, dtype=i64),
            np.asarray(mb, dtype=i64), np.asarray(pair, dtype=i64), np.asarray(combo, dtype=i64),
            np.asarray(role, dtype=i64), act_rank, nbr[0], nbr[1], nbr[2], nbr[3], tuple(combos))


def replay_step(costs: StepCosts, interference: InterferenceModel,
                arrays_of: Callable[[PipelineSchedule], tuple], make_tasks: Callable[[], Any],
                prepared: dict | None = None, kernels=None) -> FastStep | None:  # noqa: ANN001
    """The replay of ``build_tasks(costs)`` under ``interference``, or None where the Python path must
    run (module docstring). ``arrays_of``: ``schedule_arrays``, or a cache of it; ``prepared``: a dict
    kept by the caller across replays of the same stage costs at other micro-batch counts; ``kernels``:
    the switch's ``level2()`` (None: the Python path)."""
    if interference.is_none or kernels is None:
        return None
    if costs.fsdp is not None:
        return None  # FSDP's per-block pieces are built by the Python path only (replay/fsdp.py)
    import numpy as np

    sched = costs.schedule
    pp, v, m = sched.pp, sched.virtual_stages, sched.num_microbatches
    act_ptr, act_kind, act_chunk, act_mb, act_pair, act_combo, act_role, act_rank, prev_r, prev_c, next_r, next_c, \
        combos = arrays_of(sched)
    stage = prepared.get("stage") if prepared is not None else None
    if stage is None or stage[0] is not costs.stages or stage[1] != (pp, v):
        stage = (costs.stages, (pp, v), _stage_arrays(costs, pp, v))
        if prepared is not None:
            prepared["stage"] = stage
    if stage[2] is None:
        return None
    nslots = pp * 4 * v
    work_pc, phases, ph_arrays, b_arrays, per_rank = stage[2]
    if any(st.input_grad is None or st.weight_grad is None for st in costs.stages) and bool((act_kind >= 2).any()):
        return None  # split passes without their costs: the Python path raises
    act_over = np.full(len(act_kind), -1, dtype=np.int64)
    if combos:  # DualPipe: each pair's two overlapped costs (build_tasks' overlapped) as slots of their own
        phases, work_l = list(phases), work_pc.tolist()
        for r, st in enumerate(costs.stages):
            for j, (k1, c1, k2, c2) in enumerate(combos):
                first, second = phases[(r * 4 + k1) * v + c1], phases[(r * 4 + k2) * v + c2]
                if first is None or second is None:
                    return None
                saved = st.pair_saving_s[c1][c2] if st.pair_saving_s else 0.0
                for ph in overlapped(first, second, saved):
                    phases.append(ph)
                    work_l.append(ph.work_s)
        work_pc = np.asarray(work_l, dtype=np.float64)
        ph_arrays = _phase_arrays(phases)
        paired = act_combo >= 0
        act_over[paired] = nslots + (act_rank[paired] * len(combos) + act_combo[paired]) * 2 + act_role[paired]
    kb = kernels.build
    ok, n, work, dev, skind, code, cat, islot, ishare, d_own, d_dep = kb.build(
        pp, v, m, act_ptr, act_kind, act_chunk, act_mb, act_over, act_pair, prev_r, prev_c, next_r, next_c, work_pc,
        *b_arrays, *per_rank[:3], *per_rank[3:], _KIND_CODE[TaskKind.P2P], _KIND_CODE[TaskKind.ALL_GATHER],
        _KIND_CODE[TaskKind.MEMORY], _KIND_CODE[TaskKind.ALL_REDUCE], nslots)
    if not ok or not (n == 0 or (np.isfinite(work).all() and (work >= 0.0).all())):
        return None
    sid, keys, qptr, order, ndeps, dptr, didx, maxrun, codes = kb.graph(n, pp, dev, skind, d_own, d_dep, code,
                                                                        nslots + len(_KINDS))
    # interference profiles, numbered in order of first use (as engine._profiles numbers them)
    profile_ids: dict[tuple, int] = {}
    profiles: list[tuple] = []
    pid_of = np.zeros(nslots + len(_KINDS), dtype=np.int64)
    for cd in codes.tolist():
        if cd < nslots:
            ph = phases[cd]
            p = _profile(_compute_kind(ph), ph.mix)
            if p is None:
                return None
        else:
            p = (_KINDS[cd - nslots], None)
        k = profile_ids.get(p)
        if k is None:
            k = profile_ids[p] = len(profiles)
            profiles.append(p)
        pid_of[cd] = k
    if (len(profiles) + 1) ** (int(maxrun) + 1) >= MAX_KEY:
        return None
    task_factor = interference.task_factor

    def factor_of(p: int, others: tuple[int, ...]) -> float:
        return task_factor(*profiles[p], [profiles[o] for o in others])

    start, end, dep_end, dep_last, left, head = run_arrays(
        kernels.rates, n, work, sid, dev, pp, int(maxrun), pid_of[code], ndeps, dptr, didx, qptr,
        order, len(profiles), factor_of)
    if left.any() or bool((qptr[:-1] + head < qptr[1:]).any()):
        return None  # a deadlock: the Python path names the task
    rank, _, *parts, prev, waited = kb.breakdown(pp, n, dev, skind, sid, keys, qptr, order, start, end, work, dep_end,
                                                 dep_last, cat, islot, ishare, *ph_arrays)
    return FastStep(n, float(end.max()) if n else 0.0, int(rank), Breakdown(*(float(x) for x in parts)),
                    (start, end, work, keys, qptr, order, prev, waited), _Info(cat, dev, islot, ishare, phases),
                    make_tasks)


def _stage_arrays(costs: StepCosts, pp: int, v: int) -> tuple | None:
    """What the builder reads of the stage costs (the same at every micro-batch count), or None where
    the Python path must run."""
    import numpy as np

    i64, f64 = np.int64, np.float64
    nslots = pp * 4 * v
    work_pc = [0.0] * nslots
    phases: list = [None] * nslots
    b_ptr, b_params, b_reduce, b_code, b_gather = [0], [], [], [], []
    for r, st in enumerate(costs.stages):
        for kd, per_chunk in ((0, st.forward), (1, st.backward), (2, st.input_grad), (3, st.weight_grad)):
            if per_chunk is None:
                continue
            for c in range(v):
                ph = per_chunk[c]
                phases[(r * 4 + kd) * v + c] = ph
                work_pc[(r * 4 + kd) * v + c] = ph.work_s
        go = costs.overlap_param_gather and any(b.gather_s > 0 for bs in st.buckets for b in bs)
        for c in range(v):
            bs = st.buckets[c]
            if go and not bs:
                return None  # a chunk without buckets beside ones with a gather: the Python path's case
            for b in bs:
                b_params.append(b.params)
                b_reduce.append(b.reduce_s)
                b_code.append(_KIND_CODE[b.reduce_kind])
                b_gather.append(b.gather_s)
            b_ptr.append(len(b_params))
    scale = [costs.work_scale[r] if costs.work_scale else 1.0 for r in range(pp)]
    p2p = [costs.p2p_by_stage[r] if costs.p2p_by_stage else costs.p2p_s for r in range(pp)]
    opt = [st.optimizer_time(scale[r]) for r, st in enumerate(costs.stages)]
    b_arrays = (np.asarray(b_ptr, dtype=i64), np.asarray(b_params, dtype=i64), np.asarray(b_reduce, dtype=f64),
                np.asarray(b_code, dtype=i64), np.asarray(b_gather, dtype=f64))
    per_rank = (np.asarray(p2p, dtype=f64), float(costs.p2p_recv_s), float(costs.tied_allreduce_s),
                np.asarray(opt, dtype=f64), np.asarray(scale, dtype=f64), bool(costs.overlap_grad_reduce),
                bool(costs.overlap_param_gather), bool(costs.sync_p2p))
    return np.asarray(work_pc, dtype=f64), phases, _phase_arrays(phases), b_arrays, per_rank


def _phase_arrays(phases: list) -> tuple:
    """Per cost slot: compute, exposed TP communication, interference, exposed expert exchange and host seconds
    (0 for an empty slot)."""
    import numpy as np

    return tuple(np.asarray([getattr(ph, name) if ph is not None else 0.0 for ph in phases], dtype=np.float64)
                 for name in ("compute_s", "tp_comm_exposed_s", "interference_s", "ep_comm_exposed_s", "host_exposed_s"))


def _profile(kind: TaskKind, mix) -> tuple | None:
    """engine._normalised's profile of a compute task, or None where it would raise (Python path)."""
    if mix is None:
        return (kind, None)
    total = sum(w for _, w in mix)
    if not (total > 0.0 and all(w >= 0.0 for _, w in mix)):
        return None
    if any(not k.is_compute for k, _ in mix) or not kind.is_compute:
        return None
    return (kind, tuple(sorted(((k, w / total) for k, w in mix), key=lambda kw: kw[0].value)))


def zb_v_actions(pp: int, m: int, times: tuple[float, float, float], kernels=None  # noqa: ANN001
                 ) -> tuple[tuple[Action, ...], ...] | None:
    """ZB-V's list schedule (layout/schedules_zb.py ``_zb_v``) in compiled code (``build_kernel.py``, the
    same picks), given the switch's ``level2()`` kernels (a search, which lists a ZB-V order per
    candidate); None without them, or where it fails (the Python list schedule then runs and raises)."""
    if kernels is None:
        return None
    out, nout, ok = kernels.build.zb_v(pp, m, float(times[0]), float(times[1]), float(times[2]))
    if not ok:
        return None
    kinds = (Pass.FORWARD, Pass.BACKWARD, Pass.INPUT_GRAD, Pass.WEIGHT_GRAD)
    made: dict[tuple[int, int, int], Action] = {}  # actions are immutable: one object per (pass, mb, chunk)

    def action(k: int, i: int, c: int) -> Action:
        a = made.get((k, i, c))
        if a is None:
            a = made[(k, i, c)] = Action(kinds[k], i, c)
        return a
    return tuple(tuple(action(k, i, c) for k, i, c in out[r, :nout[r]].tolist()) for r in range(pp))
