"""Blackwell's precisions in the kernel model and in memory: MXFP8 and NVFP4 GEMMs, weight copies, precision rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.cost.compute import AnalyticalComputeModel, Scaling, gemm_dims, gemm_scaling, load_compute_constants
from echo_plan.cost.memory import estimate_memory
from echo_plan.cost.weight_copies import layer_gather_bytes, layer_weight_extra_bytes, quantized_copy_bytes
from echo_plan.errors import SpecError
from echo_plan.specs import DType, PlanSpec, load_cluster, load_model, load_stack, validate_plan
from echo_plan.specs.software_checks import check_precision
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta

GB200 = load_cluster("gb200-nvl72")
H100 = load_cluster("dgx-h100")
PLAIN = AnalyticalComputeModel()


def gemm(m: int, k: int, n: int, kind: str) -> OpRecord:
    """y[m, n] = a[m, k] @ b[k, n] as the tracer records it in each precision."""
    out = (TensorMeta((m, n), "bfloat16"),)
    if kind == "bf16":
        ins = (TensorMeta((m, k), "bfloat16"), TensorMeta((k, n), "bfloat16"))
        return OpRecord(0, "aten.mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, ins, out,
                        2.0 * m * n * k, 2 * (m * k + k * n), 2 * m * n, ())
    if kind == "nvfp4":
        ins = (TensorMeta((m, k // 2), "float4_e2m1fn_x2"), TensorMeta((k // 2, n), "float4_e2m1fn_x2"),
               TensorMeta((m, k // 16), "float8_e4m3fn"), TensorMeta((n, k // 16), "float8_e4m3fn"))
        return OpRecord(0, "echo_plan.nvfp4_scaled_mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, ins, out,
                        2.0 * m * n * k, (m * k + k * n) // 2, 2 * m * n, ())
    scales = ((TensorMeta((m, k // 32), "float8_e8m0fnu"), TensorMeta((n, k // 32), "float8_e8m0fnu"))
              if kind == "mxfp8" else (TensorMeta((), "float32"),) * 2)
    ins = (TensorMeta((m, k), "float8_e4m3fn"), TensorMeta((k, n), "float8_e4m3fn")) + scales
    return OpRecord(0, "aten._scaled_mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, ins, out,
                    2.0 * m * n * k, m * k + k * n, 2 * m * n, ())


SIZES = st.sampled_from([256, 1024, 2048, 4096, 8192, 16384, 28672])


def test_the_gemm_reads_its_scaling_and_unpacks_fp4_depth():
    assert gemm_scaling(gemm(1024, 2048, 512, "nvfp4")) is Scaling.NVFP4
    assert gemm_scaling(gemm(1024, 2048, 512, "mxfp8")) is Scaling.MX
    assert gemm_scaling(gemm(1024, 2048, 512, "fp8")) is Scaling.TENSOR
    assert gemm_dims(gemm(1024, 2048, 512, "nvfp4")) == (1, 1024, 512, 2048)  # K of the values, not of the bytes


@settings(max_examples=100, deadline=None)
@given(m=SIZES, k=SIZES, n=SIZES)
def test_fewer_bits_never_slow_a_gemm_on_blackwell(m, k, n):
    times = {kind: PLAIN.op_time(gemm(m, k, n, kind), GB200.gpu, DType.BF16) for kind in ("bf16", "fp8", "nvfp4")}
    assert times["nvfp4"] <= times["fp8"] * (1 + 1e-12) and times["fp8"] <= times["bf16"] * (1 + 1e-12)


def test_nvfp4_runs_at_the_fp4_peak_and_more_peak_never_slows_it():
    big = gemm(16384, 16384, 16384, "nvfp4")
    est = PLAIN.estimate(big, GB200.gpu, DType.FP4)
    achieved = big.flops / est.time_s / 1e12
    assert 0.5 * GB200.gpu.peak_fp4_tflops < achieved < GB200.gpu.peak_fp4_tflops
    faster = GB200.gpu.replace(peak_fp4_tflops=2 * GB200.gpu.peak_fp4_tflops)
    assert PLAIN.op_time(big, faster, DType.FP4) < PLAIN.op_time(big, GB200.gpu, DType.FP4)


def test_each_precision_figure_touches_its_own_gemms_only():
    ops = {kind: gemm(8192, 8192, 8192, kind) for kind in ("bf16", "fp8", "mxfp8", "nvfp4")}
    consts = load_compute_constants()
    for figure, touched in (("mxfp8_gemm_efficiency_scale", {"mxfp8"}), ("fp4_gemm_efficiency_scale", {"nvfp4"})):
        scaled = AnalyticalComputeModel(calibrated_constants(ComputeCalibration(**{figure: 0.7}), consts))
        for kind, op in ops.items():
            slower = scaled.op_time(op, GB200.gpu, DType.BF16) > PLAIN.op_time(op, GB200.gpu, DType.BF16) * (1 + 1e-9)
            assert slower == (kind in touched), (figure, kind)


def test_weight_copies_by_recipe():
    stack = load_stack(None, {"fp8_param_gather": False})
    hopper, blackwell = stack.on_gpu(90), stack.on_gpu(100)
    assert quantized_copy_bytes(DType.BF16, hopper) == 0.0
    assert quantized_copy_bytes(DType.FP8, hopper) == 2.0  # the FP8 weight and its transpose
    assert quantized_copy_bytes(DType.FP8, blackwell) == 1.0  # no transpose: the GEMMs take any layout
    mx = blackwell.replace(fp8_recipe="mxfp8")
    assert quantized_copy_bytes(DType.FP8, mx) == pytest.approx(2 * (1 + 1 / 32))  # two copies with E8M0 scales
    assert quantized_copy_bytes(DType.FP4, blackwell) == pytest.approx(2 * (0.5 + 1 / 16))
    for dtype, st_ in ((DType.FP8, blackwell), (DType.FP8, mx), (DType.FP4, blackwell)):
        kept = st_.replace(fp8_param_gather=True, fp4_param_gather=True)  # the copies replace the bf16 weight
        assert layer_weight_extra_bytes(dtype, kept, 2.0) == pytest.approx(quantized_copy_bytes(dtype, st_) - 2.0)
        assert layer_weight_extra_bytes(dtype, st_, 2.0) == quantized_copy_bytes(dtype, st_)
    kept = blackwell.replace(fp8_param_gather=True, fp4_param_gather=True)
    assert layer_gather_bytes(DType.FP8, kept) == 1.0 and layer_gather_bytes(DType.FP4, kept) == 0.5
    assert layer_gather_bytes(DType.FP8, kept.replace(fp8_recipe="mxfp8")) == 2.0  # bf16 through the grad buffer
    assert layer_gather_bytes(DType.FP8, blackwell) == 2.0


def test_blackwell_fp8_keeps_fewer_weight_bytes_than_hopper():
    model = load_model("llama3-70b")
    plan = PlanSpec(tp=2, pp=4, dp=8, virtual_stages=5, micro_batch_size=1, global_batch_size=256,
                    sequence_parallel=True, distributed_optimizer=True, dtype="fp8")
    stack = load_stack(None, {"fp8_recipe": "current", "fp8_param_gather": False})
    hopper = estimate_memory(model, plan, H100.resized(gpus=64), stack)
    blackwell = estimate_memory(model, plan, GB200.resized(gpus=64), stack)
    assert all(b.weights_bytes < h.weights_bytes for b, h in zip(blackwell, hopper))


def test_precisions_need_their_tensor_cores_one_line_each():
    model, plan = load_model("llama3-8b"), PlanSpec(dp=8, global_batch_size=8, dtype="fp4")
    with pytest.raises(SpecError, match="NVFP4 starts with sm100") as err:
        validate_plan(plan, model, H100.resized(gpus=8))
    assert err.value.field == "dtype" and H100.gpu.name in str(err.value) and "\n" not in str(err.value)
    validate_plan(plan, model, GB200.resized(gpus=8))
    mx = load_stack(None, {"fp8_recipe": "mxfp8"})
    with pytest.raises(SpecError, match="MXFP8 needs block-scaled") as err:
        check_precision(mx, DType.FP8, H100.gpu)
    assert err.value.field == "fp8_recipe" and "\n" not in str(err.value)
    check_precision(mx, DType.FP8, GB200.gpu)
    check_precision(mx, DType.FP8, GB200.gpu, moe=True)  # the experts' grouped GEMMs run MXFP8 too
    deepseek = load_stack("deepseek-v3")
    with pytest.raises(SpecError, match="1 x 128 tiles") as err:  # DeepSeek's FP8 dispatch is not MXFP8's
        check_precision(deepseek.replace(fp8_recipe="mxfp8"), DType.FP8, GB200.gpu, moe=True)
    assert err.value.field in ("moe_dispatch_fp8", "moe_act_input_fp8") and "\n" not in str(err.value)
    check_precision(deepseek, DType.FP8, GB200.gpu, moe=True)


H800 = load_cluster("h800")


@settings(max_examples=60, deadline=None)
@given(m=SIZES, k=SIZES, n=SIZES, held=st.integers(min_value=1, max_value=66))
def test_fp8_gemms_that_leave_sms_to_communication_are_never_faster(m, k, n, held):
    """A stack whose FP8 GEMMs are persistent kernels on the SMs the expert exchange leaves (DeepSeek's 112 of
    132) runs each of them on fewer SMs: never faster, at most as much slower as the SMs it gave up, and its
    bf16 GEMMs keep every SM."""
    sized = PLAIN.with_kernels("cudnn", False, held)
    assert sized is PLAIN.with_kernels("cudnn", False, held)  # one sibling per choice: its caches are kept
    full, fewer = (model.op_time(gemm(m, k, n, "fp8"), H800.gpu, DType.FP8) for model in (PLAIN, sized))
    sms = H800.gpu.sm_count
    assert full * (1 - 1e-12) <= fewer
    assert fewer <= full * sms / (sms - held) * 2  # wave quantisation on fewer SMs, but nothing like a stall
    bf16 = gemm(m, k, n, "bf16")
    assert sized.op_time(bf16, H800.gpu, DType.BF16) == PLAIN.op_time(bf16, H800.gpu, DType.BF16)


def test_a_large_fp8_gemm_on_112_of_132_sms_takes_about_132_112ths_as_long():
    big = gemm(16384, 16384, 16384, "fp8")
    ratio = PLAIN.with_kernels("cudnn", False, 20).op_time(big, H800.gpu, DType.FP8) / PLAIN.op_time(
        big, H800.gpu, DType.FP8)
    assert ratio == pytest.approx(132 / 112, rel=0.05)


def test_fp8_gemms_leave_sms_only_on_a_deepep_stack_that_says_how_many():
    fp8 = DType.FP8
    assert load_stack("deepseek-v3").fp8_gemm_sms_held(is_moe=True, ep=64, dtype=fp8) == 20
    assert load_stack("deepseek-v3").fp8_gemm_sms_held(is_moe=True, ep=1, dtype=fp8) == 0  # no exchange, every SM
    assert load_stack("deepseek-v3").fp8_gemm_sms_held(is_moe=False, ep=8, dtype=fp8) == 0
    assert load_stack("deepseek-v3").fp8_gemm_sms_held(is_moe=True, ep=64, dtype=DType.BF16) == 0  # no FP8 GEMMs
    assert load_stack("megatron-core").fp8_gemm_sms_held(is_moe=True, ep=64, dtype=fp8) == 0
    with pytest.raises(SpecError, match="needs moe_comm_sms"):
        load_stack("deepseek-v3", {"moe_comm_sms": None})
    with pytest.raises(SpecError, match="fp8_gemms_leave_comm_sms is DeepEP's"):
        load_stack("megatron-core", {"fp8_gemms_leave_comm_sms": True})
