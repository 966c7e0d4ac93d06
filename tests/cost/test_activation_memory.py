"""The closed-form activations the search prunes with (``echo_plan.cost.activation_memory``) against the traced
layer they stand for: the same bytes, to the norms' statistics, for dense layers on the fused-kernel stacks, so that no
plan the trace would fit is pruned and none it would not fit is let through."""

from __future__ import annotations

import pytest

from echo_plan.cost.activation_memory import layer_activation_bytes
from echo_plan.specs import DType, ModelSpec, PlanSpec, Recompute, load_stack
from echo_plan.trace.records import StageKind
from echo_plan.trace.tracer import trace_stage

SHAPES = {
    "llama (GQA, rotary, SwiGLU)": dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", position_embedding="rotary"),
    "llama-2 (MHA, rotary)": dict(activation="swiglu", norm="rmsnorm", position_embedding="rotary"),
    "gpt (MHA, learned, GELU)": dict(activation="gelu", norm="layernorm", position_embedding="learned", bias=True),
    "qwen3 (GQA, QK norm)": dict(num_kv_heads=2, activation="swiglu", norm="rmsnorm", position_embedding="rotary",
                                 qk_norm=True),
}


# stacks by name, with what they change: torchtitan's separate projections under Megatron's module recompute (both
# recompute policies meet separate projections), and Megatron's fused projections under torchtitan's per-op policy
STACKS = {
    "megatron-core": ("megatron-core", {}),
    "torchtitan": ("torchtitan", {}),
    "megatron-core, separate projections": ("megatron-core", {"fused_projections": False}),
    "torchtitan, fused projections": ("torchtitan", {"fused_projections": True}),
}


@pytest.mark.parametrize("stack_name", list(STACKS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tp,sp", [(1, False), (2, True), (2, False)])
def test_closed_form_equals_the_traced_dense_layer(stack_name, shape, tp, sp):
    model = ModelSpec(name="m", num_layers=2, hidden_size=256, num_attention_heads=8, ffn_hidden_size=512,
                      vocab_size=1000, seq_length=128, tied_embeddings=False, **SHAPES[shape])
    name, overrides = STACKS[stack_name]
    stack = load_stack(name, {"tp_comm_overlap": False, **overrides})
    plan = PlanSpec.build(dict(tp=tp, pp=1, dp=1, global_batch_size=2, micro_batch_size=2, sequence_parallel=sp))
    traced = trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=sp, micro_batch_size=2, dtype=DType.BF16,
                         recompute=Recompute.NONE, stack=stack).saved_bytes_by_mode
    for mode in Recompute:
        assert layer_activation_bytes(model, plan, mode, stack) == pytest.approx(traced[mode.value], rel=5e-3), mode
