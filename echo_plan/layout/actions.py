"""What a pipeline schedule is made of: passes, actions, the stage layout, and one step's action lists
(built by schedules.py and schedules_zb.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from echo_plan.specs.plan import Schedule


class Pass(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    INPUT_GRAD = "Bi"  # zero-bubble "B": the input gradient only
    WEIGHT_GRAD = "W"  # zero-bubble "W": the weight gradients of an earlier Bi

    @property
    def sends_gradient(self) -> bool:
        return self is Pass.BACKWARD or self is Pass.INPUT_GRAD

    @property
    def split(self) -> bool:
        return self is Pass.INPUT_GRAD or self is Pass.WEIGHT_GRAD

    @property
    def grads_ready(self) -> bool:
        """After this pass the chunk's weight gradients of that micro-batch are complete."""
        return self is Pass.BACKWARD or self is Pass.WEIGHT_GRAD


class Layout(str, Enum):
    """Which model stage each (rank, chunk) holds."""

    INTERLEAVED = "interleaved"  # chunk c of rank s: stage c * pp + s (one chunk: plain pipeline)
    V = "v"  # ZB-V: chunk 0 of rank s is stage s, chunk 1 is stage 2 pp - 1 - s
    DUAL = "dual"  # DualPipe: chunk d is direction d's copy; stage s (d = 0) or pp - 1 - s (d = 1)


@dataclass(frozen=True, slots=True)
class Action:
    kind: Pass
    microbatch: int  # within the chunk's direction (DualPipe: each direction numbers its own)
    chunk: int  # model chunk on this rank (0 .. chunks-1)
    paired: bool = field(default=False, compare=False)  # DualPipe: overlapped with the next action


@dataclass(frozen=True, slots=True)
class PipelineSchedule:
    """The ordered actions of every pipeline rank for one training step."""

    schedule: Schedule
    pp: int
    virtual_stages: int  # model chunks per rank
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]  # actions[s] = rank s's list, in execution order
    layout: Layout = Layout.INTERLEAVED
    times: tuple[float, float, float] | None = None  # ZB-V: the (F, Bi, W) times its order was built for

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """The model stage (in its direction's order) that ``chunk`` of ``rank`` holds."""
        if self.layout is Layout.V:
            return rank if chunk == 0 else 2 * self.pp - 1 - rank
        if self.layout is Layout.DUAL:
            return rank if chunk == 0 else self.pp - 1 - rank
        return chunk * self.pp + rank

    def rank_chunk(self, virtual_stage: int, direction: int = 0) -> tuple[int, int]:
        """(pipeline rank, chunk) that holds a model stage (of a direction, for DualPipe)."""
        if self.layout is Layout.V:
            k = virtual_stage
            return (k, 0) if k < self.pp else (2 * self.pp - 1 - k, 1)
        if self.layout is Layout.DUAL:
            return (virtual_stage, 0) if direction == 0 else (self.pp - 1 - virtual_stage, 1)
        return virtual_stage % self.pp, virtual_stage // self.pp

    def direction(self, chunk: int) -> int:
        return chunk if self.layout is Layout.DUAL else 0

    @property
    def num_virtual_stages(self) -> int:
        """Model stages a micro-batch passes through (DualPipe: pp, each rank holding two copies' stages)."""
        return self.pp if self.layout is Layout.DUAL else self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        return any(a.kind is Pass.WEIGHT_GRAD for acts in self.actions for a in acts)

    def neighbour(self, rank: int, chunk: int, step: int) -> tuple[int, int] | None:
        """(rank, chunk) of the model stage ``step`` (+1 or -1) away in the chunk's direction; None past an end."""
        k = self.virtual_stage(rank, chunk) + step
        if k < 0 or k >= self.num_virtual_stages:
            return None
        return self.rank_chunk(k, self.direction(chunk))
