"""Transformer Engine's fused MoE token permutation kernels, as torch custom ops.

With ``moe_permute_fusion`` (the NeMo / Megatron-Bridge performance recipes set it) Megatron-Core
permutes and un-permutes tokens with TE's fused kernels (transformer_engine.pytorch.permutation:
moe_permute, moe_unpermute, moe_sort_chunks_by_index) instead of index_select / scatter-add chains.
One kernel each way; what each keeps for backward is what the fused kernel keeps: permutation keeps
only its row map; un-permutation with router probabilities keeps its input and the probabilities
(the probabilities' gradient needs them), without them (``moe_unpermute_sum``) only its row map.

Megatron-Core 0.13's memory-efficient permutation (megatron/core/transformer/moe/experts.py with
fusions/fused_bias_swiglu.py ``weighted_bias_swiglu_impl``, commit 2659630, April 2025) moves the
probabilities into the experts: they are permuted and dispatched with the token copies and weight
the activation (``weighted_act``: act(h) x p in one kernel, keeping h and p), so un-permutation is
a plain sum. Each op has a CPU reference and a fake implementation; the code is ours.
"""

from __future__ import annotations

import torch

from echo_plan.trace.fp8_kernels import fp8_block_cast, fp8_block_dequant
from echo_plan.trace.fused_elementwise import (clamped_geglu_backward, clamped_geglu_reference, swiglu,
                                               swiglu_backward)

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


@torch.library.custom_op("echo_plan::moe_unpermute_sum", mutates_args=())
def moe_unpermute_sum(rows: Tensor, index: Tensor, num_tokens: int) -> Tensor:
    """Token ``t`` of the output sums the copies ``i`` with ``index[i] == t`` (already weighted)."""
    return rows.new_zeros((num_tokens, rows.shape[1])).index_add(0, index, rows)


moe_unpermute_sum.register_fake(lambda rows, index, num_tokens: rows.new_empty((num_tokens, rows.shape[1])))


def _unpermute_sum_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _unpermute_sum_bwd(ctx, grad):
    (index,) = ctx.saved_tensors
    return moe_permute(grad, index), None, None  # each copy's gradient is its token's: a gather


moe_unpermute_sum.register_autograd(_unpermute_sum_bwd, setup_context=_unpermute_sum_setup)


@torch.library.custom_op("echo_plan::weighted_act", mutates_args=())
def weighted_act(h: Tensor, probs: Tensor, kind: str) -> Tensor:
    """``act(h) * probs`` per row (``probs`` [..., 1], fp32) for ``kind`` swiglu or clamped_geglu."""
    return (_act(h, kind).float() * probs).to(h.dtype)


