"""Give the recommended plan a timeline when its stored result has none: one simulation, said so.

Saved results and studies keep each plan's breakdown and memory but usually not its timeline
events; the report's pipeline timeline needs them for the recommended plan only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from echo_plan.errors import EchoPlanError
from echo_plan.replay.results import StepResult
from echo_plan.search.results import CompareOutcome, SearchOutcome
from echo_plan.simulate import simulate
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.trace.cache import TraceCache

# (model dict, cluster dict, plan dict, stack dict: empty for a result that recorded none) -> a StepResult with
# its timeline
TimelineSimulator = Callable[[dict, dict, dict, dict], StepResult]


def timeline_simulator(cache_dir: str | None = None) -> TimelineSimulator:
    """The real simulator on the specs recorded in the outcome (its software stack too: a plan is timed
    with the stack it was searched with), with the timeline on, reading traces from the on-disk trace
    cache (``cache_dir``, or the default cache folder)."""

    def run(model: dict, cluster: dict, plan: dict, stack: dict) -> StepResult:
        return simulate(ModelSpec.build(dict(model), "model in the result"),
                        ClusterSpec.build(dict(cluster), "cluster in the result"),
                        PlanSpec.build(dict(plan), "recommended plan"),
                        stack=SoftwareSpec.build(dict(stack), "stack in the result") if stack else None,
                        cache=TraceCache(cache_dir), timeline=True)

    return run


def search_with_timeline(outcome: SearchOutcome, simulator: TimelineSimulator | None = None,
                         fresh: bool = False) -> tuple[SearchOutcome, str | None]:
    """The outcome with a timeline on its best plan, and a note saying where it came from.

    Returns the outcome unchanged (note None) when the best plan already has a timeline or there
    is no best plan; on a simulation error the outcome is unchanged and the note says why. With
    ``fresh`` (the outcome of a search that just ran, not a stored one) a timeline made as
    expected needs no note.
    """
    best = outcome.best
    if best is None or best.timeline:
        return outcome, None
    sim = simulator or timeline_simulator()
    try:
        again = sim(outcome.model, outcome.cluster, best.plan, outcome.stack)
    except EchoPlanError as exc:
        return outcome, f"No timeline: the stored result has none and simulating the plan again failed ({exc})."
    except ImportError as exc:
        return outcome, f"No timeline: the stored result has none and the simulator is unavailable ({exc})."
    if not again.timeline:
        return outcome, "No timeline: the stored result has none and the simulator returned no events."
    note = ("The stored result carries no timeline, so the recommended plan was simulated once more for this "
            "chart")
    mismatch = best.step_time_s > 0 and abs(again.step_time_s / best.step_time_s - 1) > 0.01
    if mismatch:
        note += (f"; that simulation gave a step of {again.step_time_s:.4g} s against the stored "
                 f"{best.step_time_s:.4g} s (the simulator or its data changed since the search)")
    ranked = (replace(best, timeline=again.timeline), *outcome.ranked[1:])
    return replace(outcome, ranked=ranked), None if fresh and not mismatch else note + "."


def compare_with_timeline(outcome: CompareOutcome, detail_gpus: int, simulator: TimelineSimulator | None = None,
                          fresh: bool = False) -> tuple[CompareOutcome, str | None]:
    """The compare with a timeline on the best plan of the size shown in detail."""
    rows = list(outcome.rows)
    for i, row in enumerate(rows):
        if row.num_gpus == detail_gpus:
            filled, note = search_with_timeline(row.outcome, simulator, fresh)
            rows[i] = replace(row, outcome=filled)
            return replace(outcome, rows=tuple(rows)), note
    return outcome, None
