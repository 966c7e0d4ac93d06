"""Fully sharded data parallelism in the step replay: which passes gather a chunk's blocks and which
reduce-scatter their gradients, as PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) runs them.

Each FSDP unit of a chunk (one transformer block; the chunk's root unit holds the embedding, final
norm and output layer) is a :class:`~echo_plan.replay.pipeline.DpBucket` whose ``gather_s`` is its
parameter all-gather and ``reduce_s`` its gradient reduce-scatter (plus, in HSDP, the all-reduce of
the shard across replicas). A pass that gathers runs as one compute piece per unit: unit j's piece
waits for unit j's all-gather, and the all-gather of unit j + 1 is issued when unit j's piece is
issued, after piece j - 1 ended (FSDP2's implicit prefetch of one unit: at most the current and the
next unit are held unsharded). The all-gathers and reduce-scatters share one data-parallel stream in
the order FSDP2 issues them (the next unit's all-gather, then the finished unit's reduce-scatter): two
NCCL kernels on the same links share their bandwidth, which one FIFO stream stands for. With FSDP2's runtime
(stack ``fsdp_copy_kernels``) a unit's piece also carries the copy kernels FSDP2 runs on the compute stream: the
copy-out of its all-gather into the unsharded parameters when the pass gathers it, and the copy-in of its
gradients into the reduce-scatter buffer when the pass reduces (``DpBucket.copy_out_s``, ``copy_in_s``).

When a pass gathers (``FsdpSteps``, from the plan):

* forward: every forward without a pipeline; with one, only the first forward of each chunk
  (torch.distributed.pipelining does not reshard after backward, ``set_reshard_after_backward(False)``
  for all but the last micro-batch, so a forward finds its blocks gathered by the backward before it;
  the warm-up forwards that follow a resharding forward gather again, which is not counted here);
* backward: with ``reshard_after_forward``, every unit but the root and the last block (torchtitan
  does not reshard the last block, which backward needs first; FSDP2 never reshards the root);
* the reduce-scatter: after every backward without a pipeline (torchtitan's gradient accumulation does
  not skip the gradient sync), after the last one with a pipeline (``set_requires_gradient_sync``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo_plan.replay.kinds import TaskKind


@dataclass(frozen=True, slots=True)
class FsdpSteps:
    gather_every_forward: bool  # else only the first forward of each chunk (the stage keeps them)
    gather_in_backward: bool  # gather again before each backward (reshard after forward)
    reduce_every_backward: bool  # else only after the chunk's last backward

    @classmethod
    def of(cls, pp: int, reshard_after_forward: bool) -> "FsdpSteps":
        return cls(pp == 1, reshard_after_forward, pp == 1)


@dataclass(frozen=True, slots=True)
class FsdpPass:
    """What one pass of a chunk does: ``gathered`` unit positions (in the pass's unit order) whose
    all-gather it waits for, and whether it reduce-scatters each unit's gradients after its piece."""

    pieces: bool
    gathered: frozenset[int]
    reduces: bool

    def tasks(self, units: int) -> int:
        """Data-parallel tasks of the pass: its all-gathers and, when it reduces, a reduce per unit."""
        return len(self.gathered) + (units if self.reduces else 0)

    def copies_s(self, unit: Any, position: int) -> float:
        """FSDP2's compute-stream copies for ``unit`` (a ``DpBucket``) at ``position`` in this pass: its all-gather's
        copy-out when the pass gathers it, its gradients' copy-in when the pass reduces."""
        return ((unit.copy_out_s if position in self.gathered else 0.0)
                + (unit.copy_in_s if self.reduces else 0.0))


NO_PIECES = FsdpPass(False, frozenset(), False)


def fsdp_pass(steps: FsdpSteps, kept: tuple[bool, ...], forward: bool, first_forward: bool,
              last_backward: bool) -> FsdpPass:
    """The pass of a chunk whose units, in backward order, are ``kept`` (True: never gathered again for
    backward: the root unit, the last block). Positions are in the pass's order: forward runs the
    units from the last of ``kept`` to the first, backward from the first."""
    n = len(kept)
    if n == 0:
        return NO_PIECES
    if forward:
        if steps.gather_every_forward or first_forward:
            return FsdpPass(True, frozenset(range(n)), False)
        return NO_PIECES
    gathered = frozenset(j for j in range(n) if not kept[j]) if steps.gather_in_backward else frozenset()
    reduces = steps.reduce_every_backward or last_backward
    if not gathered and not reduces:
        return NO_PIECES
    return FsdpPass(True, gathered, reduces)


def with_copies(mix: Any, kind: TaskKind, factor: float, alone_s: float, copies_s: float) -> tuple:
    """A compute piece's work mix for the interference blend with ``copies_s`` of memory-bound copy kernels added:
    its phase's ``mix`` (seconds per kind) times ``factor`` (the piece's share of the phase), or without a mix its
    ``kind`` alone over ``alone_s``."""
    blend = {k: w * factor for k, w in mix} if mix else {kind: alone_s}
    blend[TaskKind.MEMORY] = blend.get(TaskKind.MEMORY, 0.0) + copies_s
    return tuple(sorted(blend.items(), key=lambda kw: kw[0].value))
