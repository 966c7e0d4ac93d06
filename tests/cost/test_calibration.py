"""The compute calibration a cluster carries: parsing, checking, and what it does to kernel times."""

from __future__ import annotations

import pytest

from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants, check_calibration
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.errors import SpecError
from echo_plan.specs import DType, load_cluster
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta

GPU = load_cluster("h800").gpu


def _mm(m=4096, n=4096, k=4096):
    a, b = TensorMeta((m, k), "bfloat16"), TensorMeta((k, n), "bfloat16")
    return OpRecord(0, "aten.mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE, (a, b),
                    (TensorMeta((m, n), "bfloat16"),), 2.0 * m * n * k, 0, 0, ())


def _copy(n=1 << 26):
    t = TensorMeta((n,), "bfloat16")
    return OpRecord(0, "aten.clone.default", OpKind.COPY, Phase.FORWARD, Stream.COMPUTE, (t,), (t,), 0.0, 2 * n, 2 * n, ())


def test_scales_slow_the_kernels_they_name():
    base = AnalyticalComputeModel(load_compute_constants())
    cal = ComputeCalibration(gemm_efficiency_scale=0.8, memory_bandwidth_scale=0.5, kernel_overhead_us=10.0)
    slow = AnalyticalComputeModel(calibrated_constants(cal, load_compute_constants()))
    t0, t1 = base.op_time(_mm(), GPU, DType.BF16), slow.op_time(_mm(), GPU, DType.BF16)
    launch0 = load_compute_constants().launch_overhead_s
    assert (t1 - 10e-6) == pytest.approx((t0 - launch0) / 0.8, rel=1e-6)
    c0, c1 = base.op_time(_copy(), GPU, DType.BF16), slow.op_time(_copy(), GPU, DType.BF16)
    assert c1 > 1.9 * (c0 - launch0)
    assert calibrated_constants(ComputeCalibration(), load_compute_constants()) == load_compute_constants()


def test_the_shipped_presets_apply_their_calibration():
    from echo_plan.cost.kernel_db import compute_model_for

    h800 = load_cluster("h800")
    bare = h800.replace(calibration={})
    assert compute_model_for(h800).op_time(_mm(), GPU, DType.BF16) > compute_model_for(bare).op_time(_mm(), GPU, DType.BF16)
    assert ComputeCalibration.of(h800).info["fitted_on"]  # and says which rows it came from


@pytest.mark.parametrize("block,needle", [
    ({"compute": {"gemm_efficiency_scale": 0.0}}, "gemm_efficiency_scale"),
    ({"compute": {"gemm_efficiency_scale": float("inf")}}, "gemm_efficiency_scale"),
    ({"compute": {"gemm_eficiency_scale": 0.9}}, "unknown key"),
    ({"compute": {"kernel_overhead_us": "fast"}}, "kernel_overhead_us"),
    ({"compute": [1, 2]}, "mapping"),
    ({"computing": {}}, "unknown section"),
])
def test_bad_calibration_is_a_one_line_error(block, needle):
    with pytest.raises(SpecError, match=needle) as err:
        check_calibration(block, "mine")
    assert "\n" not in str(err.value)
