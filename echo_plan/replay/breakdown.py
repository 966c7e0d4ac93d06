"""Where the step's time goes, on the pipeline rank that finishes last.

The rank's compute stream is either busy or idle. Busy time is its chunks and its optimizer:
each chunk splits into isolated compute, exposed TP communication and level-1 interference (from
the layer replay), and whatever longer it took in the step replay is level-2 interference (a DP
bucket or a p2p transfer beside it). Idle time is attributed by walking back the chain of tasks
that released the next compute task: the part of the gap during which a p2p transfer it waited on
was running is ``pp_comm_exposed``, a DP collective ``dp_comm_exposed``; the part spent waiting
for compute on another rank (the pipeline fill and drain) is ``bubble``. The parts add up to the
step time by construction.
"""

from __future__ import annotations

from echo_plan.replay.engine import ReplayResult
from echo_plan.replay.pipeline import COMPUTE, Category, StepTasks
from echo_plan.replay.results import Breakdown


def device_ends(result: ReplayResult) -> dict[int, float]:
    """When each device's last task ends, in one pass over the tasks."""
    ends: dict[int, float] = {}
    end_s = result.end_s
    for t in result.tasks:
        e = end_s[t.id]
        if e > ends.get(t.device, -1.0):
            ends[t.device] = e
    return ends


def critical_rank(result: ReplayResult, pp: int) -> int:
    """The pipeline rank whose last task ends last (the lowest such rank on a tie)."""
    ends = device_ends(result)
    return max(range(pp), key=lambda r: (ends.get(r, 0.0), -r))


def step_breakdown(step: StepTasks, result: ReplayResult, rank: int) -> Breakdown:
    info = step.info
    stream_prev: dict[int, int] = {}
    last_on: dict[tuple[int, str], int] = {}
    for t in result.tasks:
        key = (t.device, t.stream)
        if key in last_on:
            stream_prev[t.id] = last_on[key]
        last_on[key] = t.id

    acc = {"compute": 0.0, "tp": 0.0, "pp": 0.0, "dp": 0.0, "bubble": 0.0, "interference": 0.0, "optimizer": 0.0}
    step_end = device_ends(result).get(rank, 0.0)
    compute_tasks = [t for t in result.tasks if t.device == rank and t.stream == COMPUTE]
    for t in compute_tasks:
        actual = result.end_s[t.id] - result.start_s[t.id]
        ti = info[t.id]
        if ti.category is Category.OPTIMIZER:
            acc["optimizer"] += t.work_s
        else:
            ph = ti.phase
            acc["compute"] += ph.compute_s * ti.share
            acc["tp"] += ph.tp_comm_exposed_s * ti.share
            acc["interference"] += ph.interference_s * ti.share
        acc["interference"] += actual - t.work_s

    def walk(gap_start: float, gap_end: float, task_id: int | None) -> None:
        cursor = gap_end
        x = task_id
        while x is not None and cursor > gap_start:
            cat = info[x].category
            if cat not in (Category.P2P, Category.DP):
                break  # waiting on compute (another rank's, or a chain back to it): bubble
            seg = max(result.start_s[x], gap_start)
            acc["pp" if cat is Category.P2P else "dp"] += cursor - seg
            cursor = seg
            released_by = result.waited_on.get(x)
            x = released_by if released_by is not None else stream_prev.get(x)
        if cursor > gap_start:
            acc["bubble"] += cursor - gap_start

    for gap in result.idle_intervals(rank, COMPUTE, 0.0, step_end):
        if gap.next_task is None:  # after the optimizer: waiting for the rank's trailing DP work
            tail = max((t for t in result.tasks if t.device == rank), key=lambda t: result.end_s[t.id])
            walk(gap.start_s, gap.end_s, tail.id)
        else:
            walk(gap.start_s, gap.end_s, gap.waited_on)

    return Breakdown(
        compute_s=acc["compute"],
        tp_comm_exposed_s=acc["tp"],
        pp_comm_exposed_s=acc["pp"],
        dp_comm_exposed_s=acc["dp"],
        bubble_s=acc["bubble"],
        interference_s=acc["interference"],
        optimizer_s=acc["optimizer"],
    )

