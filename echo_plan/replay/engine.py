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

Speed: a binary-heap event loop, per-task lazy progress (a task's remaining work is brought up to
date only when its rate changes), factors cached per (profile, others) inside one call. No
pydantic, no global state.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from echo_plan.replay.interference import InterferenceModel, Mix
from echo_plan.replay.kinds import TaskKind

__all__ = ["TaskKind", "Task", "IdleInterval", "ReplayResult", "replay"]


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


@dataclass(frozen=True, slots=True)
class IdleInterval:
    """A gap on a stream: from ``start_s`` to ``end_s`` nothing ran on it. ``waited_on`` is the id
    of the dependency whose end released the next task (None: a gap before the stream's first task
    released by no dependency, which does not happen, or the end of the replay)."""

    start_s: float
    end_s: float
    waited_on: int | None
    next_task: int | None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Start and end of every task (by task id), and what interference cost each."""

    tasks: tuple[Task, ...]
    start_s: dict[int, float]
    end_s: dict[int, float]
    slowdown_s: dict[int, float]  # end - start - work_s: what interference cost each task (>= 0)
    waited_on: dict[int, int | None]  # the dependency that ended last, if it (not the stream) set the start
    makespan_s: float

    @property
    def total_slowdown_s(self) -> float:
        return sum(self.slowdown_s.values())

    def device_end(self, device: int) -> float:
        """When the last task of ``device`` ended (0.0 for a device with no task)."""
        return max((self.end_s[t.id] for t in self.tasks if t.device == device), default=0.0)

    def stream_tasks(self, device: int, stream: str) -> tuple[Task, ...]:
        return tuple(t for t in self.tasks if t.device == device and t.stream == stream)

    def busy_s(self, device: int, stream: str) -> float:
        return sum(self.end_s[t.id] - self.start_s[t.id] for t in self.stream_tasks(device, stream))

    def idle_intervals(self, device: int, stream: str, since_s: float = 0.0,
                       until_s: float | None = None) -> tuple[IdleInterval, ...]:
        """The gaps of a stream between ``since_s`` and its last task (or ``until_s``), each with the
        task it waited on. Zero-length gaps are left out."""
        out: list[IdleInterval] = []
        cursor = since_s
        for t in self.stream_tasks(device, stream):
            s = self.start_s[t.id]
            if s > cursor:
                out.append(IdleInterval(cursor, s, self.waited_on[t.id], t.id))
            cursor = max(cursor, self.end_s[t.id])
        if until_s is not None and until_s > cursor:
            out.append(IdleInterval(cursor, until_s, None, None))
        return tuple(out)


def replay(tasks: Sequence[Task], interference: InterferenceModel | None = None) -> ReplayResult:
    """Replay ``tasks`` (semantics in the module docstring). ``interference=None`` means none."""
    model = interference if interference is not None else InterferenceModel.none()
    n = len(tasks)
    idx_of: dict[int, int] = {}
    for i, t in enumerate(tasks):
        if t.id in idx_of:
            raise ValueError(f"duplicate task id {t.id}")
        w = t.work_s
        if not (w >= 0.0 and math.isfinite(w)):
            raise ValueError(f"task {t.id} ({t.name}): work_s must be finite and >= 0, got {w!r}")
        idx_of[t.id] = i

    ndeps = [0] * n
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for d in t.deps:
            j = idx_of.get(d)
            if j is None:
                raise ValueError(f"task {t.id} ({t.name}) depends on unknown task {d}")
            ndeps[i] += 1
            dependents[j].append(i)

    # streams: an int per (device, stream), a FIFO queue each
    sid_of: dict[tuple[int, str], int] = {}
    queues: list[list[int]] = []
    stream_of = [0] * n
    device_of = [0] * n
    for i, t in enumerate(tasks):
        key = (t.device, t.stream)
        s = sid_of.get(key)
        if s is None:
            s = sid_of[key] = len(queues)
            queues.append([])
        queues[s].append(i)
        stream_of[i] = s
        device_of[i] = t.device
    nstreams = len(queues)
    head = [0] * nstreams
    busy = [False] * nstreams
    stream_free_t = [0.0] * nstreams
    dep_end = [0.0] * n  # latest end among finished deps
    dep_last = [-1] * n  # index of that dep

    start = [0.0] * n
    end = [0.0] * n
    done = 0
    heap: list[tuple[float, int, int, int]] = []  # (time, seq, task index, version)
    seq = 0
    fast = model.is_none

    # interference state (unused on the fast path)
    ver = [0] * n
    rem = [0.0] * n
    last = [0.0] * n
    factor = [0.0] * n
    running: dict[int, dict[int, None]] = {}  # device -> running task indices (insertion ordered)
    profile_ids: dict[tuple, int] = {}
    profiles: list[tuple] = []
    pid = [0] * n
    if not fast:
        for i, t in enumerate(tasks):
            mix = _normalised(t)
            p = (t.kind, mix)
            k = profile_ids.get(p)
            if k is None:
                k = profile_ids[p] = len(profiles)
                profiles.append(p)
            pid[i] = k
    fcache: dict[tuple, float] = {}
    dirty: set[int] = set()

    def try_start(s: int, now: float) -> None:
        nonlocal seq
        if busy[s]:
            return
        h = head[s]
        q = queues[s]
        if h >= len(q):
            return
        i = q[h]
        if ndeps[i]:
            return
        busy[s] = True
        start[i] = now
        if fast:
            heapq.heappush(heap, (now + tasks[i].work_s, seq, i, 0))
            seq += 1
        else:
            d = device_of[i]
            run = running.get(d)
            if run is None:
                run = running[d] = {}
            run[i] = None
            rem[i] = tasks[i].work_s
            last[i] = now
            factor[i] = 0.0  # forces a rate computation and an event push
            dirty.add(d)

    def update_device(d: int, now: float) -> None:
        nonlocal seq
        run = running[d]
        ids = list(run)
        for i in ids:
            others = tuple(sorted(pid[j] for j in ids if j != i))
            key = (pid[i], others)
            f = fcache.get(key)
            if f is None:
                f = fcache[key] = model.task_factor(*profiles[pid[i]], [profiles[o] for o in others])
            if f != factor[i]:
                if factor[i] > 0.0:
                    r = rem[i] - (now - last[i]) / factor[i]
                    rem[i] = r if r > 0.0 else 0.0
                last[i] = now
                factor[i] = f
                ver[i] += 1
                heapq.heappush(heap, (now + rem[i] * f, seq, i, ver[i]))
                seq += 1

    for s in range(nstreams):
        try_start(s, 0.0)
    if not fast:
        for d in list(dirty):
            update_device(d, 0.0)
        dirty.clear()

    now = 0.0
    while heap:
        now, _, i, v = heapq.heappop(heap)
        if v != ver[i]:
            continue
        end[i] = now
        done += 1
        s = stream_of[i]
        busy[s] = False
        head[s] += 1
        stream_free_t[s] = now
        if not fast:
            d = device_of[i]
            del running[d][i]
            dirty.add(d)
        for j in dependents[i]:
            ndeps[j] -= 1
            if now >= dep_end[j]:
                dep_end[j] = now
                dep_last[j] = i
            if ndeps[j] == 0:
                try_start(stream_of[j], now)
        try_start(s, now)
        if not fast and dirty:
            for d in dirty:
                update_device(d, now)
            dirty.clear()

    if done != n:
        stuck = next(i for i in range(n) if ndeps[i] or head[stream_of[i]] <= queues[stream_of[i]].index(i))
        t = tasks[stuck]
        raise ValueError(f"deadlock: task {t.id} ({t.name or t.kind.value}) on device {t.device} stream "
                         f"{t.stream!r} can never start (a cycle through deps and stream order)")

    ids = [t.id for t in tasks]
    waited: dict[int, int | None] = {}
    prev_end = [0.0] * nstreams
    for s in range(nstreams):
        for i in queues[s]:
            j = dep_last[i]
            waited[tasks[i].id] = tasks[j].id if j >= 0 and dep_end[i] > prev_end[s] else None
            prev_end[s] = end[i]
    return ReplayResult(
        tasks=tuple(tasks),
        start_s=dict(zip(ids, start)),
        end_s=dict(zip(ids, end)),
        slowdown_s={t.id: max(0.0, end[i] - start[i] - t.work_s) for i, t in enumerate(tasks)},
        waited_on=waited,
        makespan_s=max(end, default=0.0),
    )


def _normalised(t: Task) -> Mix | None:
    if t.mix is None:
        return None
    total = sum(w for _, w in t.mix)
    if not (total > 0.0 and all(w >= 0.0 for _, w in t.mix)):
        raise ValueError(f"task {t.id} ({t.name}): mix shares must be >= 0 with a positive sum")
    if any(not k.is_compute for k, _ in t.mix) or not t.kind.is_compute:
        raise ValueError(f"task {t.id} ({t.name}): a mix is for compute tasks made of compute kinds")
    return tuple(sorted(((k, w / total) for k, w in t.mix), key=lambda kw: kw[0].value))
