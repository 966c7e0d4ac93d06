"""Pipeline schedules as per-rank action lists (GPipe, 1F1B, interleaved 1F1B).

An :class:`Action` is "forward (or backward) of micro-batch ``m`` on model chunk ``c`` of pipeline
rank ``s``". Model chunk ``c`` of rank ``s`` holds virtual stage ``c * pp + s`` (Megatron-LM's
interleaved layout: rank 0 holds layers of virtual stages 0, pp, 2pp, ...). Each rank runs its
list in order on its compute stream; cross-rank dependencies (activations forward, gradients
backward) are given by :func:`action_deps`.

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

from dataclasses import dataclass
from enum import Enum

from echo_plan.errors import SpecError
from echo_plan.specs.plan import Schedule


class Pass(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class Action:
    kind: Pass
    microbatch: int
    chunk: int  # model chunk on this rank (0 .. virtual_stages-1)


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """The ordered actions of every pipeline rank for one training step."""

    schedule: Schedule
    pp: int
    virtual_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # actions[s] = rank s's list, in execution order

    def virtual_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def rank_chunk(self, virtual_stage: int) -> tuple[int, int]:
        """(pipeline rank, chunk) that holds a virtual stage."""
        return virtual_stage % self.pp, virtual_stage // self.pp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.virtual_stages


def build_schedule(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1) -> PipelineSchedule:
    """Per-rank action lists for ``schedule``; raises SpecError when the shape cannot run it."""
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise SpecError("pp/microbatches/virtual_stages", (pp, num_microbatches, virtual_stages), "positive integers")
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
    ``vs`` needs the backward of ``vs + 1`` (the gradient of its output) and its own forward. The
    rank's own order is not listed here: each rank's list is sequential.
    """
    vs = sched.virtual_stage(rank, action.chunk)
    last = sched.num_virtual_stages - 1
    if action.kind is Pass.FORWARD:
        if vs == 0:
            return ()
        r, c = sched.rank_chunk(vs - 1)
        return ((r, Action(Pass.FORWARD, action.microbatch, c)),)
    own = (rank, Action(Pass.FORWARD, action.microbatch, action.chunk))
    if vs == last:
        return (own,)
    r, c = sched.rank_chunk(vs + 1)
    return (own, (r, Action(Pass.BACKWARD, action.microbatch, c)))
