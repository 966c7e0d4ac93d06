"""Closed-form activation memory: the bytes a layer, the embedding and the output layer save for
backward for one micro-batch (Korthikanti et al. 2022, itemised, with the stack's kernels, dropout,
selective recomputation, MLA, MoE routing and CP's seq / cp tokens). The search prunes with these;
``memory.stage_memory`` uses the traced layers' saved bytes where it has them."""

from __future__ import annotations

from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import DENSE, LayerKind
from echo_plan.specs.plan import PlanSpec, Recompute
from echo_plan.specs.software import (AttentionKernel, CheckpointUnit, CrossEntropy, RecomputeModule, RecomputePolicy,
                                     SoftwareSpec)
from echo_plan.specs.moe import ExpertLayout
from echo_plan.specs.model import Activation, PositionEmbedding

# activations Megatron-Core fuses with the router probabilities (trace/moe_kernels.py weighted_act)
_WEIGHTED_FUSED = (Activation.SWIGLU, Activation.SWIGLU_CLAMPED)


# -- closed-form activations --------------------------------------------------------------------

def layer_activation_bytes(model: ModelSpec, plan: PlanSpec, recompute: Recompute, stack: SoftwareSpec,
                           kind: LayerKind = DENSE) -> int:
    """Bytes one layer saves for backward for one micro-batch (Korthikanti et al. 2022, itemised).

    With MHA, a 4h GELU MLP, dropout and unfused attention (the megatron-lm-2021/2022 stacks) this
    is exactly their s*b*h*(10 + 24/t + 5*a*s/(h*t)) (34 + 5as/h with sequence parallelism, divided
    by t); the traced layer of those stacks saves the same bytes (tests/trace/test_stack_trace.py).
    """
    s, b, h, t = model.seq_length // plan.cp, plan.micro_batch_size, model.hidden_size, plan.tp  # CP: s/cp tokens
    a, f = model.num_attention_heads, model.ffn_size
    kv = model.kv_heads * model.head_dim
    e = plan.param_dtype.nbytes
    rep = 1.0 / t if plan.sequence_parallel else 1.0  # regions outside the TP split
    sb = s * b
    moe = kind.moe and model.moe is not None
    stats = (4 * model.norm.params) * sb * rep  # fp32 mean and rstd (LayerNorm) or rstd (RMSNorm) per norm
    norms = 2 * (e * sb * h * rep + stats)  # the two norms' inputs
    if recompute is Recompute.FULL and (stack.full_recompute_unit is CheckpointUnit.BLOCK or moe):
        return int(e * sb * h * rep)  # the layer's input, the checkpoint Megatron-LM keeps
    if recompute is Recompute.FULL:  # AutoModel's (trace/block.py): the norms, run outside the two checkpoints,
        return int(norms + 2 * e * sb * h * rep)  # and those checkpoints' inputs (the norms' outputs)
    # torchtitan's wq/wk/wv and w1/w3 (trace/linears.py column_parallel_linears): a GEMM each on one gathered input
    split = not stack.fused_projections
    split_mlp = split and model.activation is Activation.SWIGLU and not moe
    if recompute is Recompute.SELECTIVE and stack.recompute_policy is RecomputePolicy.OPS and model.mla is None \
            and not moe:
        # torchtitan's per-op policy (trace/op_checkpoint.py): the block's input, the outputs of its odd-numbered
        # matmuls, attention's output and log-sum-exp, and sequence parallelism's two reduce-scatters; the rest is
        # recomputed. A row-parallel matmul writes the whole [s, b, h] of partial sums.
        qd = a * model.head_dim / t
        attn_mms = [qd, kv / t, kv / t, h] if split else [qd + 2 * kv / t, h]
        mlp_mms = ([f / t, f / t, h] if split_mlp else [(2 * f if model.activation.gated else f) / t, h])
        kept = e * sb * (sum((attn_mms + mlp_mms)[::2]) + qd) + 4 * b * a * s / t
        return int(e * sb * h * rep + kept + (2 * e * sb * h / t if plan.sequence_parallel and t > 1 else 0))
    modules = set(stack.recompute_modules) if recompute is Recompute.SELECTIVE else set()
    mask = sb * h * rep if stack.hidden_dropout > 0 else 0  # 1-byte dropout masks after attention and MLP
    norm_out = 0 if RecomputeModule.LAYERNORM in modules else e * sb * h * rep  # a linear's input
    attn = norm_out  # the QKV linear's input (separate projections save it once: trace/parallel.py)
    if model.mla is not None:  # latents (replicated) and, unless recomputed, the up-projected q, k, v
        m = model.mla
        attn += e * sb * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim)
        if RecomputeModule.MLA_UP_PROJ not in modules:
            attn += e * sb * a * (2 * m.qk_head_dim + m.v_head_dim) / t
        attn += e * sb * a * m.v_head_dim / t
    else:
        qkv = e * sb * (a * model.head_dim + 2 * kv) / t
        attn += qkv  # q, k and the fused kernel's own copy of V (trace/attention.py)
        held = False  # whether a saved view holds the whole QKV output alive
        if split:  # V is wv's own output, the norms keep q and k as the GEMMs wrote them
            attn += (e * sb * (a * model.head_dim + kv) / t + 4 * sb * (a + model.kv_heads) / t
                     if model.qk_norm else 0)
        elif model.qk_norm:
            # the norms keep their inputs: K's view, and q, a copy where the rank's query heads of several KV groups
            # are gathered into one tensor (else a view too)
            gathered = a > model.kv_heads and model.kv_heads // t > 1
            attn += (e * sb * a * model.head_dim / t if gathered else 0) + 4 * sb * (a + model.kv_heads) / t
            held = True
        if RecomputeModule.CORE_ATTN in modules and not split and (model.position_embedding is PositionEmbedding.ROTARY
                                                                   or model.qk_norm):
            attn -= e * sb * kv / t  # the checkpoint keeps V as it came, a view (no copy of its own)
            held = True
        attn += qkv if held else 0
        attn += e * sb * a * model.head_dim / t  # attention output = projection input
    if stack.attention is AttentionKernel.FUSED:
        attn += 0 if RecomputeModule.CORE_ATTN in modules else 4 * b * a * s / t  # fp32 log-sum-exp
    elif RecomputeModule.CORE_ATTN not in modules:  # softmax output (+ dropout mask and output)
        attn += (5 if stack.attention_dropout > 0 else 2) * a * s * s * b / t
    if RecomputeModule.MLP in modules and not moe:  # Megatron-Core's 'mlp' module skips MoE layers
        mlp = norm_out  # the checkpointed MLP keeps its input only
    elif moe:
        mlp = norm_out + moe_activation_bytes(model, plan, RecomputeModule.MOE_ACT in modules, stack)
    else:
        # fc1's output and fc2's input; a gated unit's fused kernel keeps only its 2f input, the unfused ops also
        # keep the activated gate (silu(a), then multiplied by b)
        mlp = norm_out + ((3 if stack.fused_elementwise else 4) if model.activation.gated else 2) * e * sb * f / t
    return int(norms + attn + mlp + 2 * mask)


