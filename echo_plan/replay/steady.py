"""Exact steady-state extrapolation of a pipeline step over many micro-batches.

A 1F1B or interleaved step over ``m`` identical micro-batches is a warm-up, a steady state in
which every further micro-batch repeats the same pattern of forward, backward and point-to-point
work on every stage, and a cool-down; the data-parallel reduction, parameter gathering and the
optimizer attach to the first or last micro-batch, not to ``m``. Replayed event by event, the
step time and each part of its breakdown are therefore affine in ``m`` once the steady state is
reached (the replay is a max-plus system with constant task times; its periodic regime adds one
period per micro-batch).

So instead of replaying all ``m`` micro-batches (hundreds on a small cluster with a large global
batch, 40-70k level-2 tasks), :func:`steady_state_step` replays the same step at three
micro-batch counts ``a, a+d, a+2d`` (``d`` = pipeline depth, so the interleaved schedule stays
valid) and checks that every figure - step time and each breakdown part - has a zero second
difference and that the critical stage is the same. Only then does it extrapolate linearly to
``m``; otherwise it tries a longer warm-up, and finally replays all ``m`` micro-batches. The
check is what makes this exact rather than an approximation: a plan whose replay is not yet
periodic at those counts is never extrapolated. Timelines always come from a full replay.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

from echo_plan.replay.results import Breakdown

REL_TOL = 1e-9  # second differences must vanish to this fraction of the step time


@dataclass(frozen=True, slots=True)
class StepReplay:
    """One level-2 replay of the step at ``microbatches`` micro-batches."""

    microbatches: int
    step_s: float
    breakdown: Breakdown
    rank: int  # the critical (last-finishing) pipeline stage
    tasks: int
    steps: Any = None  # StepTasks, for the timeline of a full replay
    result: Any = None  # ReplayResult, likewise


@dataclass(frozen=True, slots=True)
class SteadyStep:
    step_s: float
    breakdown: Breakdown
    rank: int
    tasks_replayed: int
    sampled: tuple[int, ...]  # micro-batch counts replayed; (m,) for a full replay
    full: StepReplay | None  # the full replay when there was one

    @property
    def extrapolated(self) -> bool:
        return self.full is None


def _figures(r: StepReplay) -> list[float]:
    return [r.step_s] + [getattr(r.breakdown, f.name) for f in fields(Breakdown)]


def sample_counts(pp: int, virtual_stages: int, m: int, start: int | None = None,
                  period: int | None = None) -> tuple[int, int, int] | None:
    """Three micro-batch counts to replay, or None when replaying all ``m`` costs no more. ``period``:
    micro-batches after which the schedule's steady state repeats (default pp; ZB-V's order repeats
    every 2 pp, one micro-batch per stage of its V)."""
    d = period or pp
    a = start if start is not None else 2 * pp  # the check rejects a warm-up that is too short
    if pp < 2 or 3 * a + 3 * d >= m:  # the three replays must cost less than the whole step
        return None
    return (a, a + d, a + 2 * d)


def steady_state_step(pp: int, virtual_stages: int, m: int, replay_at: Callable[[int], StepReplay],
                      *, exact: bool = False, period: int | None = None) -> SteadyStep:
    """The step at ``m`` micro-batches, extrapolated from a verified steady state when that is
    cheaper, else replayed in full (always in full when ``exact``)."""
    tasks = 0
    sampled: list[int] = []
    start = None
    while not exact:
        counts = sample_counts(pp, virtual_stages, m, start, period)
        if counts is None:
            break
        reps = [replay_at(c) for c in counts]
        tasks += sum(r.tasks for r in reps)
        sampled.extend(counts)
        linear = _extrapolate(reps, m)
        if linear is not None:
            step_s, breakdown = linear
            return SteadyStep(step_s, breakdown, reps[-1].rank, tasks, tuple(sampled), None)
        start = 2 * counts[0]  # not periodic yet: a longer warm-up
    full = replay_at(m)
    return SteadyStep(full.step_s, full.breakdown, full.rank, tasks + full.tasks, tuple(sampled) + (m,), full)


def _extrapolate(reps: list[StepReplay], m: int) -> tuple[float, Breakdown] | None:
    r1, r2, r3 = reps
    if not (r1.rank == r2.rank == r3.rank):
        return None
    v1, v2, v3 = _figures(r1), _figures(r2), _figures(r3)
    tol = REL_TOL * max(abs(v3[0]), 1e-30)
    if any(abs(c - 2 * b + a) > tol for a, b, c in zip(v1, v2, v3)):
        return None
    k = (m - r3.microbatches) / (r3.microbatches - r2.microbatches)
    parts = [c + k * (c - b) for b, c in zip(v2[1:], v3[1:])]
    if any(p < -tol for p in parts):
        return None
    breakdown = Breakdown(*(max(0.0, p) for p in parts))
    return breakdown.total_s, breakdown
