"""FP8 training traced as Transformer Engine runs it: FP8 GEMMs, their casts, bf16 elsewhere."""

from collections import Counter

import pytest
import torch

from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.specs.moe import ExpertLayout
from echo_plan.trace import fp8_kernels as fk
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.records import OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

RECIPES = ("delayed", "current", "blockwise")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return TraceCache(tmp_path_factory.mktemp("fp8-traces"))


def _trace(model, dtype, recipe="delayed", tp=1, recompute=Recompute.NONE, cache=None, **stack):
    settings = {"fp8_recipe": recipe, "fp8_param_gather": False, **stack}
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=tp > 1, micro_batch_size=1, dtype=dtype,
                       recompute=recompute, cache=cache, stack=load_stack(None, settings))


def _names(trace, phase=None):
    return Counter(op.name.split(".")[1] for op in trace.ops if phase is None or op.phase is phase)


def _gemm_flops(trace):
    return sum(op.flops for op in trace.ops if op.kind is OpKind.GEMM)


@pytest.mark.parametrize("recipe, tp", [("delayed", 1), ("current", 2), ("blockwise", 1), ("blockwise", 2)])
def test_fp8_trace_has_casts_and_the_bf16_gemm_flops(llama_small, shared, recipe, tp):
    bf16, fp8 = _trace(llama_small, DType.BF16, tp=tp, cache=shared), _trace(llama_small, DType.FP8, recipe, tp=tp,
                                                                              cache=shared)
    assert _gemm_flops(fp8) == pytest.approx(_gemm_flops(bf16)) and _gemm_flops(fp8) > 0
    names = _names(fp8)
    # fprop, dgrad, wgrad of QKV, projection, FC1, FC2 (userbuffers' overlap at tp 2 splits some in chunks)
    assert names["_scaled_mm"] == 12 if tp == 1 else names["_scaled_mm"] > 12
    assert "mm" not in names and "addmm" not in names  # no bf16 GEMM left in the layer
    casts = names["fp8_block_cast"] if recipe == "blockwise" else names["fp8_cast"] + names["fp8_cast_transpose"]
    # every linear's input (forward) and output gradient (backward); under a recipe other than delayed the
    # projection keeps its bf16 input (the attention core saves it anyway) and casts it again in backward
    again = int(recipe != "delayed")
    assert casts == 8 + again
    assert names["fp8_transpose"] >= 4  # the saved FP8 inputs, transposed for the wgrad GEMMs
    assert (names["fp8_amax"] == 8 + again) == (recipe == "current")  # current scaling's amax pass
    assert names["flash_attention"] == 1 and names["rms_norm"] == 2  # attention and norms stay bf16
    scaled = [op for op in fp8.ops if "_scaled_mm" in op.name]
    fwd = {op.inputs[0].dtype for op in scaled if op.phase is Phase.FORWARD}
    grads = {op.inputs[0].dtype for op in scaled if op.phase is Phase.BACKWARD}
    assert fwd == {"float8_e4m3fn"} and "float8_e5m2" in grads  # HYBRID: E4M3 forward, E5M2 gradients


def test_weights_are_cast_once_per_step_even_when_recomputed(llama_small, shared):
    for recompute in (Recompute.NONE, Recompute.FULL):
        trace = _trace(llama_small, DType.FP8, recompute=recompute, cache=shared)
        step = _names(trace, Phase.STEP)
        assert step == Counter({"fp8_weight_cast": 4})  # QKV, projection, FC1, FC2: one cast each
        assert all(op.name.split(".")[1] in fk.ONCE_PER_STEP for op in trace.ops if op.phase is Phase.STEP)
    gathered = _trace(llama_small, DType.FP8, fp8_param_gather=True)
    assert _names(gathered, Phase.STEP) == Counter({"fp8_weight_transpose": 4})  # the weight already is FP8


def test_fp8_saves_fp8_inputs_and_gathers_fp8_shards(llama_small, shared):
    bf16, fp8 = _trace(llama_small, DType.BF16, tp=2, cache=shared), _trace(llama_small, DType.FP8, tp=2, cache=shared)
    assert fp8.saved_bytes < bf16.saved_bytes  # linears keep their FP8 input, not the bf16 one

    def gathered(trace):
        return sum(op.collective.nbytes for op in trace.ops if op.collective is not None
                   and op.collective.kind.value in ("all_gather", "send_recv") and op.phase is Phase.FORWARD)
    assert gathered(fp8) * 2 == gathered(bf16)  # the sequence-parallel gathers move FP8 (1 byte) shards


def test_the_recipe_is_in_the_key_of_fp8_traces_only(llama_small, shared):
    cache = shared
    keys = {r: _trace(llama_small, DType.FP8, r, cache=cache).key for r in RECIPES}
    assert len({k.digest() for k in keys.values()}) == 3
    bf16 = {r: _trace(llama_small, DType.BF16, r, cache=cache).key for r in RECIPES}
    assert len({k.digest() for k in bf16.values()}) == 1  # bf16 traces ignore the FP8 recipe


def test_moe_experts_run_fp8_grouped_gemms():
    from echo_plan.specs import ModelSpec

    moe = ModelSpec.build({"name": "moe-small", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 8,
                           "num_kv_heads": 4, "ffn_hidden_size": 512, "vocab_size": 1000, "seq_length": 128,
                           "activation": "swiglu", "norm": "rmsnorm", "position_embedding": "rotary",
                           "moe": {"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 256}})
    kind = next(k for k in moe.distinct_kinds() if k.moe)

    def trace(dtype):
        return trace_stage(moe, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=dtype,
                           recompute=Recompute.NONE, stack=load_stack(), kind=kind, layout=ExpertLayout(ep=2, etp=1))
    bf16, fp8 = trace(DType.BF16), trace(DType.FP8)
    assert _gemm_flops(fp8) == pytest.approx(_gemm_flops(bf16))
    names = _names(fp8)
    assert names["_scaled_grouped_mm"] == 6 and "bmm" not in names  # FC1 and FC2: fprop, dgrad, wgrad
    # megatron-core keeps FP8 weights (fp8_param_gather): once per step only their transposes, experts' included
    assert _names(fp8, Phase.STEP) == Counter({"fp8_weight_transpose": 4})


def test_cast_kernels_compute_what_their_fakes_promise():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, qt, amax = fk.fp8_cast_transpose(x, torch.tensor(1.0), True)
    assert q.dtype == qt.dtype == torch.float8_e5m2 and qt.shape == (256, 4)
    assert torch.equal(q.float().t(), qt.float()) and amax == x.abs().amax().float()
    q, s, qt, st = fk.fp8_block_cast(x, False, True)
    assert s.shape == (4, 2) and qt.shape == (256, 4) and st.shape == (256, 1)
    # e4m3 keeps 3 mantissa bits: within a relative 1/16 of each value, and one quantum of its tile near zero
    assert torch.allclose((q.float().reshape(4, 2, 128) * s.unsqueeze(-1)).reshape(4, 256), x.float(), rtol=0.07,
                          atol=0.02)
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    w8, w8t, sinv = fk.fp8_weight_cast(w, torch.tensor(1.0), True)
    assert w8.shape == (256, 128) and w8t.shape == (128, 256) and sinv.shape == (2, 1)
