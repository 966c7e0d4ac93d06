"""Transformer Engine's fused MoE token permutation kernels, as torch custom ops.

With ``moe_permute_fusion`` (the NeMo / Megatron-Bridge performance recipes set it) Megatron-Core
permutes and un-permutes tokens with TE's fused kernels (transformer_engine.pytorch.permutation:
moe_permute, moe_unpermute, moe_sort_chunks_by_index) instead of index_select / scatter-add chains.
One kernel each way; what each keeps for backward is what the fused kernel keeps: permutation keeps
only its row map; un-permutation with router probabilities keeps its input and the probabilities
(the probabilities' gradient needs them). Each op has a CPU reference and a fake implementation;
the code is ours.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


@torch.library.custom_op("echo_plan::moe_permute", mutates_args=())
def moe_permute(tokens: Tensor, index: Tensor) -> Tensor:
    """Row ``i`` of the output is token ``index[i]`` (one row per routed copy, sorted by expert)."""
    return tokens.index_select(0, index)


@torch.library.custom_op("echo_plan::moe_permute_backward", mutates_args=())
def moe_permute_backward(grad: Tensor, index: Tensor, num_tokens: int) -> Tensor:
    return grad.new_zeros((num_tokens, grad.shape[1])).index_add(0, index, grad)


moe_permute.register_fake(lambda tokens, index: tokens.new_empty((index.shape[0], tokens.shape[1])))
moe_permute_backward.register_fake(lambda grad, index, num_tokens: grad.new_empty((num_tokens, grad.shape[1])))


def _permute_setup(ctx, inputs, output):
    tokens, index = inputs
    ctx.num_tokens = tokens.shape[0]
    ctx.save_for_backward(index)


def _permute_bwd(ctx, grad):
    (index,) = ctx.saved_tensors
    return moe_permute_backward(grad, index, ctx.num_tokens), None


moe_permute.register_autograd(_permute_bwd, setup_context=_permute_setup)


@torch.library.custom_op("echo_plan::moe_unpermute", mutates_args=())
def moe_unpermute(rows: Tensor, probs: Tensor, index: Tensor, num_tokens: int) -> Tensor:
    """Token ``t`` of the output sums ``probs[i] * rows[i]`` over the copies ``i`` with ``index[i] == t``."""
    return rows.new_zeros((num_tokens, rows.shape[1])).index_add(0, index, rows * probs.unsqueeze(1))


@torch.library.custom_op("echo_plan::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward(grad: Tensor, rows: Tensor, probs: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    g = grad.index_select(0, index)
    return g * probs.unsqueeze(1), (g.float() * rows.float()).sum(1).to(probs.dtype)


moe_unpermute.register_fake(lambda rows, probs, index, num_tokens: rows.new_empty((num_tokens, rows.shape[1])))
moe_unpermute_backward.register_fake(lambda grad, rows, probs, index: (torch.empty_like(rows), torch.empty_like(probs)))


def _unpermute_setup(ctx, inputs, output):
    rows, probs, index, _n = inputs
    ctx.save_for_backward(rows, probs, index)


def _unpermute_bwd(ctx, grad):
    rows, probs, index = ctx.saved_tensors
    g_rows, g_probs = moe_unpermute_backward(grad, rows, probs, index)
    return g_rows, g_probs, None, None


moe_unpermute.register_autograd(_unpermute_bwd, setup_context=_unpermute_setup)
