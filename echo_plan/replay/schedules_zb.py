"""Action lists of the schedules that split the backward pass: ZB-H1, ZB-V and DualPipe.

* **ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1): 1F1B's order
  (rank s runs pp - s - 1 warm-up forwards, then one forward and one input-gradient pass ``Bi``
  alternately), with each rank's weight-gradient passes ``W`` delayed by ``s`` (rank s keeps at
  most s of them pending; they fill the tail of the step, where 1F1B's later ranks idle). Every
  rank then holds at most pp micro-batches between their forward and their W: 1F1B's peak (rank 0's).
* **ZB-V** (same paper, its V schedule): two chunks per rank, rank s holding stages s and
  2 pp - 1 - s. The order comes from list-scheduling the passes at equal unit times, as the
  paper's analysis assumes: at each step a rank runs the oldest ready ``Bi``, else a forward
  (latest stage first) while fewer than 2 x pp chunk passes are held (1F1B's peak memory: pp
  micro-batches of a whole stage), else a pending W. The order is then replayed with real times.
* **DualPipe** (DeepSeek-V3, arXiv 2412.19437 section 3.2.1; the order of DeepSeek's reference
  implementation ``dualpipe.py``, its eight steps): each direction gets half of the micro-batches;
  rank s's chunk 0 is stage s of direction 0, chunk 1 stage pp - 1 - s of direction 1 (for ranks
  in the second half the roles of "phase 0/1" swap, so ranks s and pp - 1 - s mirror each other).
  Pairs of a forward and a whole backward of two micro-batches are marked ``paired``: they run
  overlapped, so one's communication hides behind the other's compute. The steps that DeepSeek
  runs with zero-bubble splitting give ``Bi`` and ``W`` (W taken first-in first-out).
"""

from __future__ import annotations

from collections import deque

from echo_plan.errors import SpecError
from echo_plan.replay.schedules import Action, Layout, Pass, PipelineSchedule
from echo_plan.specs.plan import Schedule, schedule_rule

F, B, BI, W = Pass.FORWARD, Pass.BACKWARD, Pass.INPUT_GRAD, Pass.WEIGHT_GRAD


def build_split_schedule(schedule: Schedule, pp: int, m: int, virtual_stages: int) -> PipelineSchedule:
    why = schedule_rule(schedule, pp, virtual_stages, m)
    if why is not None:
        raise SpecError("schedule", schedule.value, why)
    if schedule is Schedule.ZB_H1:
        return PipelineSchedule(schedule, pp, 1, m, tuple(_zb_h1(s, pp, m) for s in range(pp)))
    if schedule is Schedule.ZB_V:
        return PipelineSchedule(schedule, pp, 2, m, _zb_v(pp, m), Layout.V)
    return PipelineSchedule(schedule, pp, 2, m, tuple(_dualpipe(s, pp, m) for s in range(pp)), Layout.DUAL)


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


def _zb_v(pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """List scheduling at unit times (see the module docstring); stages 0 .. 2pp-1 along the V."""
    nst = 2 * pp
    holder = [(k, 0) if k < pp else (nst - 1 - k, 1) for k in range(nst)]
    stage_of = {hc: k for k, hc in enumerate(holder)}
    f_done = [[-1] * m for _ in range(nst)]  # time step a forward of (stage, mb) ended (exclusive)
    b_done = [[-1] * m for _ in range(nst)]
    next_f = [[0, 0] for _ in range(pp)]
    next_b = [[0, 0] for _ in range(pp)]
    held = [0] * pp
    pend: list[deque] = [deque() for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]
    cap = 2 * pp
    total = 3 * nst * m
    done, t = 0, 0
    while done < total:
        if t > 10 * total + 10 * nst:
            raise ValueError("internal: the zb-v list schedule did not finish")
        picks = []
        for r in range(pp):
            pick = None
            cands = []
            for c in (0, 1):
                i = next_b[r][c]
                k = stage_of[(r, c)]
                if i < m and 0 <= f_done[k][i] <= t and (k == nst - 1 or 0 <= b_done[k + 1][i] <= t):
                    cands.append((i, -k, c))
            if cands:
                i, _, c = min(cands)
                pick = (BI, i, c)
            elif held[r] < cap:
                fc = []
                for c in (1, 0):
                    i = next_f[r][c]
                    k = stage_of[(r, c)]
                    if i < m and (k == 0 or 0 <= f_done[k - 1][i] <= t):
                        fc.append((i, -k, c))
                if fc:
                    i, _, c = min(fc)
                    pick = (F, i, c)
            if pick is None and pend[r]:
                i, c = pend[r].popleft()
                pick = (W, i, c)
            if pick is not None:
                picks.append((r, pick))
        for r, (kind, i, c) in picks:  # all ranks decide before any result of this step is visible
            k = stage_of[(r, c)]
            out[r].append(Action(kind, i, c))
            done += 1
            if kind is F:
                f_done[k][i] = t + 1
                next_f[r][c] += 1
                held[r] += 1
            elif kind is BI:
                b_done[k][i] = t + 1
                next_b[r][c] += 1
                pend[r].append((i, c))
            else:
                held[r] -= 1
        t += 1
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
