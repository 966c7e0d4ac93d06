"""The fused GPU kernels Megatron-LM / Transformer Engine run, as torch custom ops.

On the CPU, torch would run these computations as several small ops (or, for attention with
dropout, as the unfused math path), which is not what a GPU executes. Each op here is one kernel,
as in the frameworks: the tracer records it as one op with its real input and output shapes,
and autograd saves what the fused kernel saves (a flash-attention kernel keeps the log-sum-exp
and an RNG seed, never an s x s matrix; bias-dropout-add keeps a 1-byte mask).

Every op has a CPU reference implementation (used outside FakeTensorMode, e.g. by the tests that
check the backward against autograd) and a fake implementation giving the output shapes. FLOPs
of the attention ops use torch's own SDPA flop formulas; the others are memory-bound.

Kernels and their sources (the code is ours):
* ``flash_attention`` / ``flash_attention_dropout``: FlashAttention-2 (Dao 2023) / cuDNN fused
  attention, forward and backward, causal; dropout regenerates its mask from a seed in backward.
* ``scaled_masked_softmax``: Megatron-LM's ``ScaledUpperTriangMaskedSoftmax`` (causal mask, scale,
  softmax in one kernel; saves the probabilities).
* ``bias_gelu``, ``swiglu``, ``bias_dropout_add``, ``dropout``: Megatron-LM's fused elementwise kernels
  (``fused_elementwise.py``).
* ``ring_exchange``: one step of Transformer Engine's userbuffers ring exchange (send the chunk in
  hand to the next TP rank, receive the previous rank's): a point-to-point collective.
* ``assemble``: chunks written by several kernels into one buffer (no kernel of its own).
* ``cp_exchange``: one step of context-parallel ring attention (send to the next CP rank, receive
  from the previous one), and ``attn_out_correction``: Transformer Engine's fused merge of a ring
  step's partial output by log-sum-exp. The ``*_noncausal`` attention kernels are the unmasked
  launches of a ring step whose keys all precede its queries.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

Tensor = torch.Tensor

# Megatron-LM's fused elementwise kernels (bias_gelu, swiglu, bias_dropout_add, dropout) live in
# fused_elementwise.py; importing them here registers them and keeps ``kernels.swiglu`` etc. working.
from echo_plan.trace.fused_elementwise import (  # noqa: E402
    _keep_mask, bias_dropout_add, bias_gelu, clamped_geglu, clamped_geglu_backward, dropout, dropout_backward, swiglu,
    swiglu_backward, swiglu_pair, swiglu_pair_backward)

__all__ = ["assemble", "attention", "attention_backward", "attention_with_lse", "attn_out_correction", "bias_dropout_add",
           "bias_gelu", "clamped_geglu", "clamped_geglu_backward", "cp_exchange", "dropout", "dropout_backward",
           "ring_exchange", "scaled_masked_softmax", "swiglu", "swiglu_backward", "swiglu_pair",
           "swiglu_pair_backward", "window_fraction",
           "windowed_attention"]


def _expand_kv(q: Tensor, t: Tensor) -> Tensor:
    """Grouped-query attention: repeat each KV head for its query heads ([b, heads, s, d])."""
    return t if t.shape[1] == q.shape[1] else t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _attention_reference(q, k, v, causal: bool, p: float, seed: int, window: int = 0
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output, log-sum-exp, softmax probabilities, keep-mask or None) in fp32 maths; ``window`` > 0:
    each query sees only the ``window`` most recent keys (itself included)."""
    kx, vx = _expand_kv(q, k), _expand_kv(q, v)
    scores = (q.float() @ kx.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s_q, s_k = scores.shape[-2:]
    if causal:
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1 + s_k - s_q), float("-inf"))
    if window > 0:
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).tril(s_k - s_q - window), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    keep = _keep_mask(probs.shape, p, seed, probs.device) if p > 0 else None
    dropped = probs * keep / (1.0 - p) if keep is not None else probs
    return (dropped @ vx.float()).to(q.dtype), lse, probs, keep


