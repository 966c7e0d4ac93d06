"""Multi-head latent attention (DeepSeek-V2/V3), sharded as Megatron-Core's MLASelfAttention.

Queries go through a rank ``q_lora_rank`` bottleneck (down-projection, RMSNorm, up-projection to
heads x (nope + rope) dims); keys and values through one joint latent of ``kv_lora_rank`` plus a
``qk_rope_head_dim`` rope key shared by every head (down-projection, RMSNorm on the latent,
up-projection to heads x (nope + v) dims). The down-projections are replicated on every TP rank
and run on the rank's sequence shard; their small outputs are all-gathered over TP (sequence
parallel), then the up-projections are column-parallel over heads with no further
communication. Rope on the rope parts, the fused core (query/key width nope + rope, value width
v), and the row-parallel output projection. With the stack's ``mla_up_proj`` recompute module the
up-projections run checkpointed and their outputs (the core's q, k, v) are not kept: they are
recomputed in backward (Megatron-Core's ``recompute_modules=mla_up_proj``); the latents' norms are
recomputed with them, as Transformer Engine's spec fuses each into its up-projection.
"""

from __future__ import annotations

import torch
from torch import nn

from echo_plan.specs import ModelSpec, Norm, SoftwareSpec
from echo_plan.specs.software import AttentionKernel, RecomputeModule
from echo_plan.errors import SpecError
from echo_plan.trace import kernels, linears, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.layers import Rotary, make_norm


class MLAttention(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec, ckpt, selective: set, discard, accumulate_unfused: bool) -> None:
        super().__init__()
        m = model.mla
        assert m is not None
        if stack.attention is not AttentionKernel.FUSED:
            raise SpecError("attention", stack.attention.value, f"multi-head latent attention of {model.name} "
                            f"needs the fused attention kernel (stack {stack.name} runs unfused attention)")
        tp = group.size if group else 1
        h, self.heads = model.hidden_size, model.num_attention_heads // tp
        self.m, self.group, self.sp, self.acc = m, group, sequence_parallel, accumulate_unfused
        if m.q_lora_rank:
            self.q_down = nn.Parameter(torch.empty(m.q_lora_rank, h, dtype=dtype))
            self.q_norm = make_norm(Norm.RMSNORM, m.q_lora_rank, dtype, stack.block_norm_fused)
            self.q_up = nn.Parameter(torch.empty(self.heads * m.qk_head_dim, m.q_lora_rank, dtype=dtype))
        else:
            self.q_down, self.q_norm = None, None
            self.q_up = nn.Parameter(torch.empty(self.heads * m.qk_head_dim, h, dtype=dtype))
        self.kv_down = nn.Parameter(torch.empty(m.kv_lora_rank + m.qk_rope_head_dim, h, dtype=dtype))
        self.kv_norm = make_norm(Norm.RMSNORM, m.kv_lora_rank, dtype, stack.block_norm_fused)
        self.kv_up = nn.Parameter(torch.empty(self.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank,
                                              dtype=dtype))
        self.proj_weight = nn.Parameter(torch.empty(h, self.heads * m.v_head_dim, dtype=dtype))
        self.rotary = Rotary(model.seq_length, m.qk_rope_head_dim, dtype, fused=stack.fused_elementwise)
        self.dropout_p = stack.attention_dropout
        self.ckpt = ckpt
        self.recompute_up = RecomputeModule.MLA_UP_PROJ in selective and discard is not None
        self.recompute_core = RecomputeModule.CORE_ATTN in selective
        self.discard = discard
        self.fp8 = None  # an fp8.Fp8State when the linears run FP8 GEMMs (set by the block)

    def _local(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A linear with no communication (replicated weights, or the head shard of an up-projection)."""
        return linears.column_parallel_linear(x, weight, None, None, False, self.acc, fp8=self.fp8)

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        return parallel.gather_from_sp(t, self.group) if self.sp else t

    def normed_up(self, q_lat: torch.Tensor, kv_lat: torch.Tensor, k_rope: torch.Tensor):
        """The latents' norms, then :meth:`up`: Transformer Engine's spec fuses each norm into its
        up-projection (``TELayerNormColumnParallelLinear``), so ``mla_up_proj`` recomputes them too."""
        if self.q_norm is not None:
            q_lat = self.q_norm(q_lat)
        return self.up(q_lat, self.kv_norm(kv_lat), k_rope)

    def up(self, q_lat: torch.Tensor, kv_lat: torch.Tensor, k_rope: torch.Tensor):
        """The up-projections and rope: q, k [s, b, heads, nope + rope] and v [s, b, heads, v]."""
        m = self.m
        s, b = kv_lat.shape[0], kv_lat.shape[1]
        q = self._local(q_lat, self.q_up).view(s, b, self.heads, m.qk_head_dim)
        q_nope, q_rope = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv = self._local(kv_lat, self.kv_up).view(s, b, self.heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = torch.split(kv, [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat([q_nope, self.rotary(q_rope.contiguous())], dim=-1)
        k_rope = self.rotary(k_rope.view(s, b, 1, m.qk_rope_head_dim)).expand(s, b, self.heads, m.qk_rope_head_dim)
        k = torch.cat([k_nope, k_rope], dim=-1)
        return q, k, v.contiguous()

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b = q.shape[0], q.shape[1]
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = kernels.attention(qb, kb, vb, causal=True, dropout_p=self.dropout_p)
        if self.fp8 is not None and self.fp8.attention_output_e5m6 and not self.recompute_core \
                and self.discard is not None:
            self.discard(ctx)  # kept for backward only as the output projection's E5M6 copy
        return ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.m.v_head_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.m
        if not self.sp:
            x = parallel.copy_to_tp(x, self.group)  # replicated input: its gradient is all-reduced over TP
        q_lat = self._gathered(self._local(x, self.q_down) if self.q_down is not None else x)
        kv = self._gathered(self._local(x, self.kv_down))
        kv_lat, k_rope = torch.split(kv, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        if self.recompute_up:
            q, k, v = self.ckpt(self.normed_up, q_lat, kv_lat.contiguous(), k_rope.contiguous())
        else:
            q, k, v = self.normed_up(q_lat, kv_lat.contiguous(), k_rope.contiguous())
        ctx = self.ckpt(self.core, q, k, v) if self.recompute_core else self.core(q, k, v)
        if self.recompute_up:
            for t in (q, k, v):
                self.discard(t)
        if self.fp8 is not None and not self.fp8.delayed:  # the fused core saved this output already
            self.fp8.keep_original(ctx, counted_elsewhere=not self.recompute_core)
            self.fp8.keep_e5m6(ctx)
        out = linears.row_parallel_linear(ctx, self.proj_weight, self.group, self.sp, self.acc, fp8=self.fp8)
        return out, None
