"""DeepSeek's own kernels around its blockwise FP8 GEMMs (the stack's ``fp8_kernels: deepseek``) and its E5M6 copy
of the attention output (``fp8_attention_output_e5m6``), as its published training profile shows them: each a
setting that adds the profile's kernels where the stack has them and changes nothing where it does not."""

from collections import Counter

import pytest
import torch

from echo_plan.specs import DType, ModelSpec, Recompute, load_stack
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.trace import fp8_kernels as fk
from echo_plan.trace.records import Phase, StageKind
from echo_plan.trace.tracer import trace_stage


def _mla_moe() -> ModelSpec:
    """Two layers of a small DeepSeek-V3: MLA attention, 8 routed experts (top 2) and a shared one."""
    return ModelSpec.build(dict(
        name="mla-moe-small", num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1000, seq_length=256,
        activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        tied_embeddings=False, mla=dict(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                        v_head_dim=32),
        moe=dict(num_experts=8, top_k=2, expert_ffn_hidden_size=128, shared_expert_ffn_hidden_size=128)))


def _trace(settings: dict, dtype=DType.FP8, recompute=Recompute.NONE):
    stack = load_stack("megatron-core", {"fp8_recipe": "blockwise", **settings})
    return trace_stage(_mla_moe(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=dtype,
                       recompute=recompute, stack=stack, kind=LayerKind(moe=True), layout=ExpertLayout(2, 1, 1.0))


def _names(trace, phase=None) -> Counter:
    return Counter(op.name.split(".")[1] for op in trace.ops if "." in op.name and (phase is None or op.phase is phase))


def test_deepgemm_lays_out_the_scales_before_each_dense_gemm_of_activations():
    te, ds = _trace({}), _trace({"fp8_kernels": "deepseek"})
    assert _names(te)["fp8_scale_transpose"] == 0
    laid = {op.index for op in ds.ops if op.name.endswith("fp8_scale_transpose.default")}
    dense = [op for op in ds.ops if op.name.endswith("_scaled_mm.default")]
    fed = [op for op in dense if laid & set(op.deps)]
    # every forward GEMM, and in backward one of each linear's two (the input gradient's, not the weight gradient's)
    assert all(op in fed for op in dense if op.phase is Phase.FORWARD)
    backward = [op for op in dense if op.phase is Phase.BACKWARD]
    assert 2 * len([op for op in fed if op.phase is Phase.BACKWARD]) == len(backward) > 0
    assert len(fed) == len(laid)


def test_the_weights_are_transposed_in_each_backward_not_kept_for_the_step():
    te, ds = _trace({}), _trace({"fp8_kernels": "deepseek"})
    # the optimizer keeps the weights in FP8 (fp8_param_gather): TE makes their transposes once per step, DeepSeek not
    assert _names(te, Phase.STEP)["fp8_weight_transpose"] > 0 and not _names(ds, Phase.STEP)["fp8_weight_transpose"]
    extra = _names(ds, Phase.BACKWARD)["fp8_transpose"] - _names(te, Phase.BACKWARD)["fp8_transpose"]
    # one per input-gradient GEMM: each dense linear's and the experts' two grouped ones
    dense_dgrads = len([op for op in te.ops if op.phase is Phase.BACKWARD and op.name.endswith("_scaled_mm.default")]) // 2
    assert extra == dense_dgrads + 2


def test_a_tensor_needed_both_ways_is_cast_twice_by_deepseek_and_once_by_transformer_engine():
    te, ds = _names(_trace({}), Phase.BACKWARD), _names(_trace({"fp8_kernels": "deepseek"}), Phase.BACKWARD)
    assert te["fp8_channel_cast"] == 0 and ds["fp8_channel_cast"] > 0
    assert ds["fp8_block_cast"] == te["fp8_block_cast"]  # the per-token casts stay; the columnwise half moves


@pytest.mark.parametrize("original", [False, True])
def test_the_attention_output_is_kept_once_in_e5m6(original):
    base = {"fp8_save_original_input": original}
    plain, e5m6 = _trace(base), _trace({**base, "fp8_attention_output_e5m6": True})
    fwd, bwd = _names(e5m6, Phase.FORWARD), _names(e5m6, Phase.BACKWARD)
    assert fwd["fp8_e5m6_cast"] == 1 and bwd["fp8_e5m6_dequant"] == 1 and bwd["fp8_channel_cast"] == 1
    assert _names(plain)["fp8_e5m6_cast"] == 0
    m = _mla_moe()
    values = m.seq_length * m.num_attention_heads * m.mla.v_head_dim
    # plain: attention keeps the bf16 output and the projection its FP8 copy with 1 x 128 scales (or, keeping the
    # original, the same bf16 output); E5M6: 1.5 bytes a value, once
    fp8_copy = 0 if original else values + values // 128 * 4
    assert plain.saved_bytes - e5m6.saved_bytes == 2 * values + fp8_copy - values * 3 // 2


@pytest.mark.parametrize("settings", [{"fp8_kernels": "deepseek"}, {"fp8_attention_output_e5m6": True}])
def test_in_bf16_the_settings_change_nothing(settings):
    a, b = _trace({}, DType.BF16), _trace(settings, DType.BF16)
    assert [op.name for op in a.ops] == [op.name for op in b.ops] and a.saved_bytes == b.saved_bytes


def test_the_kernels_reference_maths():
    x = torch.randn(256, 384)
    q, s, qt, st = fk.fp8_block_cast(x, False, True)
    ct, cs = fk.fp8_channel_cast(x, False)
    assert torch.equal(ct.float(), qt.float()) and torch.equal(cs, st)
    sc = torch.rand(256, 3)
    laid = fk.fp8_scale_transpose(sc)
    assert torch.equal(laid, sc) and laid.stride() == (1, 256)  # the same values, column-major
    y = torch.randn(4, 6, dtype=torch.bfloat16)
    e = fk.fp8_e5m6_cast(y)
    assert e.dtype is torch.uint8 and e.shape == (4, 9)  # 12 bits a value
    back = fk.fp8_e5m6_dequant(e, 6)
    assert back.dtype is torch.bfloat16 and torch.allclose(back.float(), y.float(), rtol=2 ** -3, atol=0)


def test_w_keeps_the_fp8_copy_of_a_gradient_cast_only_for_it_not_the_bf16_gradient():
    """DeepSeek's per-channel cast of a gradient feeds only the weight-gradient GEMM (W); run in B, W keeps its
    FP8 output (a byte a value) rather than the bf16 gradient (two): what a zero-bubble or DualPipe schedule
    holds from B until W is never more for a cast than for what it reads."""
    from echo_plan.layout.backward_split import retained_bytes, split_backward

    trace = _trace({"fp8_kernels": "deepseek"})
    b, w = split_backward(trace)
    in_b = {op.index for op in b}
    casts = [op for op in trace.ops if op.name.endswith("fp8_channel_cast.default") and op.phase is Phase.BACKWARD]
    assert casts and all(op.index in in_b for op in casts)
    # a re-gather or transpose only W reads still runs in W (it writes as much as it reads, or more)
    te = _trace({})
    tb, tw = split_backward(te)
    moved = [op for op in tw if op.name.endswith("fp8_transpose.default")]
    assert moved  # the transposes of saved FP8 inputs for the weight gradients
    assert retained_bytes(trace, w) > 0


def test_the_e5m6_copy_is_multi_head_latent_attentions_only(llama_small):
    """DeepSeek keeps MLA's output in E5M6; other attention is traced as before, not silently half-changed."""
    def trace(settings):
        stack = load_stack("megatron-core", {"fp8_recipe": "blockwise", **settings})
        return trace_stage(llama_small, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                           dtype=DType.FP8, recompute=Recompute.NONE, stack=stack)
    a, b = trace({}), trace({"fp8_attention_output_e5m6": True})
    assert [op.name for op in a.ops] == [op.name for op in b.ops] and a.saved_bytes == b.saved_bytes
