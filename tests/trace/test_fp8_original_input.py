"""Megatron-Core >= 0.14 with Transformer Engine >= 2.6 has FP8 linears save their bf16 input instead of an
FP8 copy where that input is kept anyway or recomputed (``set_save_original_input``); the stack's
``fp8_save_original_input`` says whether a stack does. What each rule removes from the saved bytes is one
FP8 copy of a known tensor, so the tests compare against that tensor's size."""

import pytest

from echo_plan.layout.backward_split import split_backward
from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.trace.records import OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

SCALES = 64  # bytes of slack for the fp32 scale tensors of a per-tensor recipe


def _trace(model, original: bool, recipe="delayed", modules=(), moe=False, dtype=DType.FP8):
    stack = load_stack("megatron-core", {"fp8_recipe": recipe, "fp8_param_gather": False,
                                         "fp8_save_original_input": original,
                                         "recompute_modules": list(modules) or ["core_attn"]})
    return trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=dtype,
                       recompute=Recompute.SELECTIVE if modules else Recompute.NONE, stack=stack,
                       kind=LayerKind(moe=moe), layout=ExpertLayout(1, 1, 1.0) if moe else None)


def _backward_casts(trace) -> int:
    return sum(1 for op in trace.ops if op.phase is Phase.BACKWARD and op.name.split(".")[1] == "fp8_cast")


@pytest.mark.parametrize("recipe", ["current", "blockwise"])
def test_the_projection_keeps_the_attention_output_the_core_saved(llama_small, recipe):
    off, on = _trace(llama_small, False, recipe), _trace(llama_small, True, recipe)
    fp8_copy = llama_small.seq_length * llama_small.num_attention_heads * llama_small.head_dim  # 1 byte each
    scales = fp8_copy // 128 * 4 if recipe == "blockwise" else SCALES
    assert fp8_copy <= off.saved_bytes - on.saved_bytes <= fp8_copy + scales


def test_under_delayed_scaling_nothing_changes_without_recompute(llama_small):
    assert _trace(llama_small, False).saved_bytes == _trace(llama_small, True).saved_bytes


def test_a_recomputed_norm_leaves_no_fp8_copy_of_its_output(llama_small):
    off = _trace(llama_small, False, modules=["layernorm"])
    on = _trace(llama_small, True, modules=["layernorm"])
    normed = llama_small.seq_length * llama_small.hidden_size  # FP8 bytes of one norm output
    assert 2 * normed <= off.saved_bytes - on.saved_bytes <= 2 * normed + SCALES  # QKV's and FC1's inputs
    assert _backward_casts(on) == _backward_casts(off) + 2  # cast again in backward, from the recomputed norm


def test_a_recomputed_expert_activation_leaves_no_fp8_copy_for_fc2(small_moe):
    off = _trace(small_moe, False, modules=["moe_act"], moe=True)
    on = _trace(small_moe, True, modules=["moe_act"], moe=True)
    rows = small_moe.seq_length * small_moe.moe.top_k
    act_out = rows * small_moe.moe.expert_ffn_hidden_size  # FP8 bytes of the activation's output
    assert act_out <= off.saved_bytes - on.saved_bytes <= act_out + SCALES
    assert on.saved_bytes_by_mode["full"] == off.saved_bytes_by_mode["full"]  # full recompute keeps the input only


def test_bf16_traces_ignore_the_setting(llama_small):
    off = _trace(llama_small, False, "current", modules=["layernorm"], dtype=DType.BF16)
    on = _trace(llama_small, True, "current", modules=["layernorm"], dtype=DType.BF16)
    assert off.saved_bytes == on.saved_bytes and len(off.ops) == len(on.ops)


@pytest.mark.parametrize("original", [False, True])
def test_fp8_backward_splits_into_the_same_input_and_weight_gradients_as_bf16(llama_small, original):
    """B holds the input-gradient GEMMs and W the weight-gradient ones whatever the precision: an FP8
    weight's once-per-step copy is no activation, an FP8 cast or transpose of a saved input is one."""
    def flops(trace):
        b, w = split_backward(trace)
        return (sum(op.flops for op in b if op.kind is OpKind.GEMM), sum(op.flops for op in w if op.kind is OpKind.GEMM))

    bf16 = _trace(llama_small, original, "current", modules=["layernorm"], dtype=DType.BF16)
    fp8 = _trace(llama_small, original, "current", modules=["layernorm"])
    assert flops(fp8) == pytest.approx(flops(bf16)) and min(flops(fp8)) > 0
