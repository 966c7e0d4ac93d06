"""Action lists of the schedules that split the backward pass: ZB-H1, ZB-V and DualPipe.

* **ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1): 1F1B's order
  (rank s runs pp - s - 1 warm-up forwards, then one forward and one input-gradient pass ``Bi``
  alternately), with each rank's weight-gradient passes ``W`` delayed by ``s`` (rank s keeps at
  most s of them pending; they fill the tail of the step, where 1F1B's later ranks idle). Every
  rank then holds at most pp micro-batches between their forward and their W: 1F1B's peak (rank 0's).
* **ZB-V** (same paper, its V schedule): two chunks per rank, rank s holding stages s and
  2 pp - 1 - s. The order comes from list-scheduling the passes with the plan's own forward,
  input-gradient and weight-gradient times (equal when not given, as the paper's analysis
  assumes; the paper's automatic scheduler likewise uses profiled times): whenever a rank is free
  it runs the oldest ready ``Bi``, else a forward (latest stage first) while fewer than 2 x pp
  chunk passes are held (1F1B's peak memory: pp micro-batches of a whole stage; the last place is
  kept for the V's second arm, so the first arm cannot fill it and starve the loss), else a
  pending W, else it waits. The order is then replayed with every real cost (p2p, DP, interference).
* **DualPipe** (DeepSeek-V3, arXiv 2412.19437 section 3.2.1; the order of DeepSeek's reference
  implementation ``dualpipe.py``, its eight steps): each direction gets half of the micro-batches;
  rank s's chunk 0 is stage s of direction 0, chunk 1 stage pp - 1 - s of direction 1 (for ranks
  in the second half the roles of "phase 0/1" swap, so ranks s and pp - 1 - s mirror each other).
  Pairs of a forward and a whole backward of two micro-batches are marked ``paired``: they run
  overlapped, so one's communication hides behind the other's compute. The steps that DeepSeek
  runs with zero-bubble splitting give ``Bi`` and ``W`` (W taken first-in first-out).
"""

from __future__ import annotations

import heapq
from collections import deque

from echo_plan.errors import SpecError
from echo_plan.layout.actions import Action, Layout, Pass, PipelineSchedule
from echo_plan.specs.plan import Schedule, schedule_rule

F, B, BI, W = Pass.FORWARD, Pass.BACKWARD, Pass.INPUT_GRAD, Pass.WEIGHT_GRAD


def build_split_schedule(schedule: Schedule, pp: int, m: int, virtual_stages: int,
                         times: tuple[float, float, float] | None = None,
                         zb_v_order: tuple[tuple[Action, ...], ...] | None = None) -> PipelineSchedule:
    """``times``: ZB-V's (forward, input-gradient, weight-gradient) chunk times to list-schedule with
    (default equal, as the paper's analysis assumes). ``zb_v_order``: ZB-V's action lists for these
    times, already listed (by the replay's compiled twin of :func:`_zb_v`, the same order), or None."""
    why = schedule_rule(schedule, pp, virtual_stages, m)
    if why is not None:
        raise SpecError("schedule", schedule.value, why)
    if schedule is Schedule.ZB_H1:
        return PipelineSchedule(schedule, pp, 1, m, tuple(_zb_h1(s, pp, m) for s in range(pp)))
    if schedule is Schedule.ZB_V:
        t = times or (1.0, 1.0, 1.0)
        return PipelineSchedule(schedule, pp, 2, m, zb_v_order or _zb_v(pp, m, t), Layout.V, times)
    return PipelineSchedule(schedule, pp, 2, m, tuple(_dualpipe(s, pp, m) for s in range(pp)), Layout.DUAL)


def split_layout(schedule: Schedule, pp: int, virtual_stages: int) -> PipelineSchedule:
    """The schedule's layout (which stage each rank's chunks hold) without its action lists."""
    if schedule is Schedule.ZB_V:
        return PipelineSchedule(schedule, pp, 2, 0, (), Layout.V)
    if schedule is Schedule.DUALPIPE:
        return PipelineSchedule(schedule, pp, 2, 0, (), Layout.DUAL)
    return PipelineSchedule(schedule, pp, virtual_stages, 0, ())


