"""One transformer layer, sharded as Megatron-LM shards it for a tensor-parallel degree.

Pre-norm residual layer: norm -> attention (QKV column-parallel, fused causal SDPA, output
row-parallel) -> residual add -> norm -> MLP (FC1, and the SwiGLU gate fused with it, column-
parallel; FC2 row-parallel) -> residual add. Hidden states are [seq, batch, hidden]; with sequence
parallelism they are [seq/tp, batch, hidden] outside the column/row-parallel regions.

Recompute (Korthikanti et al. 2022): ``selective`` checkpoints the attention core, ``full`` the
whole layer, with ``torch.utils.checkpoint`` (non-reentrant). ``recompute_context`` is entered
while checkpointed code is re-run during backward, so a caller can tell recomputation apart.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from echo_plan.specs import Activation, ModelSpec, Norm, PositionEmbedding, Recompute
from echo_plan.trace import parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.layers import Rotary, make_norm

RecomputeContext = Callable[[], ContextManager]


def checkpointed(fn, *args, recompute_context: RecomputeContext):
    """Run ``fn(*args)`` keeping only its inputs; it runs again inside ``recompute_context()``.

    The whole region is re-run (no early stop), as Megatron-LM's checkpoint re-runs a layer's
    forward completely, its tensor-parallel collectives included.
    """
    return checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=False, early_stop=False,
        context_fn=lambda: (nullcontext(), recompute_context()),
    )


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool,
                 dtype: torch.dtype, checkpoint_core: bool, recompute_context: RecomputeContext) -> None:
        super().__init__()
        tp = group.size if group else 1
        self.group, self.sp = group, sequence_parallel
        self.heads, self.kv_heads, self.head_dim = (
            model.num_attention_heads // tp, model.kv_heads // tp, model.head_dim)
        bias = model.activation is Activation.GELU  # GPT-style layers carry biases, Llama's do not
        qkv_out = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_weight = nn.Parameter(torch.empty(qkv_out, model.hidden_size, dtype=dtype))
        self.qkv_bias = nn.Parameter(torch.empty(qkv_out, dtype=dtype)) if bias else None
        self.proj_weight = nn.Parameter(torch.empty(model.hidden_size, self.heads * self.head_dim, dtype=dtype))
        self.proj_bias = nn.Parameter(torch.empty(model.hidden_size, dtype=dtype)) if bias else None
        self.rotary = (Rotary(model.seq_length, self.head_dim, dtype)
                       if model.position_embedding is PositionEmbedding.ROTARY else None)
        self.checkpoint_core = checkpoint_core
        self.recompute_context = recompute_context

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal fused attention on [s, b, heads, d] tensors; returns [s, b, heads * d]."""
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = parallel.column_parallel_linear(x, self.qkv_weight, self.qkv_bias, self.group, self.sp)
        s, b = qkv.shape[0], qkv.shape[1]
        group_width = (self.heads // self.kv_heads + 2) * self.head_dim  # Megatron's grouped QKV layout
        qkv = qkv.view(s, b, self.kv_heads, group_width)
        q, k, v = torch.split(qkv, [group_width - 2 * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(s, b, self.heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.checkpoint_core:
            ctx = checkpointed(self.core, q, k, v, recompute_context=self.recompute_context)
        else:
            ctx = self.core(q, k, v)
        return parallel.row_parallel_linear(ctx, self.proj_weight, self.proj_bias, self.group, self.sp)


class MLP(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype) -> None:
        super().__init__()
        tp = group.size if group else 1
        self.group, self.sp = group, sequence_parallel
        self.gated = model.activation is Activation.SWIGLU
        ffn = model.ffn_size // tp
        fc1_out = 2 * ffn if self.gated else ffn  # SwiGLU's gate and up projections in one GEMM
        bias = not self.gated
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, model.hidden_size, dtype=dtype))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, dtype=dtype)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(model.hidden_size, ffn, dtype=dtype))
        self.fc2_bias = nn.Parameter(torch.empty(model.hidden_size, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = parallel.column_parallel_linear(x, self.fc1_weight, self.fc1_bias, self.group, self.sp)
        if self.gated:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # Megatron-LM's fused bias-GeLU uses the tanh form
        return parallel.row_parallel_linear(h, self.fc2_weight, self.fc2_bias, self.group, self.sp)


class TransformerBlock(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool,
                 dtype: torch.dtype, recompute: Recompute,
                 recompute_context: RecomputeContext = nullcontext) -> None:
        super().__init__()
        rms = model.norm is Norm.RMSNORM
        self.input_norm = make_norm(rms, model.hidden_size, dtype)
        self.attention = Attention(model, group, sequence_parallel, dtype,
                                   recompute is Recompute.SELECTIVE, recompute_context)
        self.mlp_norm = make_norm(rms, model.hidden_size, dtype)
        self.mlp = MLP(model, group, sequence_parallel, dtype)
        self.full_recompute = recompute is Recompute.FULL
        self.recompute_context = recompute_context

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.full_recompute:
            return checkpointed(self.layer, x, recompute_context=self.recompute_context)
        return self.layer(x)
