"""Where the step's time goes, on the pipeline rank that finishes last.

The rank's compute stream is either busy or idle. Busy time is its chunks and its optimizer:
each chunk splits into isolated compute, exposed TP communication, the exposed expert exchange
(MoE dispatch and combine) and level-1 interference (from the layer replay), and whatever longer it took in the step replay is level-2 interference (a DP
bucket or a p2p transfer beside it). Idle time is attributed by walking back the chain of tasks
that released the next compute task: the part of the gap during which a p2p transfer it waited on
was running is ``pp_comm_exposed``, a DP collective ``dp_comm_exposed``; the part spent waiting
for compute on another rank (the pipeline fill and drain) is ``bubble``. The parts add up to the
step time by construction.

Works on the replay's position lists (a step's task ids are their positions), so it touches only
the critical rank's tasks and the chains it walks, not every task of the step.
"""

from __future__ import annotations

from echo_plan.replay.engine import ReplayResult
from echo_plan.replay.pipeline import COMPUTE, Category, StepTasks
from echo_plan.replay.results import Breakdown


def device_ends(result: ReplayResult) -> dict[int, float]:
    """When each device's last task ends."""
    return dict(result.device_end_s)


def critical_rank(result: ReplayResult, pp: int) -> int:
    """The pipeline rank whose last task ends last (the lowest such rank on a tie)."""
    ends = result.device_end_s
    return max(range(pp), key=lambda r: (ends.get(r, 0.0), -r))


def step_breakdown(step: StepTasks, result: ReplayResult, rank: int) -> Breakdown:
    info = step.info
    start, end, work = result.start_at, result.end_at, result.work_at
    compute = tp = pp_s = dp_s = bubble = inter = opt = ep = host = 0.0
    step_end = result.device_end_s.get(rank, 0.0)
    OPT = Category.OPTIMIZER
    for i in result.queue(rank, COMPUTE):
        w = work[i]
        actual = end[i] - start[i]
        ti = info[i]
        if ti.category is OPT:
            opt += w
        else:
            ph = ti.phase
            compute += ph.compute_s * ti.share + ti.extra_s
            tp += ph.tp_comm_exposed_s * ti.share
            ep += ph.ep_comm_exposed_s * ti.share
            host += ph.host_exposed_s * ti.share
            inter += ph.interference_s * ti.share
        inter += actual - w

    waited, prev = result.waited_at, result.prev_at
    P2P, DP = Category.P2P, Category.DP
    for gap in result.idle_intervals(rank, COMPUTE, 0.0, step_end):
        gap_start = gap.start_s
        cursor = gap.end_s
        if gap.next_task is None:  # after the optimizer: waiting for the rank's trailing DP work
            on_rank = sorted(i for q in result.device_queues(rank) for i in q)
            x = max(on_rank, key=lambda i: end[i])
        else:
            x = -1 if gap.waited_on is None else gap.waited_on
        while x >= 0 and cursor > gap_start:
            cat = info[x].category
            if cat is not P2P and cat is not DP:
                break  # waiting on compute (another rank's, or a chain back to it): bubble
            s = start[x]
            seg = s if s >= gap_start else gap_start
            if cat is P2P:
                pp_s += cursor - seg
            else:
                dp_s += cursor - seg
            cursor = seg
            released_by = waited[x]
            x = released_by if released_by >= 0 else prev[x]
        if cursor > gap_start:
            bubble += cursor - gap_start

    return Breakdown(compute_s=compute, tp_comm_exposed_s=tp, pp_comm_exposed_s=pp_s, dp_comm_exposed_s=dp_s,
                     bubble_s=bubble, interference_s=inter, optimizer_s=opt, ep_comm_exposed_s=ep,
                     host_exposed_s=host)
