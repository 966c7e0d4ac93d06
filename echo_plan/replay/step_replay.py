"""Level 2 of one plan at a given micro-batch count: the schedules it replays, built once and kept, and
the replay itself, compiled where the compiled level 2 is loaded (a search) and in Python otherwise.

``ScheduleCache`` is an explicit cache object (the simulation memo owns one): the action lists of each
(schedule, pp, micro-batches, virtual stages, ZB-V times, paired) and the arrays the compiled replay
reads of each. ``StepReplayer(m)`` is what the steady-state search (steady.py) asks for: the step's
length, breakdown and critical rank at ``m`` micro-batches, the stage costs being the same for every ``m``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from echo_plan.layout.schedules import PipelineSchedule, build_schedule, pair_forward_backward
from echo_plan.replay.breakdown import critical_rank, step_breakdown
from echo_plan.replay.pipeline import StepCosts, build_tasks
from echo_plan.replay.compiled.level2 import replay_step, schedule_arrays, zb_v_actions
from echo_plan.replay.compiled.switch import CompiledSwitch
from echo_plan.replay.steady import StepReplay
from echo_plan.specs.plan import Schedule, schedule_rule


class ScheduleCache:
    """Pure, immutable action lists shared by every plan and steady-state sample with them, and their
    arrays for the compiled replay. Not thread-safe; one per simulation memo."""

    def __init__(self, compiled: CompiledSwitch) -> None:
        self.compiled = compiled  # ZB-V's order is listed in compiled code where the compiled level 2 runs
        self._schedules: dict[tuple, PipelineSchedule] = {}
        self._arrays: dict[int, tuple] = {}  # id(schedule) -> (schedule, its arrays)

    def get(self, schedule: Schedule, pp: int, microbatches: int, virtual_stages: int, times=None,
            paired: bool = False) -> PipelineSchedule:
        """``paired``: with the steady state's forward/backward pairs marked (``pair_forward_backward``)."""
        key = (schedule, pp, microbatches, virtual_stages, times, paired)
        sched = self._schedules.get(key)
        if sched is None:
            order = None
            if schedule is Schedule.ZB_V and schedule_rule(schedule, pp, virtual_stages, microbatches) is None:
                order = zb_v_actions(pp, microbatches, times or (1.0, 1.0, 1.0), self.compiled.level2())
            sched = build_schedule(schedule, pp, microbatches, virtual_stages, times, zb_v_order=order)
            if paired:
                sched = pair_forward_backward(sched)
            self._schedules[key] = sched
        return sched

    def arrays(self, sched: PipelineSchedule):
        """``compiled.level2.schedule_arrays`` of a schedule, kept with it."""
        hit = self._arrays.get(id(sched))
        if hit is None or hit[0] is not sched:
            hit = self._arrays[id(sched)] = (sched, schedule_arrays(sched))
        return hit[1]


@dataclass(frozen=True)
class StepReplayer:
    """``replayer(m)``: the step of ``base``'s stage costs at ``m`` micro-batches. ``timeline``: always in
    Python, keeping the tasks and their replay for the timeline; otherwise compiled where it can be."""

    base: StepCosts
    interference: Any
    schedules: ScheduleCache
    pp: int
    virtual_stages: int
    paired: bool = False
    timeline: bool = False
    prepared: dict = field(default_factory=dict)  # the compiled path's view of the stage costs, for every m

    def __call__(self, m: int) -> StepReplay:
        compiled = self.schedules.compiled
        sched = self.schedules.get(self.base.schedule.schedule, self.pp, m, self.virtual_stages,
                                   self.base.schedule.times, self.paired)
        costs = replace(self.base, schedule=sched)
        if not self.timeline:  # same result as the Python replay below
            fast = replay_step(costs, self.interference, self.schedules.arrays, lambda: build_tasks(costs).tasks,
                               self.prepared, compiled.level2())
            if fast is not None:
                return StepReplay(m, fast.makespan_s, fast.breakdown, fast.rank, fast.n)
        steps = build_tasks(costs)
        result = steps.replay(self.interference, compiled)
        rank = critical_rank(result, self.pp)
        return StepReplay(m, result.makespan_s, step_breakdown(steps, result, rank), rank, len(steps.work),
                          steps, result)
