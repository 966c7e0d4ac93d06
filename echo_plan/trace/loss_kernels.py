"""Transformer Engine's fused cross entropy (``parallel_cross_entropy``), as the kernels it launches.

Megatron-Core with ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te`` (Megatron-Bridge's
recipes set both) hands the bf16 logits [s, b, v/tp] to Transformer Engine's Triton kernels
(``transformer_engine/pytorch/triton/cross_entropy.py``, v2.9 to v2.17 and every commit Megatron-Bridge
v0.3-v0.6 pins):

* ``online_softmax_kernel``: one pass over each row of logits, writing the row's max, sum of
  exponentials and target logit (3 fp32 numbers per row); with tensor parallelism the ranks
  all-gather these (``te_ce_stats`` then an all-gather);
* ``cross_entropy_kernel``: a second pass that writes the loss of each row and stores the gradient
  (softmax minus one-hot, in the logits' dtype) over the logits in place (``te_ce_loss_grad_``); autograd
  keeps that tensor, so the loss holds 2 bytes per logit until backward and makes no fp32 copy;
* ``element_mul_kernel`` in backward: the stored gradient scaled by each row's incoming gradient, in
  place (``te_ce_scale_``).

(Transformer Engine 2.18 stores an fp32 gradient beside the logits instead; no Megatron-Bridge release
pins it.) The code is ours; each op has a CPU reference and a fake implementation, as in ``kernels.py``.
"""

from __future__ import annotations

import torch

from echo_plan.trace import parallel
from echo_plan.trace.fake_pg import TPGroup

Tensor = torch.Tensor

__all__ = ["te_cross_entropy"]


def _rows(logits: Tensor) -> int:
    return logits.numel() // logits.shape[-1]


def _local_target(logits: Tensor, target: Tensor, vocab_start: int) -> tuple[Tensor, Tensor]:
    """Each row's target column in this rank's vocabulary shard, and whether the shard holds it."""
    t = target.reshape(-1) - vocab_start
    inside = (t >= 0) & (t < logits.shape[-1])
    return t.clamp(0, logits.shape[-1] - 1), inside


@torch.library.custom_op("echo_plan::te_ce_stats", mutates_args=())
def te_ce_stats(logits: Tensor, target: Tensor, vocab_start: int) -> Tensor:
    """Per row of this shard: max, sum of exp(x - max), target logit (0 if another rank holds it); flat [rows x 3]."""
    x = logits.float().reshape(-1, logits.shape[-1])
    peak = x.amax(-1)
    total = torch.exp(x - peak[:, None]).sum(-1)
    t, inside = _local_target(logits, target, vocab_start)
    picked = torch.where(inside, x.gather(1, t[:, None]).squeeze(1), torch.zeros_like(peak))
    return torch.stack((peak, total, picked), dim=1).reshape(-1)


te_ce_stats.register_fake(lambda logits, target, vocab_start: logits.new_empty(3 * _rows(logits), dtype=torch.float32))


@torch.library.custom_op("echo_plan::te_ce_loss_grad_", mutates_args=("logits",))
def te_ce_loss_grad_(logits: Tensor, target: Tensor, stats: Tensor, vocab_start: int) -> Tensor:
    """Each row's loss from every rank's stats ([ranks x rows x 3], rank-major); the logits become the gradient."""
    rows, v = _rows(logits), logits.shape[-1]
    st = stats.view(-1, rows, 3)
    peak = st[..., 0].amax(0)
    total = (st[..., 1] * torch.exp(st[..., 0] - peak)).sum(0)
    loss = torch.log(total) + peak - st[..., 2].sum(0)
    flat = logits.view(rows, v)
    grad = torch.exp(flat.float() - peak[:, None]) / total[:, None]
    t, inside = _local_target(logits, target, vocab_start)
    grad[torch.arange(rows), t] -= inside.float()
    flat.copy_(grad.to(logits.dtype))
    return loss.view(target.shape)


te_ce_loss_grad_.register_fake(
    lambda logits, target, stats, vocab_start: logits.new_empty(target.shape, dtype=torch.float32))


@torch.library.custom_op("echo_plan::te_ce_scale_", mutates_args=("grad",))
def te_ce_scale_(grad: Tensor, grad_loss: Tensor) -> None:
    """The stored gradient times each row's incoming gradient, in place."""
    grad.mul_(grad_loss.reshape(grad.shape[:-1]).unsqueeze(-1).to(grad.dtype))


te_ce_scale_.register_fake(lambda grad, grad_loss: None)


class _TECrossEntropy(torch.autograd.Function):
    """Per-token loss of vocabulary-sharded logits; backward hands back the logits' own storage (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, group):
        buffer = logits.detach()  # the same storage, written over by the gradient (the logits are used no more)
        stats = te_ce_stats(buffer, target, 0)  # rank 0's shard starts the vocabulary
        if group is not None and group.size > 1:
            stats = parallel.all_gather(stats, group)
        loss = te_ce_loss_grad_(buffer, target, stats, 0)
        ctx.save_for_backward(buffer)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        te_ce_scale_(grad, grad_loss.contiguous())
        return grad, None, None


def te_cross_entropy(logits: Tensor, target: Tensor, group: TPGroup | None) -> Tensor:
    """Per-token loss [s, b] of the bf16 logits [s, b, v/tp] and targets [s, b], as Transformer Engine runs it."""
    return _TECrossEntropy.apply(logits, target, group)
