"""Pipeline schedules as per-rank action lists (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipe).

An :class:`Action` is "forward (or backward) of micro-batch ``m`` on model chunk ``c`` of pipeline
rank ``s``". Which model stage a chunk holds is the schedule's :class:`Layout`: interleaved, chunk
``c`` of rank ``s`` holds virtual stage ``c * pp + s`` (Megatron-LM: rank 0 holds virtual stages
0, pp, 2pp, ...); in a V (ZB-V) rank ``s`` holds stages ``s`` and ``2 pp - 1 - s``; DualPipe's
two chunks are two copies of the model in opposite directions (rank ``s`` holds stage ``s`` of
one and stage ``pp - 1 - s`` of the other; micro-batches of direction ``d`` run on chunk ``d``).
Each rank runs its list in order on its compute stream; cross-rank dependencies (activations
forward, gradients backward) are given by :func:`action_deps`.

Backward passes are whole (``B``: input and weight gradients), or, in the zero-bubble schedules
and part of DualPipe, split into ``Bi`` (the input gradient, what the previous stage waits for)
and ``W`` (the weight gradients, deferred to fill bubbles); ``schedules_zb.py`` builds those.

The orders follow Megatron-LM's ``megatron/core/pipeline_parallel/schedules.py``:
- 1F1B (``forward_backward_pipelining_without_interleaving``): ``pp - s - 1`` warm-up forwards,
  then one-forward-one-backward, then the remaining backwards.
- Interleaved (``forward_backward_pipelining_with_interleaving``): ``(pp - s - 1) * 2 +
  (v - 1) * pp`` warm-up forwards (all of them when micro-batches == pp), chunk and micro-batch of
  the k-th forward/backward from ``get_model_chunk_id`` / ``get_microbatch_id_in_model_chunk``
  with groups of ``pp`` micro-batches per chunk.
- GPipe (Huang et al. 2019): all forwards, then all backwards.
"""

from __future__ import annotations

from dataclasses import replace

from echo_plan.errors import SpecError
from echo_plan.layout.actions import Action, Layout, Pass, PipelineSchedule
from echo_plan.layout.schedules_zb import build_split_schedule, split_layout
from echo_plan.specs.plan import Schedule, schedule_rule

__all__ = ["Action", "Layout", "Pass", "PipelineSchedule", "build_schedule", "pair_forward_backward",
           "schedule_shape", "action_deps"]


def build_schedule(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1,
                   times: tuple[float, float, float] | None = None,
                   zb_v_order: tuple[tuple[Action, ...], ...] | None = None) -> PipelineSchedule:
    """Per-rank action lists for ``schedule``; raises SpecError when the shape cannot run it.
    ``times``: ZB-V's (forward, input-gradient, weight-gradient) chunk times; ``zb_v_order``: its
    action lists already listed for them (schedules_zb.py)."""
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise SpecError("pp/microbatches/virtual_stages", (pp, num_microbatches, virtual_stages), "positive integers")
    if schedule in (Schedule.ZB_H1, Schedule.ZB_V, Schedule.DUALPIPE):
        return build_split_schedule(schedule, pp, num_microbatches, virtual_stages, times, zb_v_order)
    if schedule is Schedule.INTERLEAVED and virtual_stages > 1:
        if num_microbatches % pp:
            raise SpecError("num_microbatches", num_microbatches,
                            f"the interleaved schedule needs a multiple of pp ({pp})")
        fwd, bwd = _interleaved_actions(pp, num_microbatches, virtual_stages)
        ranks = tuple(_one_rank(fwd, bwd, _interleaved_warmup(s, pp, num_microbatches, virtual_stages))
                      for s in range(pp))
    elif virtual_stages > 1:
        raise SpecError("virtual_stages", virtual_stages, f"only the interleaved schedule has virtual stages, not {schedule.value}")
    elif schedule is Schedule.GPIPE:
        ranks = tuple(_gpipe(num_microbatches) for _ in range(pp))
    else:  # 1F1B, and "interleaved" with one chunk is plain 1F1B
        fwd = [Action(Pass.FORWARD, i, 0) for i in range(num_microbatches)]
        bwd = [Action(Pass.BACKWARD, i, 0) for i in range(num_microbatches)]
        ranks = tuple(_one_rank(fwd, bwd, min(pp - s - 1, num_microbatches)) for s in range(pp))
    return PipelineSchedule(schedule, pp, virtual_stages, num_microbatches, ranks)


def pair_forward_backward(sched: PipelineSchedule) -> PipelineSchedule:
    """``sched`` with every forward that is followed by a backward on its rank marked ``paired``: the
    steady state of 1F1B and interleaved 1F1B run as overlapped forward/backward pairs of two
    micro-batches (Megatron-Core's EP communication overlap; the replay hides one's exposed
    communication under the other's compute, replay/pipeline.py). Warm-up forwards and cool-down
    backwards stay alone."""
    acts = tuple(tuple(replace(a, paired=True) if a.kind is Pass.FORWARD and i + 1 < len(r)
                       and r[i + 1].kind is Pass.BACKWARD else a for i, a in enumerate(r))
                 for r in sched.actions)
    return replace(sched, actions=acts)