def _zb_h1(s: int, pp: int, m: int) -> tuple[Action, ...]:
    warmup = min(pp - s - 1, m)
    lag = s
    out = [Action(F, i, 0) for i in range(warmup)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        out.append(Action(BI, i, 0))
        pending.append(i)
        if len(pending) > lag:
            out.append(Action(W, pending.popleft(), 0))

    for i in range(m - warmup):
        out.append(Action(F, warmup + i, 0))
        backward(i)
    for i in range(m - warmup, m):
        backward(i)
    out.extend(Action(W, i, 0) for i in pending)
    return tuple(out)


def _zb_v(pp: int, m: int, times: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> tuple[tuple[Action, ...], ...]:
    """List scheduling along the V (see the module docstring): stages 0 .. 2pp-1, ``times`` the
    (forward, input-gradient, weight-gradient) time of one chunk. Event-driven: the rank that is
    free first picks; a rank with nothing ready but a pending W runs it, else it waits for the next
    event (a dependency ending, or another rank's pick at the same time)."""
    nst = 2 * pp
    tf, tb, tw = times
    inf = float("inf")
    f_end = [[inf] * m for _ in range(nst)]
    b_end = [[inf] * m for _ in range(nst)]
    stages = [(r, nst - 1 - r) for r in range(pp)]  # the stage each chunk of rank r holds
    next_f = [[0, 0] for _ in range(pp)]
    next_b = [[0, 0] for _ in range(pp)]
    held = [0] * pp
    pend: list[deque] = [deque() for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]
    left = [6 * m] * pp
    cap = 2 * pp  # chunk passes held: 1F1B's peak (pp micro-batches of a whole stage)
    heap = [(0.0, 0, r) for r in range(pp)]  # (free at, waiting, rank): waiting ranks yield to others at that time
    blocked: set[int] = set()  # waiting for a pass its neighbours have not picked yet
    spins = 0
    while heap:
        now, was_waiting, r = heapq.heappop(heap)
        best = None  # (priority, kind, mb, chunk)
        soon = inf
        for c in (0, 1):
            k = stages[r][c]
            i = next_b[r][c]
            if i < m:
                ready = f_end[k][i]
                if k < nst - 1 and b_end[k + 1][i] > ready:
                    ready = b_end[k + 1][i]
                if ready <= now:
                    cand = (0, i, -k, c)
                    if best is None or cand < best:
                        best = cand
                elif ready < soon:
                    soon = ready
            i = next_f[r][c]
            if i < m and held[r] < cap - (1 - c):  # one place kept for the V's second arm: no deadlock
                ready = f_end[k - 1][i] if k > 0 else 0.0
                if ready <= now:
                    cand = (1, i, -k, c)
                    if best is None or cand < best:
                        best = cand
                elif ready < soon:
                    soon = ready
        if best is not None:
            prio, i, nk, c = best
            if prio == 0:
                out[r].append(Action(BI, i, c))
                b_end[-nk][i] = now + tb
                next_b[r][c] += 1
                pend[r].append((i, c))
                end = now + tb
            else:
                out[r].append(Action(F, i, c))
                f_end[-nk][i] = now + tf
                next_f[r][c] += 1
                held[r] += 1
                end = now + tf
        elif pend[r]:
            i, c = pend[r].popleft()
            out[r].append(Action(W, i, c))
            held[r] -= 1
            end = now + tw
        else:  # nothing to run: wait for the next event
            spins += 1
            if spins > 64 * (6 * m * pp + pp):
                raise ValueError("internal: the zb-v list schedule is stuck")
            if soon < inf:
                heapq.heappush(heap, (soon, 0, r))
            else:  # only a neighbour's pick can give it work (the V links rank r to r - 1 and r + 1)
                blocked.add(r)
                if not heap:
                    raise ValueError("internal: the zb-v list schedule is stuck")
            continue
        for x in (r - 1, r + 1):
            if x in blocked:
                blocked.discard(x)
                heapq.heappush(heap, (now, 1, x))
        left[r] -= 1
        if left[r]:
            heapq.heappush(heap, (end, 0, r))
    if any(left):
        raise ValueError("internal: the zb-v list schedule did not finish")
    return tuple(tuple(a) for a in out)


def _dualpipe(rank: int, pp: int, m: int) -> tuple[Action, ...]:
    half = pp // 2
    h = min(rank, pp - 1 - rank)
    flip = 1 if rank >= half else 0
    middle = rank in (half - 1, half)
    per_dir = m // 2
    nf, nb = [0, 0], [0, 0]
    wq: deque[tuple[int, int]] = deque()
    out: list[Action] = []

    def fwd(phase: int, paired: bool = False) -> None:
        c = phase ^ flip
        out.append(Action(F, nf[c], c, paired))
        nf[c] += 1

    def bwd(phase: int, zb: bool = False) -> None:
        c = phase ^ flip
        out.append(Action(BI if zb else B, nb[c], c))
        if zb:
            wq.append((nb[c], c))
        nb[c] += 1

    def weight() -> None:
        i, c = wq.popleft()
        out.append(Action(W, i, c))

    for _ in range((half - h - 1) * 2):  # step 1: forwards of phase 0
        fwd(0)
    for _ in range(h + 1):  # step 2: forwards of both phases
        fwd(0)
        fwd(1)
    for _ in range(half - h - 1):  # step 3: B W F of phase 1, zero-bubble split
        bwd(1, True)
        weight()
        fwd(1)
    for i in range(per_dir - pp + h + 1):  # step 4, the main step: F0&B1 and F1&B0 pairs
        if i == 0 and middle:  # DeepSeek's middle ranks run their first two chunks apart
            fwd(0)
            bwd(1)
        else:
            fwd(0, True)
            bwd(1)
        fwd(1, True)
        bwd(0)
    for _ in range(half - h - 1):  # step 5: B1, then F1&B0
        bwd(1)
        fwd(1, True)
        bwd(0)
    zb = False
    for i in range(h + 1):  # step 6: B1 B0, the second half of them split
        if i == (h + 1) // 2 and h % 2 == 1:
            zb = True
        bwd(1, zb)
        if i == (h + 1) // 2 and h % 2 == 0:
            zb = True
        bwd(0, zb)
    for _ in range(half - h - 1):  # step 7: W, then a split B0
        weight()
        bwd(0, True)
    for _ in range(h + 1):  # step 8: the remaining W
        weight()
    if nf != [per_dir, per_dir] or nb != [per_dir, per_dir] or wq:
        raise ValueError(f"internal: dualpipe rank {rank} ran {nf} forwards and {nb} backwards of {per_dir}")
    return tuple(out)
