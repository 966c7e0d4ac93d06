"""A generic event-driven replay of tasks on the streams of several devices, with interference.

Semantics
---------
* A task runs on one (device, stream). Tasks of the same (device, stream) run one at a time in the
  order they are given (FIFO, as a CUDA stream runs its kernels).
* A task starts at the first moment its stream is free (the previous task of the stream ended)
  and every task in ``deps`` has ended. Nothing else delays it: there is no launch or host model
  here (express host time as a DELAY task if it matters).
* A transfer or collective that spans devices is one task on one device's stream; tasks on other
  devices that need its result list it in ``deps``.
* Progress is rate based. A task needs ``work_s`` seconds when alone. While tasks run at the
  same time on *different streams of the same device*, each progresses at ``1/factor`` where
  ``factor = interference.task_factor(its kind, its mix, the others' kinds)`` (>= 1). Rates are
  recomputed whenever a task on that device starts or ends, so progress is exactly piecewise
  linear. Tasks on different devices never interfere.
* With a model where every factor is 1 (``InterferenceModel.none()``) the result is the plain
  dependency-constrained schedule: ``end = start + work_s`` for every task.
* A cycle (through deps and stream order) is a deadlock and raises ValueError naming a task.

* Removing interference never delays any task: stream order and deps are fixed, every factor is
  >= 1, so by induction over that order each start and end without interference is no later than
  with it (tested as a property).

Speed: with no interference the schedule is a longest-path pass in topological order (no event
queue); with interference, a binary-heap event loop with per-task lazy progress (a running
task's remaining work is brought up to date only when its factor changes) and factors cached per
(profile, others) inside one call. No pydantic, no global state. ``benchmarks/engine_bench.py``
measures ~3-4e5 tasks/s without and ~2e5 tasks/s with interference on one CPU core.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from echo_plan.replay.compiled.event_loop import run_with
from echo_plan.replay.interference import InterferenceModel, Mix
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.outcome import IdleInterval, ReplayResult

if TYPE_CHECKING:
    from echo_plan.replay.compiled.switch import CompiledSwitch

__all__ = ["TaskKind", "Task", "IdleInterval", "ReplayResult", "replay", "replay_columns"]


@dataclass(frozen=True, slots=True)
class Task:
    """One kernel (or an aggregate of kernels) on one device's stream.

    ``mix``: for an aggregated compute task, its work by kernel kind as (kind, share) pairs; the
    shares are normalised, and the interference factor is their work-weighted blend. ``category``
    is free for the caller (e.g. "forward", "p2p"); the engine never reads it or ``name``.
    """

    id: int
    device: int
    stream: str
    work_s: float
    kind: TaskKind
    deps: tuple[int, ...] = ()
    name: str = ""
    category: str = ""
    mix: Mix | None = None


def replay(tasks: Sequence[Task], interference: InterferenceModel | None = None,
           compiled: "CompiledSwitch | None" = None) -> ReplayResult:
    """Replay ``tasks`` (semantics in the module docstring). ``interference=None`` means none;
    ``compiled``: the switch that may hand the interference loop to its compiled twin (None: Python)."""
    tasks = tuple(tasks)
    return _replay(_Graph.of_tasks(tasks), interference, tasks, compiled)


def replay_columns(device: list[int], stream: list[str], work: list[float], kind: list[TaskKind],
                   mix: list[Mix | None], deps: list[tuple[int, ...]], interference: InterferenceModel | None,
                   tasks: Callable[[], Sequence[Task]], compiled: "CompiledSwitch | None" = None) -> ReplayResult:
    """``replay`` of tasks given as parallel lists, task ``i`` having id ``i`` (deps are positions, each
    lower or higher, all in range: the caller builds them). ``tasks`` makes the Task objects, only
    when something asks for them (an error message, ``ReplayResult.tasks``)."""
    return _replay(_Graph(device, stream, work, kind, mix, deps, None, tasks), interference, tasks, compiled)


def _replay(g: "_Graph", interference: InterferenceModel | None, tasks, compiled) -> ReplayResult:  # noqa: ANN001
    model = interference if interference is not None else InterferenceModel.none()
    if model.is_none:
        start, end, dep_end, dep_last = _run_plain(g)
    else:
        start, end, dep_end, dep_last = _run_rates(g, model, compiled)
    ids = g.ids if g.ids is not None else range(g.n)
    return ReplayResult(tasks, ids, start, end, g.work, dep_end, dep_last, g.stream_keys, g.queues)


class _Graph:
    """Tasks as index arrays: work, stream id, device, kind, mix, dependency counts and dependents.
    ``ids`` is None when task ``i`` has id ``i``; ``tasks()`` gives the Task objects (for messages)."""

    __slots__ = ("tasks", "n", "ids", "work", "kind", "mix", "stream_of", "device_of", "queues", "stream_keys",
                 "ndeps", "deps", "_dependents")

    def __init__(self, device: list[int], stream: list[str], work: list[float], kind: list[TaskKind],
                 mix: list[Mix | None], deps: list[tuple[int, ...]], ids: list[int] | None,
                 tasks: Callable[[], Sequence[Task]]) -> None:
        self.tasks = tasks
        n = self.n = len(work)
        self.ids, self.work, self.kind, self.mix, self.device_of = ids, work, kind, mix, device
        if work and not (min(work) >= 0.0 and max(work) < math.inf and sum(work) == sum(work)):
            for i, w in enumerate(work):  # NaN, inf or negative somewhere: name the first
                if not (w >= 0.0 and math.isfinite(w)):
                    t = tasks()[i]
                    raise ValueError(f"task {t.id} ({t.name}): work_s must be finite and >= 0, got {w!r}")
        self.deps = deps
        self.ndeps = [len(d) for d in deps]
        self._dependents: list[list[int]] | None = None
        keys = list(zip(device, stream))
        sid_of = {key: s for s, key in enumerate(dict.fromkeys(keys))}  # numbered in order of first use
        stream_of = self.stream_of = list(map(sid_of.__getitem__, keys))
        queues: list[list[int]] = [[] for _ in sid_of]
        for i, s in enumerate(stream_of):
            queues[s].append(i)
        self.queues = queues
        self.stream_keys = list(sid_of)

    @property
    def dependents(self) -> list[list[int]]:
        """For each task, the tasks that list it in deps (in task order). Built on first use: the
        compiled loop takes deps in array form instead."""
        if self._dependents is None:
            dependents: list[list[int]] = [[] for _ in range(self.n)]
            for i, ds in enumerate(self.deps):
                for d in ds:
                    dependents[d].append(i)
            self._dependents = dependents
        return self._dependents

    @classmethod
    def of_tasks(cls, tasks: tuple[Task, ...]) -> "_Graph":
        """From Task objects: checks ids and deps and turns deps into positions."""
        n = len(tasks)
        ids = [t.id for t in tasks]
        if ids == list(range(n)):
            idx_of: dict[int, int] | None = None
        else:
            idx_of = {tid: i for i, tid in enumerate(ids)}
            if len(idx_of) != n:
                seen: set[int] = set()
                dup = next(x for x in ids if x in seen or seen.add(x))  # type: ignore[func-returns-value]
                raise ValueError(f"duplicate task id {dup}")
        work = [t.work_s for t in tasks]
        if work and not (min(work) >= 0.0 and max(work) < math.inf and sum(work) == sum(work)):
            for t, w in zip(tasks, work):
                if not (w >= 0.0 and math.isfinite(w)):
                    raise ValueError(f"task {t.id} ({t.name}): work_s must be finite and >= 0, got {w!r}")
        deps: list[tuple[int, ...]] = []
        for t in tasks:
            ds = t.deps
            if ds:
                out = []
                for d in ds:
                    j = d if idx_of is None and 0 <= d < n and isinstance(d, int) else (
                        idx_of.get(d) if idx_of is not None else None)
                    if j is None:
                        raise ValueError(f"task {t.id} ({t.name}) depends on unknown task {d}")
                    out.append(j)
                deps.append(tuple(out))
            else:
                deps.append(())
        return cls([t.device for t in tasks], [t.stream for t in tasks], work, [t.kind for t in tasks],
                   [t.mix for t in tasks], deps, None if idx_of is None else ids, lambda: tasks)

    def deadlock(self, ndeps: list[int], head: list[int]) -> ValueError:
        for s, q in enumerate(self.queues):
            if head[s] < len(q):
                t = self.tasks()[q[head[s]]]
                why = "waits on tasks that never end" if ndeps[q[head[s]]] else "is blocked"
                return ValueError(f"deadlock: task {t.id} ({t.name or t.kind.value}) on device {t.device} "
                                  f"stream {t.stream!r} {why} (a cycle through deps and stream order)")
        return ValueError("deadlock")  # pragma: no cover - only reached when every task ended


def _run_plain(g: _Graph) -> tuple[list[float], list[float], list[float], list[int]]:
    """No interference: every task ends ``work_s`` after it starts, so the schedule is a longest-path
    pass in topological order (deps plus stream order); no event queue is needed."""
    n, work, queues, stream_of, dependents = g.n, g.work, g.queues, g.stream_of, g.dependents
    ndeps = list(g.ndeps)
    head = [0] * len(queues)
    free = [0.0] * len(queues)
    start = [0.0] * n
    end = [0.0] * n
    dep_end = [0.0] * n
    dep_last = [-1] * n
    ready = [q[0] for q in queues if q and ndeps[q[0]] == 0]
    done = 0
    pop, push = ready.pop, ready.append
    while ready:
        i = pop()
        s = stream_of[i]
        t0 = free[s]
        de = dep_end[i]
        if de > t0:
            t0 = de
        start[i] = t0
        e = end[i] = free[s] = t0 + work[i]
        done += 1
        for j in dependents[i]:
            ndeps[j] -= 1
            if e >= dep_end[j]:
                dep_end[j] = e
                dep_last[j] = i
            if ndeps[j] == 0:
                sj = stream_of[j]
                if queues[sj][head[sj]] == j:
                    push(j)
        h = head[s] = head[s] + 1
        q = queues[s]
        if h < len(q) and ndeps[q[h]] == 0:
            push(q[h])
    if done != n:
        raise g.deadlock(ndeps, head)
    return start, end, dep_end, dep_last


def _run_rates(g: _Graph, model: InterferenceModel, compiled=None  # noqa: ANN001
               ) -> tuple[list[float], list[float], list[float], list[int]]:
    """With interference: a heap of predicted ends; when the set of running tasks on a device
    changes, each running task there whose factor changed is brought up to date and re-queued
    (older predictions are skipped by a version number). Devices are brought up to date in
    ascending order. The compiled twin of this loop (``compiled/event_loop.py``) runs where the switch
    ``compiled`` hands it out."""
    pid, profiles = _profiles(g)
    kernel = compiled.rates_for(g.n) if compiled is not None else None
    if kernel is not None:
        task_factor = model.task_factor

        def factor_of(p: int, others: tuple[int, ...]) -> float:
            return task_factor(*profiles[p], [profiles[o] for o in others])

        out = run_with(kernel, g.n, g.work, g.stream_of, g.device_of, pid, g.deps, len(g.queues), len(profiles),
                                   factor_of)
        if out is not None:
            start, end, dep_end, dep_last, ndeps_left, head_left = out
            if sum(1 for e in ndeps_left if e) or any(h < len(q) for h, q in zip(head_left, g.queues)):
                raise g.deadlock(ndeps_left, head_left)
            return start, end, dep_end, dep_last
    n, work, queues, stream_of, device_of, dependents = (g.n, g.work, g.queues, g.stream_of, g.device_of,
                                                         g.dependents)
    ndeps = list(g.ndeps)
    nstreams = len(queues)
    head = [0] * nstreams
    busy = [False] * nstreams
    start = [0.0] * n
    end = [0.0] * n
    dep_end = [0.0] * n
    dep_last = [-1] * n
    ver = [0] * n
    rem = [0.0] * n
    last = [0.0] * n
    factor = [0.0] * n
    running: dict[int, list[int]] = {}  # device -> running task indices
    fcache: dict[tuple, float] = {}
    task_factor = model.task_factor
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, task index, version)
    heappush, heappop = heapq.heappush, heapq.heappop
    seq = 0
    done = 0
    dirty: set[int] = set()

    def start_head(s: int, now: float) -> None:
        q = queues[s]
        h = head[s]
        if busy[s] or h >= len(q):
            return
        i = q[h]
        if ndeps[i]:
            return
        busy[s] = True
        start[i] = last[i] = now
        rem[i] = work[i]
        factor[i] = 0.0  # forces a rate computation and an event push
        d = device_of[i]
        run = running.get(d)
        if run is None:
            running[d] = [i]
        else:
            run.append(i)
        dirty.add(d)

    for s in range(nstreams):
        start_head(s, 0.0)
    now = 0.0
    while True:
        for d in sorted(dirty):  # bring the tasks of every device whose running set changed up to date
            run = running[d]
            nrun = len(run)
            for i in run:
                if nrun == 1:
                    f = 1.0
                else:
                    if nrun == 2:
                        key = (pid[i], (pid[run[1] if run[0] == i else run[0]],))
                    else:
                        key = (pid[i], tuple(sorted([pid[j] for j in run if j != i])))
                    f = fcache.get(key)
                    if f is None:
                        f = fcache[key] = task_factor(*profiles[key[0]], [profiles[o] for o in key[1]])
                fi = factor[i]
                if f != fi:
                    if fi > 0.0:
                        r = rem[i] - (now - last[i]) / fi
                        rem[i] = r if r > 0.0 else 0.0
                        last[i] = now
                    factor[i] = f
                    v = ver[i] = ver[i] + 1
                    heappush(heap, (now + rem[i] * f, seq, i, v))
                    seq += 1
        dirty.clear()
        while heap:
            now, _, i, v = heappop(heap)
            if v == ver[i]:
                break
        else:
            break
        end[i] = now
        ver[i] = -1
        done += 1
        s = stream_of[i]
        busy[s] = False
        head[s] += 1
        d = device_of[i]
        running[d].remove(i)
        dirty.add(d)
        for j in dependents[i]:
            nd = ndeps[j] = ndeps[j] - 1
            if now >= dep_end[j]:
                dep_end[j] = now
                dep_last[j] = i
            if nd == 0:
                sj = stream_of[j]
                if not busy[sj]:
                    start_head(sj, now)
        # the stream's next task (its deps may all have ended already)
        q = queues[s]
        h = head[s]
        if h < len(q) and not ndeps[q[h]]:
            start_head(s, now)
    if done != n:
        raise g.deadlock(ndeps, head)
    return start, end, dep_end, dep_last


def _profiles(g: _Graph) -> tuple[list[int], list[tuple]]:
    """Each task's interference profile (kind, normalised mix) as an index, and the profiles."""
    profile_ids: dict[tuple, int] = {}
    profiles: list[tuple] = []
    pid = [0] * g.n
    by_raw: dict[tuple, int] = {}  # (kind, mix as given) -> profile; level 2 repeats a few mixes
    for i, raw in enumerate(zip(g.kind, g.mix)):
        k = by_raw.get(raw)
        if k is None:
            p = (raw[0], _normalised(g, i))
            k = profile_ids.get(p)
            if k is None:
                k = profile_ids[p] = len(profiles)
                profiles.append(p)
            by_raw[raw] = k
        pid[i] = k
    return pid, profiles


def _normalised(g: _Graph, i: int) -> Mix | None:
    mix = g.mix[i]
    if mix is None:
        return None
    total = sum(w for _, w in mix)
    if not (total > 0.0 and all(w >= 0.0 for _, w in mix)):
        t = g.tasks()[i]
        raise ValueError(f"task {t.id} ({t.name}): mix shares must be >= 0 with a positive sum")
    if any(not k.is_compute for k, _ in mix) or not g.kind[i].is_compute:
        t = g.tasks()[i]
        raise ValueError(f"task {t.id} ({t.name}): a mix is for compute tasks made of compute kinds")
    return tuple(sorted(((k, w / total) for k, w in mix), key=lambda kw: kw[0].value))
