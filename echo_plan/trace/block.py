"""One transformer layer, sharded as Megatron-LM shards it, running the kernels the stack runs.

Pre-norm residual layer: norm -> attention (``attention.py``) -> bias-dropout-add -> norm -> MLP
(FC1 column-parallel, activation, FC2 row-parallel) -> bias-dropout-add. Hidden states are
[seq, batch, hidden]; with sequence parallelism [seq/tp, batch, hidden] outside the column/row-
parallel regions. What the SoftwareSpec changes, all as module code:

* ``fused_elementwise``: bias + GeLU, SwiGLU and bias + dropout + residual add as one kernel each
  (``kernels.py``), else as the separate PyTorch ops;
* ``hidden_dropout``: dropout before each residual add (its 1-byte mask is saved);
* ``gradient_accumulation_fusion`` off: every weight gradient is added into an fp32 ``main_grad``;
* ``tp_comm_overlap`` (with sequence parallelism): the pipelined TP linears of ``overlap.py``;
* ``fp8`` (an ``fp8.Fp8State``, plan dtype fp8): the linears' GEMMs in FP8 with Transformer
  Engine's casts (``fp8.py``), bf16 everywhere else;
* recomputation (Korthikanti et al. 2022): ``full`` checkpoints the whole layer; ``selective``
  checkpoints the stack's ``recompute_modules``: the attention core, the MLP, and/or the two
  norms (Megatron-Core's ``layernorm`` module keeps no norm output: it is discarded after the
  next linear has used it and recomputed in backward).

Checkpointed code runs again inside ``recompute_context`` during backward, so a caller can tell
recomputation apart. ``discard`` drops a tensor from the saved-activation count.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from echo_plan.specs import Activation, ModelSpec, Recompute, RecomputeModule, SoftwareSpec
from echo_plan.specs.software import CheckpointUnit, RecomputePolicy
from echo_plan.trace.op_checkpoint import op_checkpointed
from echo_plan.trace import kernels, linears, moe_kernels
from echo_plan.trace.attention import Attention
from echo_plan.specs.moe import DENSE, ExpertLayout, LayerKind
from echo_plan.trace.fake_pg import TPGroup, TraceGroups
from echo_plan.trace.layers import clamped_swiglu, make_norm
from echo_plan.trace.mla import MLAttention
from echo_plan.trace.moe import MoELayer

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


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     fused: bool) -> torch.Tensor:
    """residual + dropout(x + bias): Megatron-LM's bias_dropout_add, fused or as separate ops."""
    if fused and (bias is not None or p > 0):
        return kernels.bias_dropout_add(x, bias, residual, float(p), 0)[0]
    if bias is not None:
        x = x + bias
    if p > 0:
        x = kernels.dropout(x, p)
    return residual + x


