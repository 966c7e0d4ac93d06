"""Per-op selective activation checkpointing as torchtitan does it (``recompute_policy: ops``).

torchtitan's ``selective`` checkpointing with ``selective_ac_option = "op"`` (torchtitan
``distributed/activation_checkpoint.py``, ``_get_custom_policy``) checkpoints the whole transformer
block with PyTorch's selective checkpointing (``torch.utils.checkpoint`` with
``create_selective_checkpoint_contexts``): the outputs of the ops in its save list are kept, every other
op is recomputed in backward. The save list is the matmuls, attention and the reduce-scatter of
sequence parallelism, except every second matmul (counted separately in forward and in recomputation):
torchtitan keeps the first, third, fifth ... matmul's output and recomputes the others.

Here the block is checkpointed the same way, with the same policy over the tracer's ops: ``aten.mm``
(and ``aten.addmm`` and the FP8 GEMMs, the tracer's other matmuls), the fused attention op, and the
reduce-scatter. PyTorch keeps what the policy saves in the checkpoint's own cache, not through
autograd's saved-tensor hooks, so an observer inside the forward context hands each saved output to the
meter (``keep``). The recomputed ops run again in backward inside the tracer's recompute context.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, ContextManager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default}


def _save_list() -> set:
    """The ops whose outputs the policy keeps (every second matmul excepted)."""
    ops = set(MATMULS)
    op = getattr(torch.ops._c10d_functional, "reduce_scatter_tensor", None)
    if op is not None:
        ops.add(op.default)
    return ops


def _is_matmul(func) -> bool:
    return func in MATMULS


class _Decisions:
    """torchtitan's policy, and the decision of the op running now (for the observer)."""

    def __init__(self, save: set) -> None:
        self.save = save
        self.count = {"forward": 0, "recompute": 0}
        self.last: bool = False

    def policy(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        matmul = _is_matmul(func)
        if matmul:
            self.count[mode] += 1
        keep = (func in self.save or _is_attention(func)) and not (matmul and self.count[mode] % 2 == 0)
        self.last = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _is_attention(func) -> bool:
    """The tracer's fused attention kernels (torchtitan saves SDPA's flash, efficient and cuDNN outputs)."""
    name = str(func)
    return name.startswith("echo_plan.flash_attention") and "backward" not in name


class _Observer(TorchDispatchMode):
    """Inside the checkpoint's forward: the outputs the policy saved go to ``keep``."""

    def __init__(self, decisions: _Decisions, keep: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self.decisions, self.keep = decisions, keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.decisions.last = False
        out = func(*args, **(kwargs or {}))
        if self.decisions.last:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.keep(t)
        return out


@contextmanager
def _both(first: ContextManager, second: ContextManager):
    with first, second:
        yield


def op_checkpointed(fn, *args, recompute_context: Callable[[], ContextManager],
                    keep: Callable[[torch.Tensor], None]):
    """``fn(*args)`` checkpointed with torchtitan's per-op policy (module docstring)."""
    decisions = _Decisions(_save_list())

    def contexts():
        fwd, rec = create_selective_checkpoint_contexts(decisions.policy)
        return _both(fwd, _Observer(decisions, keep)), _both(rec, recompute_context())

    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts)
