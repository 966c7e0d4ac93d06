"""What a replay returns: per-task start and end, kept as lists by task position.

The public mappings (``start_s``, ``end_s``, ``slowdown_s``, ``waited_on``, ``streams``) are keyed by
task id as before, but are built on first use: the level-2 step replay (tens of thousands of
tasks per plan, ids equal to positions) reads the position lists (``start_at``, ``end_at``,
``waited_at``, ``queue``) directly and never pays for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True, slots=True)
class IdleInterval:
    """A gap on a stream: from ``start_s`` to ``end_s`` nothing ran on it. ``waited_on`` is the id
    of the dependency whose end released ``next_task`` (the task after the gap); both are None for
    the gap after a stream's last task up to ``until_s``."""

    start_s: float
    end_s: float
    waited_on: int | None
    next_task: int | None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class ReplayResult:
    """Start and end of every task (by task id), and what interference cost each.

    Position lists (index = the task's position in the replayed sequence): ``start_at``,
    ``end_at``, ``work_at``, ``waited_at`` (position of the dependency whose end set the start, or
    -1 when the stream did), ``prev_at`` (the previous task on the same stream, or -1).
    """

    __slots__ = ("_tasks", "ids", "start_at", "end_at", "work_at", "_dep_end", "_dep_last", "makespan_s",
                 "_keys", "_queues", "_sid_of", "device_end_s", "_lazy")

    def __init__(self, tasks: Sequence[Any] | Callable[[], Sequence[Any]], ids: Sequence[int], start: list[float],
                 end: list[float], work: list[float], dep_end: list[float], dep_last: list[int],
                 stream_keys: list[tuple[int, str]], queues: list[list[int]]) -> None:
        self._tasks = tasks
        self.ids = ids
        self.start_at, self.end_at, self.work_at = start, end, work
        self._dep_end, self._dep_last = dep_end, dep_last
        self.makespan_s = max(end, default=0.0)
        self._keys, self._queues = stream_keys, queues
        self._sid_of = {k: s for s, k in enumerate(stream_keys)}
        device_end: dict[int, float] = {}  # a stream's tasks end in order: its last ends last
        for (d, _), q in zip(stream_keys, queues):
            e = end[q[-1]]
            if e > device_end.get(d, -1.0):
                device_end[d] = e
        self.device_end_s = device_end  # device -> when its last task ended
        self._lazy: dict[str, Any] = {}

    # -- by position ------------------------------------------------------------------------------
    def queue(self, device: int, stream: str) -> list[int]:
        """Positions of the tasks of one stream, in run order."""
        s = self._sid_of.get((device, stream))
        return self._queues[s] if s is not None else []

    def device_queues(self, device: int) -> list[list[int]]:
        return [q for (d, _), q in zip(self._keys, self._queues) if d == device]

    @property
    def waited_at(self) -> list[int]:
        w = self._lazy.get("waited_at")
        if w is None:
            w = self._lazy["waited_at"] = [-1] * len(self.end_at)
            end, dep_end, dep_last = self.end_at, self._dep_end, self._dep_last
            for q in self._queues:
                prev_end = 0.0
                for i in q:
                    j = dep_last[i]
                    if j >= 0 and dep_end[i] > prev_end:
                        w[i] = j
                    prev_end = end[i]
        return w

    @property
    def prev_at(self) -> list[int]:
        p = self._lazy.get("prev_at")
        if p is None:
            p = self._lazy["prev_at"] = [-1] * len(self.end_at)
            for q in self._queues:
                for k in range(1, len(q)):
                    p[q[k]] = q[k - 1]
        return p

    # -- by id (public API) -------------------------------------------------------------------------
    @property
    def tasks(self) -> tuple:
        t = self._tasks
        if callable(t):
            t = self._tasks = tuple(t())
        return t if isinstance(t, tuple) else tuple(t)

    def _by_id(self, name: str, values: Callable[[], Any]) -> dict:
        d = self._lazy.get(name)
        if d is None:
            d = self._lazy[name] = dict(zip(self.ids, values()))
        return d

    @property
    def start_s(self) -> dict[int, float]:
        return self._by_id("start_s", lambda: self.start_at)

    @property
    def end_s(self) -> dict[int, float]:
        return self._by_id("end_s", lambda: self.end_at)

    @property
    def slowdown_s(self) -> dict[int, float]:
        """end - start - work_s: what interference cost each task (>= 0)."""
        return self._by_id("slowdown_s", lambda: [max(0.0, e - s - w) for s, e, w in
                                                  zip(self.start_at, self.end_at, self.work_at)])

    @property
    def waited_on(self) -> dict[int, int | None]:
        """The dependency that ended last, if it (not the stream) set the start."""
        ids = self.ids
        return self._by_id("waited_on", lambda: [ids[j] if j >= 0 else None for j in self.waited_at])

    @property
    def streams(self) -> dict[tuple[int, str], tuple[int, ...]]:
        """(device, stream) -> its task ids in run order."""
        s = self._lazy.get("streams")
        if s is None:
            ids = self.ids
            s = self._lazy["streams"] = {k: tuple(ids[i] for i in q) for k, q in zip(self._keys, self._queues)}
        return s

    @property
    def total_slowdown_s(self) -> float:
        return sum(self.slowdown_s.values())

    def device_end(self, device: int) -> float:
        """When the last task of ``device`` ended (0.0 for a device with no task)."""
        return self.device_end_s.get(device, 0.0)

    def stream_ids(self, device: int, stream: str) -> tuple[int, ...]:
        """Ids of the tasks of one stream, in the order they ran."""
        return self.streams.get((device, stream), ())

    def busy_s(self, device: int, stream: str) -> float:
        start, end = self.start_at, self.end_at
        return sum(end[i] - start[i] for i in self.queue(device, stream))

    def idle_intervals(self, device: int, stream: str, since_s: float = 0.0,
                       until_s: float | None = None) -> tuple[IdleInterval, ...]:
        """The gaps of a stream between ``since_s`` and its last task (or ``until_s``), each with the
        task it waited on. Zero-length gaps are left out."""
        out: list[IdleInterval] = []
        cursor = since_s
        start, end, ids = self.start_at, self.end_at, self.ids
        waited = None
        for i in self.queue(device, stream):
            s = start[i]
            if s > cursor:
                waited = waited or self.waited_at
                j = waited[i]
                out.append(IdleInterval(cursor, s, ids[j] if j >= 0 else None, ids[i]))
            e = end[i]
            cursor = cursor if cursor >= e else e
        if until_s is not None and until_s > cursor:
            out.append(IdleInterval(cursor, until_s, None, None))
        return tuple(out)