class MLP(nn.Module):
    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec, accumulate_unfused: bool, overlap: bool, ffn: int | None = None,
                 cache_act: Callable[[torch.Tensor], None] | None = None) -> None:
        """``cache_act``: the activation keeps only its input, in FP8, and its output is freed after FC2 (the
        callable drops it from the saved count) and remade in backward: DeepSeek-V3's shared experts."""
        super().__init__()
        self.cache_act = cache_act
        tp = group.size if group else 1
        self.group, self.sp, self.overlap, self.accumulate_unfused = group, sequence_parallel, overlap, accumulate_unfused
        self.activation = model.activation
        self.fused = stack.fused_elementwise
        ffn = (model.ffn_size if ffn is None else ffn) // tp
        # a gated unit's gate and up projections in one GEMM, or a GEMM each (torchtitan's w1 and w3)
        self.split = model.activation is Activation.SWIGLU and cache_act is None and not stack.fused_projections
        widths = (ffn, ffn) if self.split else ((2 * ffn if model.activation.gated else ffn),)
        self.fc1_weights = nn.ParameterList(nn.Parameter(torch.empty(n, model.hidden_size, dtype=dtype)) for n in widths)
        self.fc1_biases = (nn.ParameterList(nn.Parameter(torch.empty(n, dtype=dtype)) for n in widths)
                           if model.has_bias else None)
        self.fc2_weight = nn.Parameter(torch.empty(model.hidden_size, ffn, dtype=dtype))
        self.fc2_bias = nn.Parameter(torch.empty(model.hidden_size, dtype=dtype)) if model.has_bias else None
        self.fp8 = None  # an fp8.Fp8State when the linears run FP8 GEMMs (set by the block)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """The activation on FC1's output, with FC1's bias (Megatron-LM skips FC1's bias add and
        fuses it with the activation)."""
        b = self.fc1_biases[0] if self.fc1_biases is not None else None
        if self.activation is Activation.GELU:
            if b is not None and self.fused:
                return kernels.bias_gelu(h, b)
            return F.gelu(h + b if b is not None else h, approximate="tanh")
        if b is not None:
            h = h + b
        if self.activation is Activation.SWIGLU_CLAMPED:
            return clamped_swiglu(h)
        if self.activation is Activation.SWIGLU:
            if self.fused:
                return kernels.swiglu(h)
            gate, up = torch.chunk(h, 2, dim=-1)
            return F.silu(gate) * up
        return torch.pow(F.relu(h), 2)  # squared ReLU, as Megatron-Core writes it (no fused kernel)

    def gated_pair(self, x: torch.Tensor) -> torch.Tensor:
        """The gated unit on separate gate and up GEMMs (``fused_projections`` off): their biases added, then one
        fused kernel on the pair, or the separate ops."""
        biases = tuple(self.fc1_biases) if self.fc1_biases is not None else (None, None)
        gate, up = linears.column_parallel_linears(x, tuple(self.fc1_weights), biases, self.group, self.sp,
                                                   self.accumulate_unfused, self.overlap, self.fp8)
        return kernels.swiglu_pair(gate, up) if self.fused else F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.split:
            h = self.gated_pair(x)
            return self._fc2(h), self.fc2_bias
        h = linears.column_parallel_linear(x, self.fc1_weights[0], None, self.group, self.sp,
                                            self.accumulate_unfused, self.overlap, self.fp8)
        if self.cache_act is None:
            h = self.act(h)
        else:
            h = moe_kernels.CachedSwiGLU.apply(h)
            if self.fp8 is not None:
                self.fp8.keep_original(h)  # FC2 keeps the (freed) output, not an FP8 copy
        out = self._fc2(h)
        if self.cache_act is not None:
            self.cache_act(h)
        return out, self.fc2_bias

    def _fc2(self, h: torch.Tensor) -> torch.Tensor:
        return linears.row_parallel_linear(h, self.fc2_weight, self.group, self.sp, self.accumulate_unfused,
                                           self.overlap, self.fp8)


class TransformerBlock(nn.Module):
    """One layer of ``kind``: dense or MoE MLP (``moe.py``), full, windowed or latent attention
    (``mla.py``); ``groups`` holds the TP and expert groups, ``layout`` the expert layout."""

    def __init__(self, model: ModelSpec, group: TPGroup | None, sequence_parallel: bool,
                 dtype: torch.dtype, recompute: Recompute, stack: SoftwareSpec,
                 recompute_context: RecomputeContext = nullcontext,
                 discard: Callable[[torch.Tensor], None] | None = None, kind: LayerKind = DENSE,
                 groups: TraceGroups | None = None, layout: ExpertLayout | None = None, fp8=None,
                 keep: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        by_ops = recompute is Recompute.SELECTIVE and stack.recompute_policy is RecomputePolicy.OPS
        selective = set(stack.recompute_modules) if recompute is Recompute.SELECTIVE and not by_ops else set()
        self.op_policy = keep if by_ops else None  # torchtitan's per-op policy (op_checkpoint.py)
        overlap = bool(stack.tp_comm_overlap and sequence_parallel and group is not None)
        unfused_acc = not stack.gradient_accumulation_fusion
        self.recompute_context = recompute_context

        def ckpt(fn, *args):
            return checkpointed(fn, *args, recompute_context=recompute_context)

        self.input_norm = make_norm(model.norm, model.hidden_size, dtype, stack.block_norm_fused)
        if model.mla is not None:
            self.attention: nn.Module = MLAttention(model, group, sequence_parallel, dtype, stack, ckpt, selective,
                                                    discard, unfused_acc)
        else:
            self.attention = Attention(model, group, sequence_parallel, dtype, stack,
                                       ckpt if RecomputeModule.CORE_ATTN in selective else None, unfused_acc, overlap,
                                       window=kind.window, cp_group=groups.cp if groups is not None else None)
        self.mlp_norm = make_norm(model.norm, model.hidden_size, dtype, stack.block_norm_fused)
        if kind.moe and model.moe is not None:
            cache = (discard if stack.moe_act_input_fp8 and RecomputeModule.MOE_ACT in selective
                     and model.activation is Activation.SWIGLU and not model.has_bias and stack.fused_elementwise
                     else None)  # the SwiGLU inputs of the whole MoE cached in FP8, the shared experts' too
            shared = (MLP(model, group, sequence_parallel, dtype, stack, unfused_acc, overlap, model.moe.shared_ffn,
                          cache_act=cache)
                      if model.moe.num_shared_experts else None)
            self.mlp: nn.Module = MoELayer(
                model, groups or TraceGroups(group), sequence_parallel, dtype, stack, layout or ExpertLayout(), shared,
                ckpt if RecomputeModule.MOE_ACT in selective else None, discard)
        else:
            self.mlp = MLP(model, group, sequence_parallel, dtype, stack, unfused_acc, overlap)
        self.hidden_dropout = stack.hidden_dropout
        self.fused_bda = stack.bias_dropout_add_fused
        # Megatron-Core's 'mlp' recompute module checkpoints dense MLPs only, never an MoE layer
        # (transformer_layer.py: `if not isinstance(self.mlp, MoELayer)`, core_v0.12 onwards; 'moe' is another module)
        self.recompute_mlp = RecomputeModule.MLP in selective and not isinstance(self.mlp, MoELayer)
        self.recompute_norms = RecomputeModule.LAYERNORM in selective and discard is not None
        self.discard = discard
        # recompute full as NeMo AutoModel applies it to a dense layer (stack full_recompute_unit submodules:
        # distributed/parallelizer.py wraps self_attn and mlp in checkpoint_wrapper): the two checkpoints keep their
        # inputs, the norms run outside them; an MoE layer stays one block
        self.per_submodule = (recompute is Recompute.FULL and stack.full_recompute_unit is CheckpointUnit.SUBMODULES
                              and not isinstance(self.mlp, MoELayer))
        self.recompute_mlp = self.recompute_mlp or self.per_submodule
        self.full_recompute = recompute is Recompute.FULL and not self.per_submodule
        self._ckpt = ckpt
        self.fp8 = fp8
        for module in self.modules():  # FP8 GEMMs in every linear of the layer that has them (not the router)
            if hasattr(module, "fp8"):
                module.fp8 = fp8

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not self.recompute_norms:
            return norm(x)
        out = self._ckpt(norm, x)
        if self.fp8 is not None:  # the next linears save this output itself (freed below), not FP8 copies
            self.fp8.keep_original(out)  # (Megatron-Core transformer_layer.py: set_for_recompute_*_layernorm)
        return out

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        normed = self._norm(self.input_norm, x)
        out, bias = self._ckpt(self.attention, normed) if self.per_submodule else self.attention(normed)
        if self.recompute_norms:
            self.discard(normed)
        x = bias_dropout_add(out, bias, x, self.hidden_dropout, self.fused_bda)
        normed = self._norm(self.mlp_norm, x)
        out, bias = self._ckpt(self.mlp, normed) if self.recompute_mlp else self.mlp(normed)
        if self.recompute_norms:
            self.discard(normed)
        return bias_dropout_add(out, bias, x, self.hidden_dropout, self.fused_bda)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.full_recompute:
            return checkpointed(self.layer, x, recompute_context=self.recompute_context)
        if self.op_policy is not None:
            return op_checkpointed(self.layer, x, recompute_context=self.recompute_context, keep=self.op_policy)
        return self.layer(x)
