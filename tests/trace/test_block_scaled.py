"""Blackwell's precisions traced as Transformer Engine runs them: per-tensor FP8 without transposes, MXFP8 and
NVFP4 (``trace/quant_state.py``, ``trace/mx_kernels.py``)."""

from collections import Counter

import pytest
import torch

from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.specs.moe import ExpertLayout
from echo_plan.trace import mx_kernels as mk
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.records import OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

BLACKWELL, HOPPER = 100, 90


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return TraceCache(tmp_path_factory.mktemp("block-scaled-traces"))


def _trace(model, dtype, recipe="current", tp=1, arch=BLACKWELL, cache=None, recompute=Recompute.NONE, **stack):
    settings = {"fp8_recipe": recipe, "fp8_param_gather": False, "tp_comm_overlap": False, **stack}
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=tp > 1, micro_batch_size=1, dtype=dtype,
                       recompute=recompute, cache=cache, stack=load_stack(None, settings).on_gpu(arch))


def _names(trace, phase=None):
    return Counter(op.name.split(".")[1] for op in trace.ops if phase is None or op.phase is phase)


def _gemm_flops(trace):
    return sum(op.flops for op in trace.ops if op.kind is OpKind.GEMM)


CASES = [(DType.FP8, "current", HOPPER), (DType.FP8, "current", BLACKWELL), (DType.FP8, "mxfp8", BLACKWELL),
         (DType.FP4, "current", BLACKWELL)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype, recipe, arch", CASES)
def test_every_precision_does_the_bf16_gemm_flops(llama_small, shared, dtype, recipe, arch, tp):
    bf16 = _trace(llama_small, DType.BF16, tp=tp, cache=shared)
    low = _trace(llama_small, dtype, recipe, tp=tp, arch=arch, cache=shared)
    assert _gemm_flops(low) == pytest.approx(_gemm_flops(bf16)) and _gemm_flops(low) > 0
    names = _names(low)
    assert "mm" not in names and "addmm" not in names  # no bf16 GEMM left in the layer
    assert names["flash_attention"] == 1 and names["rms_norm"] == 2  # attention and norms stay bf16


def test_blackwell_per_tensor_fp8_makes_no_transpose(llama_small, shared):
    hopper = _names(_trace(llama_small, DType.FP8, arch=HOPPER, cache=shared))
    blackwell = _names(_trace(llama_small, DType.FP8, arch=BLACKWELL, cache=shared))
    assert hopper["fp8_transpose"] >= 4 and hopper["fp8_cast_transpose"] >= 4
    assert blackwell["fp8_transpose"] == blackwell["fp8_cast_transpose"] == 0  # the GEMMs take any layout
    assert blackwell["fp8_cast"] == hopper["fp8_cast"] + hopper["fp8_cast_transpose"]  # one cast each still
    step = _names(_trace(llama_small, DType.FP8, arch=BLACKWELL, cache=shared), Phase.STEP)
    assert step == Counter({"fp8_weight_quantize": 4})  # one FP8 copy per weight, no transpose
    gathered = _trace(llama_small, DType.FP8, arch=BLACKWELL, fp8_param_gather=True)
    assert not _names(gathered, Phase.STEP)  # the parameter already is the FP8 weight: nothing per step


def test_mxfp8_quantises_each_direction_once_from_bf16(llama_small, shared):
    trace = _trace(llama_small, DType.FP8, "mxfp8", cache=shared)
    names = _names(trace)
    assert names["mx_cast"] >= 8 and not any(n.startswith("fp8_") for n in names)  # no per-tensor cast, no transpose
    assert _names(trace, Phase.STEP) == Counter({"mx_weight_cast": 4})  # both copies of each weight, once per step
    gemms = [op for op in trace.ops if op.kind is OpKind.GEMM]
    assert all(op.inputs[2].dtype == "float8_e8m0fnu" for op in gemms)  # power-of-two scales per 32 values
    casts = [op for op in trace.ops if op.name.split(".")[1] == "mx_cast" and op.phase is Phase.FORWARD]
    assert all(op.outputs[0].dtype == op.outputs[2].dtype == "float8_e4m3fn" for op in casts)
    scales = [op.outputs[1] for op in casts]  # rowwise scales: one per 32 values of the last dimension
    assert all(s.shape[-1] * mk.MX_BLOCK == op.inputs[0].shape[-1] for s, op in zip(scales, casts))


def test_nvfp4_casts_with_an_amax_pass_and_packs_two_values_per_byte(llama_small, shared):
    trace = _trace(llama_small, DType.FP4, cache=shared)
    names = _names(trace)
    assert names["nvfp4_cast"] == names["nvfp4_amax"] >= 8  # two-level scaling: the tensor's amax first
    assert names["nvfp4_scaled_mm"] == 12 and _names(trace, Phase.STEP) == Counter({"nvfp4_weight_cast": 4})
    for op in trace.ops:
        if op.name.split(".")[1] == "nvfp4_scaled_mm":
            a, b = op.inputs[0], op.inputs[1]
            assert a.dtype == b.dtype == "float4_e2m1fn_x2" and a.shape[-1] == b.shape[0]  # packed along K
    gathered = _trace(llama_small, DType.FP4, fp4_param_gather=True)
    assert _names(gathered, Phase.STEP) == Counter({"nvfp4_weight_transpose": 4})  # the rowwise copy is the parameter


def test_fewer_bits_save_fewer_activation_bytes(llama_small, shared):
    saved = {(d, r): _trace(llama_small, d, r, tp=2, cache=shared).saved_bytes
             for d, r in ((DType.BF16, "current"), (DType.FP8, "current"), (DType.FP8, "mxfp8"), (DType.FP4, "current"))}
    assert saved[(DType.FP4, "current")] < saved[(DType.FP8, "current")] < saved[(DType.BF16, "current")]
    # MXFP8 saves the same FP8 inputs as per-tensor FP8, with a one-byte scale per 32 values beside them
    assert saved[(DType.FP8, "current")] < saved[(DType.FP8, "mxfp8")] < saved[(DType.BF16, "current")]


def test_block_scaled_gathers_move_fewer_bytes(llama_small, shared):
    def gathered(trace):
        return sum(op.collective.nbytes for op in trace.ops if op.collective is not None
                   and op.collective.kind.value == "all_gather" and op.phase is Phase.FORWARD)

    bf16 = gathered(_trace(llama_small, DType.BF16, tp=2, cache=shared))
    mx = gathered(_trace(llama_small, DType.FP8, "mxfp8", tp=2, cache=shared))
    fp4 = gathered(_trace(llama_small, DType.FP4, tp=2, cache=shared))
    assert fp4 < mx < bf16  # FP8 shards with their scales, FP4 shards (half a byte) with theirs
    assert mx == pytest.approx(bf16 / 2 * (1 + 1 / mk.MX_BLOCK))


@pytest.mark.parametrize("dtype, recipe, arch", CASES)
def test_experts_run_the_precision_too(small_moe, shared, dtype, recipe, arch):
    """An MoE layer's grouped expert GEMMs in each precision: the bf16 layer's FLOPs, no bf16 GEMM but the router's."""
    kind = next(k for k in small_moe.distinct_kinds() if k.moe)

    def trace(d, r):
        settings = {"fp8_recipe": r, "fp8_param_gather": False, "tp_comm_overlap": False}
        return trace_stage(small_moe, StageKind.BLOCK, tp=2, sequence_parallel=True, micro_batch_size=1, dtype=d,
                           recompute=Recompute.NONE, cache=shared, stack=load_stack(None, settings).on_gpu(arch),
                           kind=kind, layout=ExpertLayout(ep=2, etp=1))

    bf16, low = trace(DType.BF16, "current"), trace(dtype, recipe)
    assert _gemm_flops(low) == pytest.approx(_gemm_flops(bf16))
    names = _names(low)
    assert names["mm"] == 3 and "bmm" not in names  # the router (forward, input and weight gradients) stays bf16
    grouped = [op for op in low.ops if "grouped" in op.name and op.kind is OpKind.GEMM]
    assert len(grouped) == 6  # FC1 and FC2: forward, input gradient, weight gradient
    if recipe == "mxfp8" or dtype is DType.FP4:
        assert all("mx_scaled_grouped_mm" in op.name for op in grouped)
        first = {op.inputs[0].dtype for op in grouped}
        assert first == ({"float4_e2m1fn_x2"} if dtype is DType.FP4 else {"float8_e4m3fn"})
    assert low.saved_bytes < bf16.saved_bytes


def test_the_recipe_and_the_gpu_key_low_precision_traces(llama_small):
    base = load_stack(None, {"fp8_recipe": "current"})
    hopper, blackwell = base.on_gpu(HOPPER), base.on_gpu(BLACKWELL)
    assert hopper.fp8_transposes is True and blackwell.fp8_transposes is False
    assert hopper.precision_signature(DType.FP8) != blackwell.precision_signature(DType.FP8)
    assert base.precision_signature(DType.FP8) == hopper.precision_signature(DType.FP8)  # unresolved = Hopper
    assert base.precision_signature(DType.BF16) == ""
    mx = base.replace(fp8_recipe="mxfp8")
    assert mx.precision_signature(DType.FP8) != base.precision_signature(DType.FP8)
    assert base.replace(fp4_param_gather=True).precision_signature(DType.FP4) != base.precision_signature(DType.FP4)


# -- the kernels' CPU references agree with their fakes, and quantise ------------------------------------------

def test_mx_cast_reference_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 3
    q, s, qc, sc = mk.mx_cast(x, True, True)
    assert q.shape == qc.shape == x.shape and s.shape == (64, 3) and sc.shape == (2, 96)
    back = q.float().reshape(64, 3, 32) * s.float().unsqueeze(-1)
    assert torch.allclose(back.reshape(64, 96), x.float(), rtol=0.07, atol=1e-3)  # E4M3: 3 mantissa bits
    back_c = qc.float().t().reshape(96, 2, 32) * sc.float().t().unsqueeze(-1)
    assert torch.allclose(back_c.reshape(96, 64).t(), x.float(), rtol=0.07, atol=1e-3)


def test_nvfp4_reference_matches_its_fake_shapes_and_decodes():
    torch.manual_seed(0)
    x = torch.randn(32, 48, dtype=torch.bfloat16)
    amax, amax_col = mk.nvfp4_amax(x, True)
    real = mk.nvfp4_cast(x, amax, amax_col, True, True, True)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake = mk.nvfp4_cast(fx, fx.abs().amax().float(), fx.abs().amax().float(), True, True, True)
    assert [tuple(t.shape) for t in real] == [tuple(t.shape) for t in fake]
    assert [t.dtype for t in real] == [t.dtype for t in fake] == [mk.FP4, mk.E4M3, mk.FP4, mk.E4M3]
    w = torch.randn(40, 48, dtype=torch.bfloat16)
    qa, _, _, _ = mk.nvfp4_cast(x, x.abs().amax().float(), x.abs().amax().float(), True, False, False)
    qw, _, _, _ = mk.nvfp4_weight_cast(w)
    out = mk.nvfp4_scaled_mm(qa, qw.t(), torch.empty(0), torch.empty(0), torch.float32)
    assert out.shape == (32, 40) and torch.isfinite(out).all()  # decoded E2M1 values, multiplied


def test_nvfp4_gemm_counts_the_unpacked_depth():
    from torch.utils.flop_counter import FlopCounterMode

    a = torch.zeros(8, 16, dtype=torch.uint8).view(mk.FP4)  # 8 x 32 values
    b = torch.zeros(16, 4, dtype=torch.uint8).view(mk.FP4)  # 32 x 4 values, packed along K
    with FlopCounterMode(display=False) as counter:
        mk.nvfp4_scaled_mm(a, b, torch.empty(0), torch.empty(0), torch.float32)
    assert counter.get_total_flops() == 2 * 8 * 4 * 32