def moe_activation_bytes(model: ModelSpec, plan: PlanSpec, recompute_act: bool = False,
                         stack: SoftwareSpec | None = None) -> float:
    """What an MoE layer's MLP keeps beyond its input: router scores, the permuted token copies the
    rank's experts receive, their FC1 and activation outputs (split by etp), the combined copies,
    and the shared experts' intermediates (``trace/moe.py`` traces the same)."""
    from echo_plan.trace.moe import routed_token_counts  # deferred: loads numpy, torch

    moe = model.moe
    e, h, t = plan.param_dtype.nbytes, model.hidden_size, plan.tp
    tokens = model.seq_length // plan.cp * plan.micro_batch_size // (t if plan.sequence_parallel else 1)
    sent, hot, each = routed_token_counts(tokens, model, ExpertLayout(plan.ep, plan.expert_tp, plan.expert_imbalance))
    recv = (hot + (moe.num_experts // plan.ep - 1) * each) * plan.expert_tp
    f = moe.expert_ffn_hidden_size // plan.expert_tp
    gated = model.activation.gated
    fused = stack is None or stack.moe_permute_fusion  # unfused un-permutation keeps the weighted copies too
    act_out = 0 if recompute_act else f
    if stack is None or stack.moe_probs_in_activation:
        # the activation keeps each copy's fp32 probability; un-permutation (a sum) keeps no rows; an unfused
        # weighted activation also keeps its fp32 output for the multiply
        fused_act = stack is None or stack.fused_elementwise
        unpermute = 4 * recv + (0 if fused_act and model.activation in _WEIGHTED_FUSED else 4 * recv * f)
    else:
        unpermute = e * sent * h * (1 if fused else 2)
    routed = e * recv * (h + (2 * f if gated else f) + act_out) + unpermute + 4 * tokens * moe.num_experts
    shared = (4 if gated else 2) * e * model.seq_length // plan.cp * plan.micro_batch_size * moe.shared_ffn / t
    return routed + shared


def embedding_activation_bytes(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec) -> int:
    """Token ids (int64) kept for the embedding's backward, plus its dropout mask."""
    sb = model.seq_length // plan.cp * plan.micro_batch_size  # each CP rank holds seq / cp tokens
    rep = 1.0 / plan.tp if plan.sequence_parallel else 1.0
    return int(8 * sb + (sb * model.hidden_size * rep if stack.hidden_dropout > 0 else 0))


def loss_saved_bytes_per_logit(plan: PlanSpec, kernel: CrossEntropy) -> int:
    """What the loss keeps per logit for backward: the fp32 log-softmax of the unfused losses (Megatron-LM's,
    PyTorch's eager one), or the logits in their own dtype (Transformer Engine's, which writes the gradient over
    them, and a compiled loss, which reads them again in backward)."""
    return plan.param_dtype.nbytes if kernel.keeps_logits else 4


def output_activation_bytes(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec) -> int:
    """Final norm and output-linear inputs, and what the loss keeps: the fp32 softmax of the unfused
    vocab-parallel loss, or the logits' own bf16 storage holding their gradient (Transformer Engine's)."""
    sb = model.seq_length // plan.cp * plan.micro_batch_size  # each CP rank holds seq / cp tokens
    rep = 1.0 / plan.tp if plan.sequence_parallel else 1.0
    e = plan.param_dtype.nbytes
    per_logit = loss_saved_bytes_per_logit(plan, stack.cross_entropy)
    return int(2 * e * sb * model.hidden_size * rep + per_logit * sb * model.vocab_size / plan.tp)