def _like_layout(q: Tensor, last: int) -> Tensor:
    """An empty tensor shaped like ``q`` with last dim ``last``, in ``q``'s memory layout (dimension order)."""
    if last == q.shape[-1]:
        return torch.empty_like(q)
    order = sorted(range(q.dim()), key=lambda i: -q.stride(i))  # outermost first
    shape = [*q.shape[:-1], last]
    base = q.new_empty([shape[i] for i in order])
    return base.permute([order.index(i) for i in range(q.dim())])


def _attention_fake(q, k, v, causal, p, seed, window=0):
    return _like_layout(q, v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def window_fraction(s_k: int, window: int) -> float:
    """Keys a sliding-window query sees on average, over the s_k / 2 a causal query sees: the FLOP
    counts of windowed kernels are scaled by it (the compute model then applies the causal share)."""
    if window <= 0 or window >= s_k:
        return 1.0
    seen = (s_k * window - window * (window - 1) / 2) / s_k
    return min(1.0, seen / ((s_k + 1) / 2))


def windowed_attention(op) -> bool:
    """Whether a traced fused-attention op (forward or backward) ran over a sliding window.

    The window is an argument the record does not keep; it shows in the FLOPs, which the formulas
    above scale by :func:`window_fraction`: a windowed op records fewer FLOPs than its shapes give
    for attention over every (causal) key. Used where an op is identified by its shapes alone (a
    measured kernel database), so that a windowed launch is never taken for the full one."""
    shapes = [tuple(int(d) for d in m.shape) for m in op.inputs if len(m.shape) == 4]
    if "backward" in op.name:
        if len(shapes) < 4:
            return False
        g, q, k, v = shapes[:4]
        b, h, _, d = q
        full = sdpa_backward_flop_count(g, q, (b, h, k[2], d), (b, h, v[2], v[3]))
    else:
        if len(shapes) < 3:
            return False
        q, k, v = shapes[:3]
        b, h, _, d = q
        full = sdpa_flop_count(q, (b, h, k[2], d), (b, h, v[2], v[3]))
    return op.flops < full


def _fold_heads(g: Tensor, like: Tensor) -> Tensor:
    """Sum the gradients of repeated KV heads back onto the KV heads of ``like``."""
    rep = g.shape[1] // like.shape[1]
    return g if rep == 1 else g.reshape(g.shape[0], like.shape[1], rep, *g.shape[2:]).sum(2)


def _attention_backward_reference(grad, q, k, v, out, lse, causal: bool, p: float, seed: int, window: int = 0):
    _, _, probs, keep = _attention_reference(q, k, v, causal, p, seed, window)
    kx, vx, g = _expand_kv(q, k).float(), _expand_kv(q, v).float(), grad.float()
    scale = 1.0 / math.sqrt(q.shape[-1])
    dropped = probs * keep / (1.0 - p) if keep is not None else probs
    dv = dropped.transpose(-1, -2) @ g
    d_dropped = g @ vx.transpose(-1, -2)
    d_probs = d_dropped * keep / (1.0 - p) if keep is not None else d_dropped
    d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
    dq = d_scores @ kx
    dk = d_scores.transpose(-1, -2) @ q.float()
    return dq.to(q.dtype), _fold_heads(dk, k).to(k.dtype), _fold_heads(dv, v).to(v.dtype)


def _attention_backward_fake(grad, q, k, v, out, lse, causal, p, seed, window=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_ops(name: str):
    """A fused-attention forward op and its backward op, with fake, autograd and FLOP formulas."""

    @torch.library.custom_op(f"echo_plan::{name}", mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, dropout_p: float, seed: int,
            window: int = 0) -> tuple[Tensor, Tensor]:
        out, lse, _, _ = _attention_reference(q, k, v, causal, dropout_p, seed, window)
        # in q's memory layout, as the fake (and the fused kernels) return it: what reads it next (the output
        # projection's reshape) is then a view here too, not a copy the kernels never make
        return _like_layout(q, out.shape[-1]).copy_(out), lse

    @torch.library.custom_op(f"echo_plan::{name}_backward", mutates_args=())
    def bwd(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, dropout_p: float,
            seed: int, window: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        return _attention_backward_reference(grad, q, k, v, out, lse, causal, dropout_p, seed, window)

    fwd.register_fake(_attention_fake)
    bwd.register_fake(_attention_backward_fake)

    def setup(ctx, inputs, output):
        q, k, v, causal, p, seed, window = inputs
        ctx.save_for_backward(q, k, v, *output)
        ctx.causal, ctx.p, ctx.seed, ctx.window = causal, p, seed, window
        ctx.set_materialize_grads(False)

    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(grad_out, q, k, v, out, lse, ctx.causal, ctx.p, ctx.seed, ctx.window)
        return dq, dk, dv, None, None, None, None

    fwd.register_autograd(backward, setup_context=setup)

    @register_flop_formula(getattr(torch.ops.echo_plan, name))
    def _fwd_flops(q_shape, k_shape, v_shape, *args, **kwargs) -> int:  # args: causal, p, seed, window
        window = int(args[3]) if len(args) > 3 else 0
        b, h, _, d = q_shape
        full = sdpa_flop_count(q_shape, (b, h, k_shape[2], d), (b, h, v_shape[2], v_shape[3]))
        return int(full * window_fraction(k_shape[2], window))

    @register_flop_formula(getattr(torch.ops.echo_plan, f"{name}_backward"))
    def _bwd_flops(grad_shape, q_shape, k_shape, v_shape, *args, **kwargs) -> int:  # out, lse, causal, p, seed, window
        window = int(args[5]) if len(args) > 5 else 0
        b, h, _, d = q_shape
        full = sdpa_backward_flop_count(grad_shape, q_shape, (b, h, k_shape[2], d), (b, h, v_shape[2], v_shape[3]))
        return int(full * window_fraction(k_shape[2], window))

    return fwd, bwd


flash_attention, flash_attention_backward = _attention_ops("flash_attention")
flash_attention_dropout, flash_attention_dropout_backward = _attention_ops("flash_attention_dropout")
# The same kernels launched without the causal mask: a context-parallel ring step whose keys all
# precede its queries (``trace/context_parallel.py``). Their names tell the compute model to count
# all of the counted work, not the causal share.
flash_attention_noncausal, flash_attention_noncausal_backward = _attention_ops("flash_attention_noncausal")
flash_attention_dropout_noncausal, flash_attention_dropout_noncausal_backward = _attention_ops(
    "flash_attention_dropout_noncausal")


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0, window: int = 0) -> Tensor:
    """Fused attention on [b, heads, s, d] tensors (k, v may have fewer heads: GQA; v may be narrower:
    MLA); ``window`` > 0: sliding-window attention over that many recent keys."""
    return attention_with_lse(q, k, v, causal, dropout_p, window)[0]


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, dropout_p: float = 0.0,
                       window: int = 0) -> tuple[Tensor, Tensor]:
    """:func:`attention` and its fp32 log-sum-exp ([b, heads, s_q]); ``causal`` False runs the
    unmasked kernel (every key visible)."""
    if causal:
        op = flash_attention_dropout if dropout_p > 0 else flash_attention
    else:
        op = flash_attention_dropout_noncausal if dropout_p > 0 else flash_attention_noncausal
    return op(q, k, v, causal, float(dropout_p), 0, int(window))


def attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       dropout_p: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The fused backward kernel of :func:`attention_with_lse` (dq, dk, dv), called directly by code
    that runs its own autograd (context-parallel ring attention)."""
    if causal:
        op = flash_attention_dropout_backward if dropout_p > 0 else flash_attention_backward
    else:
        op = flash_attention_dropout_noncausal_backward if dropout_p > 0 else flash_attention_noncausal_backward
    return op(grad, q, k, v, out, lse, causal, float(dropout_p), 0, 0)


@torch.library.custom_op("echo_plan::attn_out_correction", mutates_args=())
def attn_out_correction(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a partial attention result into the running one by their log-sum-exps (Transformer
    Engine's ``flash_attn_fwd_out_correction`` in context-parallel attention: one fused kernel)."""
    new = torch.logaddexp(lse, part_lse)
    merged = out.float() * torch.exp(lse - new).unsqueeze(-1) + part.float() * torch.exp(part_lse - new).unsqueeze(-1)
    return merged.to(out.dtype), new


attn_out_correction.register_fake(lambda out, lse, part, part_lse: (torch.empty_like(out), torch.empty_like(lse)))


# -- Megatron-LM's fused causal softmax (unfused attention) --------------------------------------

@torch.library.custom_op("echo_plan::scaled_masked_softmax", mutates_args=())
def scaled_masked_softmax(scores: Tensor, scale: float) -> Tensor:
    s_q, s_k = scores.shape[-2:]
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(1 + s_k - s_q)
    return torch.softmax((scores.float() * scale).masked_fill(mask, float("-inf")), dim=-1).to(scores.dtype)


@torch.library.custom_op("echo_plan::scaled_masked_softmax_backward", mutates_args=())
def scaled_masked_softmax_backward(grad: Tensor, probs: Tensor, scale: float) -> Tensor:
    g, p = grad.float(), probs.float()
    return (scale * p * (g - (g * p).sum(-1, keepdim=True))).to(grad.dtype)


scaled_masked_softmax.register_fake(lambda scores, scale: torch.empty_like(scores))
scaled_masked_softmax_backward.register_fake(lambda grad, probs, scale: torch.empty_like(grad))


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _softmax_backward(ctx, grad):
    (probs,) = ctx.saved_tensors
    return scaled_masked_softmax_backward(grad, probs, ctx.scale), None


scaled_masked_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# -- communication and buffers --------------------------------------------------------------------

@torch.library.custom_op("echo_plan::ring_exchange", mutates_args=())
def ring_exchange(x: Tensor, group_size: int) -> Tensor:
    """Send ``x`` to the next rank of the TP ring, return what the previous rank sent (here: a
    copy, as on a ring of identical ranks)."""
    return x.clone()


ring_exchange.register_fake(lambda x, group_size: torch.empty_like(x))


@torch.library.custom_op("echo_plan::cp_exchange", mutates_args=())
def cp_exchange(x: Tensor, group_name: str) -> Tensor:
    """One step of context-parallel ring attention: send ``x`` (a K/V chunk, or the dK/dV being
    accumulated) to the next rank of the CP group named ``group_name`` and receive the previous
    rank's (Megatron-Core / Transformer Engine's batched isend/irecv pair). Here: a copy, as on a
    ring of identical ranks."""
    return x.clone()


cp_exchange.register_fake(lambda x, group_name: torch.empty_like(x))


@torch.library.custom_op("echo_plan::assemble", mutates_args=())
def assemble(chunks: list[Tensor]) -> Tensor:
    """Chunks that several kernels wrote into one buffer, as that buffer (dimension 0)."""
    return torch.cat(chunks, dim=0)


assemble.register_fake(lambda chunks: chunks[0].new_empty((sum(c.shape[0] for c in chunks), *chunks[0].shape[1:])))


# -- rotary embedding (Transformer Engine's fused RoPE) -------------------------------------------

def _rotate(t: Tensor, cos: Tensor, sin: Tensor, sign: float) -> Tensor:
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    half = rot // 2
    turned = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    return torch.cat((head * cos + sign * turned * sin, rest), dim=-1)


@torch.library.custom_op("echo_plan::rope", mutates_args=())
def rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of the first cos.shape[-1] dims of each head (t: [s, b, heads, d])."""
    return _rotate(t, cos, sin, 1.0)


@torch.library.custom_op("echo_plan::rope_backward", mutates_args=())
def rope_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The transpose of the rotation: rotate the gradient back (the rotation matrix is orthogonal)."""
    rot = cos.shape[-1]
    half = rot // 2
    head, rest = grad[..., :rot], grad[..., rot:]
    gs = head * sin
    back = torch.cat((gs[..., half:], -gs[..., :half]), dim=-1)
    return torch.cat((head * cos + back, rest), dim=-1)


rope.register_fake(lambda t, cos, sin: torch.empty_like(t))
rope_backward.register_fake(lambda grad, cos, sin: torch.empty_like(grad))


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _rope_bwd(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rope_backward(grad, cos, sin), None, None


rope.register_autograd(_rope_bwd, setup_context=_rope_setup)
