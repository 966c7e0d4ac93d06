"""Throughput figures of a step: tokens/s, model and hardware TFLOP/s per GPU, MFU.

FLOPs follow Megatron-LM's convention (Narayanan et al. 2021, appendix; reference/hardware.md):
for GPT, per iteration of B sequences of length s,
``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))`` without recomputation and
``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` with full recomputation.

That formula is 3 x (forward FLOPs) with, per token and layer, ``2 x (matmul weights)`` plus
``4*s*h`` for the attention scores and the weighted sum (full s x s, causal masking not
discounted), and ``2*V*h`` for the logits. :func:`forward_flops_per_token` computes the same sum
from the model's actual matmul weights, so it equals the GPT formula for GPT (biases and norms,
which Megatron also leaves out, are not matmuls) and extends to Llama-style models: grouped-query
attention has ``h*(h + 2*kv*d)`` QKV weights, SwiGLU has three ``h x f`` matrices.

Recomputation (hardware FLOPs): full re-runs every layer's forward (not the logits), which turns
72 into 96 and V/(12lh) into V/(16lh) above; selective re-runs only the attention core
(Korthikanti et al. 2022), adding ``4*s*h`` per token and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import DENSE, LayerKind
from echo_plan.specs.plan import PlanSpec, Recompute


def layer_matmul_params(model: ModelSpec, kind: LayerKind = DENSE) -> int:
    """Weights of one block that take part in matrix multiplies for each token (no biases, no norms):
    for an MoE layer the router, the top-k routed experts and the shared experts (active parameters)."""
    h = model.hidden_size
    mats = 3 if model.activation.gated else 2
    if model.mla is not None:
        attn = model.attention_params - model.mla.kv_lora_rank - (model.mla.q_lora_rank or 0)  # less the norms
    else:
        kv = model.kv_heads * model.head_dim
        attn = h * (model.num_attention_heads * model.head_dim + 2 * kv) + model.num_attention_heads * model.head_dim * h
    if kind.moe and model.moe is not None:
        moe = model.moe
        return attn + moe.num_experts * h + mats * h * (moe.top_k * moe.expert_ffn_hidden_size + moe.shared_ffn)
    return attn + mats * h * model.ffn_size


def attention_flops_per_token(model: ModelSpec, kind: LayerKind = DENSE) -> float:
    """Scores (Q K^T) and weighted sum (A V) of one layer, per token, forward: 2 x 2 x s x (heads x d)
    (MLA: query/key and value widths differ; a sliding window sees ``window`` keys, not s)."""
    keys = min(model.seq_length, kind.window) if kind.window else model.seq_length
    if model.mla is not None:
        return 2.0 * keys * model.num_attention_heads * (model.mla.qk_head_dim + model.mla.v_head_dim)
    return 4.0 * keys * model.num_attention_heads * model.head_dim


def forward_flops_per_token(model: ModelSpec) -> tuple[float, float, float]:
    """(layer matmuls of all layers, attention core of all layers, logits) forward FLOPs per token;
    multi-token prediction modules count as a layer (plus their 2h x h projection) and a logits head each."""
    kinds = list(model.layer_kinds()) + [model.mtp_kind] * model.mtp_layers
    layers = sum(2.0 * layer_matmul_params(model, k) for k in kinds)
    layers += model.mtp_layers * 2.0 * 2 * model.hidden_size ** 2
    attn = sum(attention_flops_per_token(model, k) for k in kinds)
    logits = 2.0 * model.vocab_size * model.hidden_size * (1 + model.mtp_layers)
    return layers, attn, logits


def model_flops_per_iteration(model: ModelSpec, global_batch: int) -> float:
    """FLOPs of one iteration without recomputation (forward + 2 x forward for backward)."""
    layers, attn, logits = forward_flops_per_token(model)
    return 3.0 * (layers + attn + logits) * global_batch * model.seq_length


def hardware_flops_per_iteration(model: ModelSpec, global_batch: int, recompute: Recompute,
                                 recomputed_share: float = 0.0) -> float:
    """FLOPs the GPUs actually execute, recomputation included; ``recomputed_share`` of the layers re-run
    whole (recompute_layers), the others as ``recompute`` says."""
    layers, attn, logits = forward_flops_per_token(model)
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: attn, Recompute.FULL: layers + attn}[recompute]
    extra += recomputed_share * (layers + attn - extra)
    return (3.0 * (layers + attn + logits) + extra) * global_batch * model.seq_length


def megatron_gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, full_recompute: bool) -> float:
    """The published GPT formula itself (reference/hardware.md), for checks and the validation table."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    if full_recompute:
        return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


@dataclass(frozen=True, slots=True)
class Throughput:
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float


def throughput(model: ModelSpec, plan: PlanSpec, num_gpus: int, peak_tflops: float, step_time_s: float) -> Throughput:
    """Figures of a step that took ``step_time_s`` on ``num_gpus`` GPUs of ``peak_tflops`` (plan dtype)."""
    gbs = plan.global_batch_size
    mf = model_flops_per_iteration(model, gbs)
    share = min(1.0, plan.recompute_layers * plan.pp * plan.virtual_stages / model.num_layers)
    hf = hardware_flops_per_iteration(model, gbs, plan.recompute, share)
    denom = step_time_s * num_gpus
    model_tflops = mf / denom / 1e12
    return Throughput(
        tokens_per_s=gbs * model.seq_length / step_time_s,
        model_tflops_per_gpu=model_tflops,
        hardware_tflops_per_gpu=hf / denom / 1e12,
        mfu=model_tflops / peak_tflops,
    )
