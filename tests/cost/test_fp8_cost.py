"""FP8 GEMMs in the kernel model, and FP8 training in memory: properties that must hold."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.cost.kernel_db import compute_model_for
from echo_plan.cost.memory import estimate_memory, fp8_weight_bytes
from echo_plan.cost.weight_copies import quantized_copy_bytes
from echo_plan.errors import SpecError
from echo_plan.specs import DType, PlanSpec, load_cluster, load_model, load_stack, validate_plan
from echo_plan.specs.software_checks import check_precision
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta

H100 = load_cluster("dgx-h100")
SHIPPED = compute_model_for(H100)  # with the preset's calibration, as users get it


def gemm(m: int, k: int, n: int, fp8: bool, blockwise: bool = False) -> OpRecord:
    """y[m, n] = a[m, k] @ b[k, n]: ``aten.mm`` in bf16, ``aten._scaled_mm`` on FP8 operands."""
    if not fp8:
        ins = (TensorMeta((m, k), "bfloat16"), TensorMeta((k, n), "bfloat16"))
        return OpRecord(0, "aten.mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, ins,
                        (TensorMeta((m, n), "bfloat16"),), 2.0 * m * n * k, 2 * (m * k + k * n), 2 * m * n, ())
    scales = ((TensorMeta((m, -(-k // 128)), "float32"), TensorMeta((-(-k // 128), -(-n // 128)), "float32"))
              if blockwise else (TensorMeta((), "float32"),) * 2)
    ins = (TensorMeta((m, k), "float8_e4m3fn"), TensorMeta((k, n), "float8_e4m3fn")) + scales
    return OpRecord(0, "aten._scaled_mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, ins,
                    (TensorMeta((m, n), "bfloat16"),), 2.0 * m * n * k, m * k + k * n, 2 * m * n, ())


SIZES = st.sampled_from([64, 128, 256, 768, 1024, 2048, 4096, 6144, 8192, 14336, 16384, 28672])


@settings(max_examples=200, deadline=None)
@given(m=SIZES, k=SIZES, n=SIZES, blockwise=st.booleans())
def test_fp8_never_slows_a_gemm_on_hopper(m, k, n, blockwise):
    for model in (SHIPPED, AnalyticalComputeModel()):
        fp8 = model.op_time(gemm(m, k, n, True, blockwise), H100.gpu, DType.FP8)
        assert fp8 <= model.op_time(gemm(m, k, n, False), H100.gpu, DType.BF16) * (1 + 1e-12)


def test_large_fp8_gemms_run_near_their_own_peak_and_faster_than_bf16():
    big = [gemm(8192, 8192, 8192, fp8) for fp8 in (False, True)]
    bf16, fp8 = (SHIPPED.estimate(op, H100.gpu, DType.FP8) for op in big)
    assert 1.3 < bf16.time_s / fp8.time_s < 2.0  # NVIDIA's recipes: FP8 runs 1.3-1.5x bf16's speed end to end
    plain = AnalyticalComputeModel().estimate(big[1], H100.gpu, DType.FP8)
    assert plain.efficiency == pytest.approx(0.77, abs=0.03)  # compute.yaml's measured FP8 best, at its shape


def test_blockwise_scaling_costs_a_little_and_the_fp8_scale_touches_fp8_only():
    op, op_bw = gemm(8192, 8192, 8192, True), gemm(8192, 8192, 8192, True, blockwise=True)
    model = AnalyticalComputeModel()
    assert model.op_time(op, H100.gpu, DType.FP8) < model.op_time(op_bw, H100.gpu, DType.FP8)
    scaled = AnalyticalComputeModel(calibrated_constants(ComputeCalibration(fp8_gemm_efficiency_scale=0.8),
                                                         load_compute_constants()))
    bf16 = gemm(8192, 8192, 8192, False)
    assert scaled.op_time(bf16, H100.gpu, DType.BF16) == model.op_time(bf16, H100.gpu, DType.BF16)
    assert scaled.op_time(op, H100.gpu, DType.FP8) > model.op_time(op, H100.gpu, DType.FP8)


def test_a_gemm_bound_layer_is_faster_in_fp8(tmp_path):
    from echo_plan.replay.interference import InterferenceModel
    from echo_plan.replay.layer import replay_layer
    from echo_plan.cost.collectives import collective_model_for
    from echo_plan.specs import Recompute
    from echo_plan.trace.records import StageKind
    from echo_plan.trace.tracer import trace_stage

    model = load_model("llama3-8b").replace(seq_length=2048)
    cluster = H100.resized(gpus=8)
    comm = collective_model_for(cluster)
    times = {}
    for dtype in (DType.BF16, DType.FP8):
        trace = trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=dtype,
                            recompute=Recompute.NONE, stack=load_stack())
        timing = replay_layer(trace, SHIPPED, comm, cluster, dtype, InterferenceModel.none())
        times[dtype] = timing.total_s + timing.per_step_s
        assert (timing.per_step_s > 0) == (dtype is DType.FP8)  # the weight casts, once per step
    assert times[DType.FP8] < times[DType.BF16]


def _plan(dtype: str, **kw) -> PlanSpec:
    return PlanSpec(tp=8, pp=4, dp=2, micro_batch_size=1, global_batch_size=16, sequence_parallel=True,
                    distributed_optimizer=True, dtype=dtype, **kw)


def test_fp8_weight_copies_in_memory():
    model, cluster = load_model("llama3-70b"), H100.resized(gpus=64)
    stack = load_stack().replace(fp8_param_gather=False)
    gathered = stack.replace(fp8_param_gather=True)
    assert load_stack().fp8_param_gather  # megatron-core: NeMo 2.0's FP8 recipes gather FP8 weights
    bf16 = estimate_memory(model, _plan("bf16"), cluster, stack)
    fp8 = estimate_memory(model, _plan("fp8"), cluster, stack)
    fp8_pg = estimate_memory(model, _plan("fp8"), cluster, gathered)
    layers = model.num_layers // 4
    per_layer = -(-model.params_per_layer // 8)
    for b, f, g in zip(bf16, fp8, fp8_pg):
        extra = f.weights_bytes - b.weights_bytes
        copies = quantized_copy_bytes(DType.FP8, stack.on_gpu(H100.gpu.sm_arch))
        assert copies == 2 and extra == pytest.approx(copies * layers * per_layer, rel=0.01)  # FP8 weight + transpose
        assert g.weights_bytes == pytest.approx(b.weights_bytes, rel=1e-6)  # FP8 weights replace the bf16 ones
        assert (f.optimizer_bytes, f.gradients_bytes) == (b.optimizer_bytes, b.gradients_bytes)
    assert fp8_weight_bytes(model, _plan("bf16"), stack, 0, 2.0) == 0.0


def test_fp8_plans_keep_bf16_weights_and_need_fp8_tensor_cores():
    plan = _plan("fp8")
    assert plan.param_dtype is DType.BF16 and plan.dtype is DType.FP8 and "fp8" in plan.short()
    assert load_stack().grad_bytes(plan.param_dtype) == 4
    a100 = load_cluster("dgx-a100").resized(gpus=64)
    with pytest.raises(SpecError, match=a100.gpu.name) as err:
        validate_plan(plan, load_model("llama3-70b"), a100)
    assert err.value.field == "dtype" and "\n" not in str(err.value)
    validate_plan(plan, load_model("llama3-70b"), H100.resized(gpus=64))  # Hopper has them
    with pytest.raises(ValueError, match="bf16, fp16, fp8 or fp4"):
        PlanSpec(dtype="fp32")


def test_deepseek_kernels_keep_one_fp8_copy_of_a_weight_never_more_than_transformer_engine():
    te = load_stack("megatron-core", {"fp8_recipe": "blockwise"})
    ds = te.replace(fp8_kernels="deepseek")
    assert quantized_copy_bytes(DType.FP8, te) == 2.0  # the weight and its transpose, kept for the step
    assert quantized_copy_bytes(DType.FP8, ds) == 1.0  # the transpose is made in each backward instead
    assert quantized_copy_bytes(DType.BF16, ds) == 0.0
    for field, value in (("fp8_kernels", "deepseek"), ("fp8_attention_output_e5m6", True)):
        stack = load_stack("megatron-core", {"fp8_recipe": "current", field: value})  # a recipe DeepSeek's are not for
        with pytest.raises(SpecError, match="go with its 1 x 128 tiles.*not the current FP8 recipe") as err:
            check_precision(stack, DType.FP8, H100.gpu)
        assert err.value.field == field and "\n" not in str(err.value)
        check_precision(stack, DType.BF16, H100.gpu)  # nothing in FP8: nothing to refuse
