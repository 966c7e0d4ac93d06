"""The 2021-kernel compute model: unfused attention costs more than fused, everything else is delegated."""

from __future__ import annotations

import pytest

from echo_plan.cost.compute import AnalyticalComputeModel
from echo_plan.specs import DType, load_cluster
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta
from echo_plan.validation.software2021 import ScaledComputeModel, UnfusedAttentionModel

GPU = load_cluster("dgx-a100").gpu


def sdpa(backward: bool, s: int = 2048) -> OpRecord:
    q = TensorMeta((1, 12, s, 128), "float16")
    inputs = (q, q, q, q) if backward else (q, q, q)
    name = "aten._scaled_dot_product_flash_attention_backward.default" if backward else \
        "aten._scaled_dot_product_flash_attention.default"
    flops = 4.0 * 12 * s * s * 128 * (2.5 if backward else 1.0)
    return OpRecord(0, name, OpKind.ATTENTION, Phase.FORWARD, Stream.COMPUTE, inputs, (q,), flops, 0, 0, ())


@pytest.mark.parametrize("backward", [False, True])
def test_unfused_attention_is_slower_than_fused(backward):
    base = AnalyticalComputeModel()
    unfused = UnfusedAttentionModel(base)
    assert unfused.op_time(sdpa(backward), GPU, DType.FP16) > base.op_time(sdpa(backward), GPU, DType.FP16)


def test_unfused_cost_grows_quadratically_with_sequence():
    m = UnfusedAttentionModel(AnalyticalComputeModel())
    short, long = m.op_time(sdpa(False, 1024), GPU, DType.FP16), m.op_time(sdpa(False, 4096), GPU, DType.FP16)
    assert long > 10 * short


def test_other_ops_are_delegated_and_scaling_multiplies():
    base = AnalyticalComputeModel()
    a, b = TensorMeta((4096, 4096), "float16"), TensorMeta((4096, 4096), "float16")
    gemm = OpRecord(0, "aten.mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, (a, b), (a,),
                    2.0 * 4096**3, 0, 0, ())
    assert UnfusedAttentionModel(base).op_time(gemm, GPU, DType.FP16) == base.op_time(gemm, GPU, DType.FP16)
    assert ScaledComputeModel(base, 1.5).op_time(gemm, GPU, DType.FP16) == pytest.approx(
        1.5 * base.op_time(gemm, GPU, DType.FP16))
    with pytest.raises(ValueError):
        ScaledComputeModel(base, 0.0)