def schedule_shape(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1,
                   times: tuple[float, float, float] | None = None) -> PipelineSchedule:
    """What :func:`build_schedule` returns, checked the same way, but without the action lists (empty):
    the layout (which stage each rank's chunks hold) of a step whose actions are built only for the
    micro-batch counts actually replayed (``simulate``'s steady state replays a few short counts)."""
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise SpecError("pp/microbatches/virtual_stages", (pp, num_microbatches, virtual_stages), "positive integers")
    if schedule in (Schedule.ZB_H1, Schedule.ZB_V, Schedule.DUALPIPE):
        why = schedule_rule(schedule, pp, virtual_stages, num_microbatches)
        if why is not None:
            raise SpecError("schedule", schedule.value, why)
        lay = split_layout(schedule, pp, virtual_stages)
        return PipelineSchedule(schedule, pp, lay.virtual_stages, num_microbatches, (), lay.layout,
                                times if schedule is Schedule.ZB_V else None)
    if schedule is Schedule.INTERLEAVED and virtual_stages > 1:
        if num_microbatches % pp:
            raise SpecError("num_microbatches", num_microbatches,
                            f"the interleaved schedule needs a multiple of pp ({pp})")
    elif virtual_stages > 1:
        raise SpecError("virtual_stages", virtual_stages, f"only the interleaved schedule has virtual stages, not {schedule.value}")
    return PipelineSchedule(schedule, pp, virtual_stages, num_microbatches, ())


def _gpipe(m: int) -> tuple[Action, ...]:
    return tuple([Action(Pass.FORWARD, i, 0) for i in range(m)] + [Action(Pass.BACKWARD, i, 0) for i in range(m)])


def _one_rank(fwd: list[Action], bwd: list[Action], warmup: int) -> tuple[Action, ...]:
    """One rank's order: ``warmup`` forwards, then one forward and one backward in turn, then the
    remaining backwards. Every rank of 1F1B and of interleaved 1F1B runs the same forward and backward
    sequences and differs only in its warm-up, so the Action objects are made once and shared."""
    rest = len(fwd) - warmup
    steady: list[Action | None] = [None] * (2 * rest)
    steady[0::2] = fwd[warmup:]
    steady[1::2] = bwd[:rest]
    return tuple(fwd[:warmup] + steady + bwd[rest:])  # type: ignore[operator]


def _one_f_one_b(s: int, pp: int, m: int) -> tuple[Action, ...]:
    return _one_rank([Action(Pass.FORWARD, i, 0) for i in range(m)],
                     [Action(Pass.BACKWARD, i, 0) for i in range(m)], min(pp - s - 1, m))


def _interleaved_warmup(s: int, pp: int, m: int, v: int) -> int:
    total = m * v
    return total if m == pp else min((pp - s - 1) * 2 + (v - 1) * pp, total)


def _interleaved_actions(pp: int, m: int, v: int) -> tuple[list[Action], list[Action]]:
    """The k-th forward and the k-th backward of every rank (Megatron-LM's ``get_model_chunk_id`` and
    ``get_microbatch_id_in_model_chunk``: groups of ``pp`` micro-batches per chunk)."""
    group = pp * v
    fwd, bwd = [], []
    for k in range(m * v):
        c = (k % group) // pp
        mb = (k // group) * pp + k % pp
        fwd.append(Action(Pass.FORWARD, mb, c))
        bwd.append(Action(Pass.BACKWARD, mb, v - c - 1))
    return fwd, bwd


def _interleaved(s: int, pp: int, m: int, v: int) -> tuple[Action, ...]:
    fwd, bwd = _interleaved_actions(pp, m, v)
    return _one_rank(fwd, bwd, _interleaved_warmup(s, pp, m, v))


def action_deps(sched: PipelineSchedule, rank: int, action: Action) -> tuple[tuple[int, Action], ...]:
    """Actions on other ranks (or other chunks) whose output this action needs, as (rank, action).

    Forward of virtual stage ``vs`` needs the forward of ``vs - 1`` (its activations); backward of
    ``vs`` (whole, or its input-gradient part) needs the one of ``vs + 1`` that sent the gradient of
    its output, and its own forward; a weight-gradient pass needs its own input-gradient pass. The
    rank's own order is not listed here: each rank's list is sequential.
    """
    mb, c = action.microbatch, action.chunk
    if action.kind is Pass.FORWARD:
        prev = sched.neighbour(rank, c, -1)
        return () if prev is None else ((prev[0], Action(Pass.FORWARD, mb, prev[1])),)
    if action.kind is Pass.WEIGHT_GRAD:
        return ((rank, Action(Pass.INPUT_GRAD, mb, c)),)
    own = (rank, Action(Pass.FORWARD, mb, c))
    nxt = sched.neighbour(rank, c, +1)
    if nxt is None:
        return (own,)
    kind = next((a.kind for a in sched.actions[nxt[0]] if a.microbatch == mb and a.chunk == nxt[1]
                 and a.kind.sends_gradient), Pass.BACKWARD)
    return (own, (nxt[0], Action(kind, mb, nxt[1])))