@torch.library.custom_op("echo_plan::weighted_act_backward", mutates_args=())
def weighted_act_backward(grad: Tensor, h: Tensor, probs: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    back = clamped_geglu_backward if kind == "clamped_geglu" else swiglu_backward
    dh = back((grad.float() * probs).to(grad.dtype), h)
    dp = (grad.float() * _act(h.float(), kind)).sum(-1, keepdim=True)
    return dh, dp.to(probs.dtype)


weighted_act.register_fake(lambda h, probs, kind: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
weighted_act_backward.register_fake(lambda grad, h, probs, kind: (torch.empty_like(h), torch.empty_like(probs)))


def _act(h: Tensor, kind: str) -> Tensor:
    if kind == "clamped_geglu":
        return clamped_geglu_reference(h)
    if kind != "swiglu":
        raise ValueError(f"weighted_act: kind {kind!r}; swiglu or clamped_geglu")
    gate, up = torch.chunk(h, 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _weighted_setup(ctx, inputs, output):
    h, probs, kind = inputs
    ctx.kind = kind
    ctx.save_for_backward(h, probs)


def _weighted_bwd(ctx, grad):
    h, probs = ctx.saved_tensors
    dh, dp = weighted_act_backward(grad, h, probs, ctx.kind)
    return dh, dp, None


weighted_act.register_autograd(_weighted_bwd, setup_context=_weighted_setup)


class CachedWeightedAct(torch.autograd.Function):
    """The weighted activation that keeps only its input in FP8 (1 x 128 tiles, fp32 scales) and the
    probabilities for backward, where the input is dequantised and the gradients taken from it (DeepSeek-V3:
    the SwiGLU inputs cached in FP8 and its output recomputed)."""

    @staticmethod
    def forward(ctx, h, probs, kind: str):
        q, s, _, _ = fp8_block_cast(h.reshape(-1, h.shape[-1]), False, False)
        ctx.kind, ctx.shape, ctx.dtype = kind, h.shape, h.dtype
        ctx.save_for_backward(q, s, probs)
        return weighted_act(h, probs, kind)

    @staticmethod
    def backward(ctx, grad):
        q, s, probs = ctx.saved_tensors
        h = fp8_block_dequant(q, s, ctx.shape[-1]).to(ctx.dtype).reshape(ctx.shape)
        weighted_act(h, probs, ctx.kind)  # the output again, for FC2's weight gradient (freed after forward)
        dh, dp = weighted_act_backward(grad, h, probs, ctx.kind)
        return dh, dp, None


class CachedSwiGLU(torch.autograd.Function):
    """SwiGLU keeping only its input, in FP8 (1 x 128 tiles with fp32 scales); backward dequantises it,
    remakes the output (for the next linear's weight gradient) and takes the gradient: the shared experts'
    activation under DeepSeek-V3's caching (report 3.3.3, "the SwiGLU operator in MoE")."""

    @staticmethod
    def forward(ctx, h):
        q, s, _, _ = fp8_block_cast(h.reshape(-1, h.shape[-1]), False, False)
        ctx.shape, ctx.dtype = h.shape, h.dtype
        ctx.save_for_backward(q, s)
        return swiglu(h)

    @staticmethod
    def backward(ctx, grad):
        q, s = ctx.saved_tensors
        h = fp8_block_dequant(q, s, ctx.shape[-1]).to(ctx.dtype).reshape(ctx.shape)
        swiglu(h)  # the output again, for FC2's weight gradient
        return swiglu_backward(grad, h)


# -- FP8 dispatch (DeepEP): the rows an exchange moves in FP8, and what the receiver hands on ---------------

def _payload_width(h: int) -> int:
    return h + 4 * -(-h // 128)  # FP8 row and one fp32 scale per 1 x 128 tile


@torch.library.custom_op("echo_plan::fp8_payload", mutates_args=())
def fp8_payload(x: Tensor) -> Tensor:
    """The bytes an FP8 dispatch sends for the rows of ``x``: each row in FP8 with its tile scales (the cast ran
    before, once per token); no kernel of its own."""
    return x.new_zeros((x.shape[0], _payload_width(x.shape[-1])), dtype=torch.uint8)


fp8_payload.register_fake(lambda x: x.new_empty((x.shape[0], _payload_width(x.shape[-1])), dtype=torch.uint8))


@torch.library.custom_op("echo_plan::fp8_arrived", mutates_args=())
def fp8_arrived(payload: Tensor, width: int) -> Tensor:
    """The rows an FP8 dispatch brought, as the bf16 tensor the layer's code follows (the experts read the FP8
    rows themselves); no kernel of its own."""
    return payload.new_zeros((payload.shape[0], width), dtype=torch.bfloat16)


fp8_arrived.register_fake(lambda payload, width: payload.new_empty((payload.shape[0], width), dtype=torch.bfloat16))


# -- DeepEP: permutation inside the exchange kernels --------------------------------------------------
# DeepEP's dispatch reads each token once from the token buffer and writes it to every rank its experts
# are on, and its combine sums a token's returning copies into the token buffer: no permute kernel before
# the dispatch and no un-permute kernel after the combine (DeepEP README: dispatch(x, topk_idx, ...) takes
# [num_tokens, hidden]; combine returns [num_tokens, hidden]). These ops stand for the rows the exchange
# reads and writes: views, no kernel of their own (their work is the exchange's).

@torch.library.custom_op("echo_plan::deepep_token_rows", mutates_args=())
def deepep_token_rows(tokens: Tensor, copies: int) -> Tensor:
    """The ``copies`` rows of each token that DeepEP's dispatch sends, read in place from ``tokens``."""
    return tokens.repeat_interleave(copies, dim=0)


deepep_token_rows.register_fake(lambda tokens, copies: tokens.new_empty((tokens.shape[0] * copies, tokens.shape[1])))


@torch.library.custom_op("echo_plan::deepep_token_rows_backward", mutates_args=())
def deepep_token_rows_backward(grad: Tensor, copies: int) -> Tensor:
    """A token's gradient: its copies' gradients, summed inside DeepEP's backward combine."""
    return grad.reshape(-1, copies, grad.shape[1]).sum(1)


deepep_token_rows_backward.register_fake(
    lambda grad, copies: grad.new_empty((grad.shape[0] // copies, grad.shape[1])))
deepep_token_rows.register_autograd(
    lambda ctx, grad: (deepep_token_rows_backward(grad, ctx.copies), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "copies", inputs[1]))


@torch.library.custom_op("echo_plan::deepep_combined", mutates_args=())
def deepep_combined(rows: Tensor, copies: int) -> Tensor:
    """Each token's returning copies summed into it by DeepEP's combine (weighted in the experts already)."""
    return rows.reshape(-1, copies, rows.shape[1]).sum(1)


deepep_combined.register_fake(lambda rows, copies: rows.new_empty((rows.shape[0] // copies, rows.shape[1])))


@torch.library.custom_op("echo_plan::deepep_combined_backward", mutates_args=())
def deepep_combined_backward(grad: Tensor, copies: int) -> Tensor:
    """Each copy's gradient is its token's, written by DeepEP's backward dispatch."""
    return grad.repeat_interleave(copies, dim=0)


deepep_combined_backward.register_fake(
    lambda grad, copies: grad.new_empty((grad.shape[0] * copies, grad.shape[1])))
deepep_combined.register_autograd(
    lambda ctx, grad: (deepep_combined_backward(grad, ctx.copies), None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "copies", inputs[1]))
