"""What ``recompute: full`` checkpoints (stack ``full_recompute_unit``): the whole layer (Megatron, torchtitan) or, as
NeMo AutoModel does, a dense layer's attention and MLP each, which keeps four activations a layer instead of one for
the same recomputed GEMMs; an MoE layer stays one block."""

from __future__ import annotations

import pytest

from echo_plan.cost.activation_memory import layer_activation_bytes
from echo_plan.specs import DType, ModelSpec, Recompute, load_model, load_stack
from echo_plan.specs.moe import ExpertLayout
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import OpKind, StageKind
from echo_plan.trace.tracer import trace_stage

S, H, MBS = 128, 256, 2


def model() -> ModelSpec:
    return ModelSpec(name="ck", num_layers=2, hidden_size=H, num_attention_heads=8, num_kv_heads=2,
                     ffn_hidden_size=512, vocab_size=1000, seq_length=S, activation="swiglu", norm="rmsnorm",
                     position_embedding="rotary", tied_embeddings=False)


def trace(unit: str, m: ModelSpec | None = None, **kw):
    stack = load_stack("automodel", {"full_recompute_unit": unit})
    return trace_stage(m or model(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=MBS,
                       dtype=DType.BF16, recompute=Recompute.FULL, stack=stack, **kw)


def gemm_flops(t, phase: str) -> float:
    return sum(op.flops for op in t.ops if op.kind is OpKind.GEMM and op.phase.value == phase)


def test_per_submodule_keeps_four_activations_for_the_same_recomputed_gemms():
    block, sub = trace("block"), trace("submodules")
    activation = S * MBS * H * 2  # one bf16 [s, b, h]
    assert block.saved_bytes_by_mode["full"] == activation
    # both norms' inputs, their outputs (the two checkpoints' inputs), and the norms' fp32 reciprocal RMS
    assert sub.saved_bytes_by_mode["full"] == 4 * activation + 2 * S * MBS * 4
    for phase in ("forward", "backward", "recompute"):
        assert gemm_flops(sub, phase) == pytest.approx(gemm_flops(block, phase))
    assert sub.saved_bytes_by_mode["none"] == block.saved_bytes_by_mode["none"]  # nothing else changes


def test_the_closed_form_the_search_prunes_with_agrees_with_the_trace():
    plan = PlanSpec(tp=1, pp=1, dp=1, micro_batch_size=MBS, global_batch_size=MBS, recompute="full")
    for unit in ("block", "submodules"):
        stack = load_stack("automodel", {"full_recompute_unit": unit})
        assert layer_activation_bytes(model(), plan, Recompute.FULL, stack) == trace(unit).saved_bytes_by_mode["full"]


def test_an_moe_layer_stays_one_block():
    moe = load_model("qwen3-30b-a3b").replace(num_layers=2, seq_length=S)
    kind = next(k for k in moe.distinct_kinds() if k.moe)
    layout = ExpertLayout(ep=1, etp=1)
    block = trace("block", moe, kind=kind, layout=layout)
    sub = trace("submodules", moe, kind=kind, layout=layout)
    assert sub.saved_bytes_by_mode["full"] == block.saved_bytes_by_mode["full"]


def test_the_shipped_stacks_say_which():
    assert load_stack("automodel").full_recompute_unit.value == "submodules"
    for name in ("megatron-core", "torchtitan", "olmo-core", "fms-fsdp"):
        assert load_stack(name).full_recompute_unit.value == "block"
