"""Self-attention, sharded as Megatron-LM shards it, with the attention core the stack runs.

QKV is one column-parallel linear (Megatron's grouped layout: per KV group its query heads, then
its key and value head), or three where the stack keeps them apart (``fused_projections`` off:
torchtitan's wq, wk, wv on one gathered input), rotary embedding on q and k, the core, and the row-parallel output
projection, whose bias is returned to the caller to be fused with dropout and the residual add.

The core (tensors [s, b, heads, d], Megatron's layout):
* ``fused``: one flash-attention kernel forward and one backward (``kernels.attention``); with
  attention dropout the kernel draws its mask from a seed, so nothing s x s is stored;
  With context parallelism (a CP group) the fused core is ``context_parallel.py``'s ring (or
  all-gather) attention over the rank's two sequence chunks;
* ``unfused``: Megatron-LM's ``CoreAttention`` before FlashAttention: ``baddbmm`` of Q and K^T into
  a preallocated buffer, the fused causal scale-mask-softmax kernel, dropout on the probabilities
  (a 1-byte mask), ``bmm`` with V, and the permute back to [s, b, heads * d] (a copy). Its saved
  tensors are what Korthikanti et al. 2022 count: 2 + 1 + 2 bytes per score element.

What the fused core saves is what Transformer Engine's ``DotProductAttention`` is handed
(``fused_inputs``): TE's ``get_qkv_layout`` accepts q, k, v as three views of one packed buffer at
the same strides (Megatron's multi-head QKV without rotary or QK norm) and runs on them; any other
mix (rotary's fresh q and k beside a V that is still a view into the QKV GEMM's output) matches no
layout it supports, so it copies each to a contiguous tensor. The kernel then saves a V of its own
and the QKV output is freed after the forward instead of being held by V's view (at Llama-3 70B's
8 query heads per KV head, the packed output is 10 times V).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from echo_plan.errors import SpecError
from echo_plan.specs import AttentionKernel, ModelSpec, Norm, PositionEmbedding, SoftwareSpec
from echo_plan.trace import kernels, linears
from echo_plan.trace.context_parallel import context_parallel_attention
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.layers import Rotary, make_norm


def fused_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v as Transformer Engine's fused attention takes them (module docstring): views of one
    packed buffer at equal strides pass unchanged; otherwise each is made contiguous (a copy kernel
    for each that is a view, nothing for a fresh tensor)."""
    base = q._base
    if base is not None and k._base is base and v._base is base and q.stride() == k.stride() == v.stride():
        return q, k, v
    return tuple(t.contiguous() for t in (q, k, v))


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec, checkpoint_core, accumulate_unfused: bool, overlap: bool, window: int = 0,
                 cp_group: TPGroup | None = None) -> None:
        super().__init__()
        self.window = window
        # context parallelism (``context_parallel.py``)
        self.cp_group, self.cp_comm, self.cp_runtime = cp_group, stack.cp_comm, stack.cp_runtime
        cp = cp_group.size if cp_group is not None else 1
        if cp > 1 and (window or stack.attention is not AttentionKernel.FUSED):
            raise SpecError("cp", cp, f"context parallelism needs full causal attention with the fused kernel "
                            f"(stack {stack.name}: {stack.attention.value} attention{', windowed' if window else ''})")
        if window and stack.attention is not AttentionKernel.FUSED:
            raise SpecError("attention", stack.attention.value, f"sliding-window layers of {model.name} need the "
                            f"fused attention kernel (stack {stack.name} runs unfused attention)")
        self.q_norm = make_norm(Norm.RMSNORM, model.head_dim, dtype, stack.block_norm_fused) if model.qk_norm else None
        self.k_norm = make_norm(Norm.RMSNORM, model.head_dim, dtype, stack.block_norm_fused) if model.qk_norm else None
        tp = group.size if group else 1
        self.group, self.sp, self.overlap, self.accumulate_unfused = group, sequence_parallel, overlap, accumulate_unfused
        self.heads, self.kv_heads, self.head_dim = (
            model.num_attention_heads // tp, model.kv_heads // tp, model.head_dim)
        # torchtitan's wq, wk, wv: a GEMM each on one gathered input (``fused_projections`` off)
        self.split = not stack.fused_projections
        widths = ((self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
                  if self.split else ((self.heads + 2 * self.kv_heads) * self.head_dim,))
        self.qkv_weights = nn.ParameterList(nn.Parameter(torch.empty(n, model.hidden_size, dtype=dtype)) for n in widths)
        self.qkv_biases = (nn.ParameterList(nn.Parameter(torch.empty(n, dtype=dtype)) for n in widths)
                           if model.has_bias else None)
        self.proj_weight = nn.Parameter(torch.empty(model.hidden_size, self.heads * self.head_dim, dtype=dtype))
        self.proj_bias = nn.Parameter(torch.empty(model.hidden_size, dtype=dtype)) if model.has_bias else None
        self.rotary = (Rotary(model.seq_length // cp, model.rotary_dims, dtype, fused=stack.fused_elementwise,
                              scale_per_call=stack.rope_scale_per_call(model.rope_attention_factor))
                       if model.position_embedding is PositionEmbedding.ROTARY else None)
        self.fused = stack.attention is AttentionKernel.FUSED
        self.dropout_p = stack.attention_dropout
        self.checkpoint_core = checkpoint_core  # None, or a function that checkpoints a callable
        self.fp8 = None  # an fp8.Fp8State when the linears run FP8 GEMMs (set by the block)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention on [s, b, heads, d] tensors; returns [s, b, heads * d]."""
        return self._fused(q, k, v) if self.fused else self._unfused(q, k, v)

    def _fused(self, q, k, v):
        s, b = q.shape[0], q.shape[1]
        q, k, v = fused_inputs(q, k, v)
        if self.cp_group is not None:
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm, self.dropout_p, self.cp_runtime)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d] views of the sbhd layout
        ctx = kernels.attention(q, k, v, causal=True, dropout_p=self.dropout_p, window=self.window)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * ctx.shape[-1])

    def _unfused(self, q, k, v):
        s, b, heads, d = q.shape
        if self.kv_heads != heads:  # Megatron-LM repeats the KV heads for grouped-query attention
            k = k.repeat_interleave(heads // self.kv_heads, dim=2)
            v = v.repeat_interleave(heads // self.kv_heads, dim=2)
        q2 = q.reshape(s, b * heads, d).transpose(0, 1)  # [b*heads, s, d]
        k2 = k.reshape(s, b * heads, d).transpose(0, 1).transpose(1, 2)  # [b*heads, d, s]
        buffer = q.new_empty((b * heads, s, s))
        scores = torch.baddbmm(buffer, q2, k2, beta=0.0, alpha=1.0 / math.sqrt(d))
        probs = kernels.scaled_masked_softmax(scores.view(b, heads, s, s), 1.0)
        if self.dropout_p > 0:
            probs = kernels.dropout(probs, self.dropout_p)
        v2 = v.reshape(s, b * heads, d).transpose(0, 1)  # [b*heads, s, d]
        ctx = torch.bmm(probs.view(b * heads, s, s), v2)
        return ctx.view(b, heads, s, d).permute(2, 0, 1, 3).contiguous().view(s, b, heads * d)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [s, b, heads, d], k and v [s, b, kv heads, d]: views of one GEMM's output in Megatron's grouped
        layout, or the outputs of three GEMMs."""
        biases = tuple(self.qkv_biases) if self.qkv_biases is not None else (None,) * len(self.qkv_weights)
        if self.split:
            outs = linears.column_parallel_linears(x, tuple(self.qkv_weights), biases, self.group, self.sp,
                                                   self.accumulate_unfused, self.overlap, self.fp8)
            s, b = outs[0].shape[0], outs[0].shape[1]
            return tuple(o.view(s, b, -1, self.head_dim) for o in outs)
        qkv = linears.column_parallel_linear(x, self.qkv_weights[0], biases[0], self.group, self.sp,
                                              self.accumulate_unfused, self.overlap, self.fp8)
        s, b = qkv.shape[0], qkv.shape[1]
        group_width = (self.heads // self.kv_heads + 2) * self.head_dim  # Megatron's grouped QKV layout
        qkv = qkv.view(s, b, self.kv_heads, group_width)
        q, k, v = torch.split(qkv, [group_width - 2 * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        return q.reshape(s, b, self.heads, self.head_dim), k, v

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = self._qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        ctx = self.checkpoint_core(self.core, q, k, v) if self.checkpoint_core else self.core(q, k, v)
        if self.fp8 is not None and not self.fp8.delayed:  # the fused core saved this output already
            self.fp8.keep_original(ctx, counted_elsewhere=self.fused and not self.checkpoint_core)
        out = linears.row_parallel_linear(ctx, self.proj_weight, self.group, self.sp, self.accumulate_unfused,
                                           self.overlap, self.fp8)
        return out, self.proj_bias
