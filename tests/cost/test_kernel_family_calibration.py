"""A cluster's compute figures per kernel family (``calibration.compute_by_kernels``): PyTorch's own kernels reach
less of a stock Hopper than Transformer Engine's, and a stack running them (``SoftwareSpec.kernels``) gets the
figures fitted on runs of such stacks; everything else keeps the cluster's ``compute`` block."""

from __future__ import annotations

import pytest

from echo_plan.cost.calibration import ComputeCalibration, check_calibration
from echo_plan.cost.kernel_db import compute_model_for
from echo_plan.errors import SpecError
from echo_plan.specs import DType, load_cluster, load_stack
from echo_plan.specs.software_kinds import KernelFamily
from tests.cost.test_calibration import _copy, _mm

H100 = load_cluster("dgx-h100")


def _with_family(cluster, block):
    cal = dict(cluster.calibration)
    cal["compute_by_kernels"] = {"pytorch": block}
    return cluster.replace(calibration=cal)


def test_a_family_block_replaces_only_the_figures_it_names():
    cluster = _with_family(H100, {"gemm_efficiency_scale": 0.5, "fitted_on": {"mine": ["a row"]}})
    base = ComputeCalibration.of(cluster)
    got = ComputeCalibration.of(cluster, KernelFamily.PYTORCH)
    assert got.gemm_efficiency_scale == 0.5
    assert got.memory_bandwidth_scale == base.memory_bandwidth_scale
    assert got.fp8_gemm_efficiency_scale == base.fp8_gemm_efficiency_scale  # the low-precision scale on top stays
    assert got.info["fitted_on"] == {"mine": ["a row"]}  # and says where it came from
    assert ComputeCalibration.of(cluster, KernelFamily.NVIDIA) == base
    assert ComputeCalibration.of(cluster, "pytorch") == got  # the value works as well as the enum


def test_the_family_figure_times_the_stacks_kernels_and_no_block_changes_nothing():
    gpu = H100.gpu
    slower = _with_family(H100, {"gemm_efficiency_scale": 0.5})
    nv, pt = compute_model_for(slower, kernels=KernelFamily.NVIDIA), compute_model_for(slower, kernels="pytorch")
    assert pt.op_time(_mm(), gpu, DType.BF16) > 1.4 * nv.op_time(_mm(), gpu, DType.BF16)
    assert pt.op_time(_copy(), gpu, DType.BF16) == nv.op_time(_copy(), gpu, DType.BF16)  # memory-bound: not named
    bare = H100.replace(calibration={k: v for k, v in H100.calibration.items() if k != "compute_by_kernels"})
    assert (compute_model_for(bare, kernels="pytorch").op_time(_mm(), gpu, DType.BF16)
            == compute_model_for(bare).op_time(_mm(), gpu, DType.BF16))


def test_a_simulated_step_uses_the_family_of_its_stack(small_dense, tmp_path):
    """The same plan and stack on the same cluster: only the stack's kernel family differs, and a lower GEMM figure
    for that family never shortens the step."""
    from echo_plan.simulate import simulate
    from echo_plan.specs import PlanSpec
    from echo_plan.trace.cache import TraceCache

    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "global_batch_size": 16,
                           "sharding": "parameters"})
    torch_stack = load_stack("torchtitan")
    slower = _with_family(load_cluster("dgx-h100", gpus=8), {"gemm_efficiency_scale": 0.4})
    cache = TraceCache(tmp_path)
    fast = simulate(small_dense, slower, plan, cache=cache,
                    stack=torch_stack.model_copy(update={"kernels": KernelFamily.NVIDIA}))
    slow = simulate(small_dense, slower, plan, cache=cache, stack=torch_stack)
    assert slow.step_time_s > 1.05 * fast.step_time_s
    said = [n for n in slow.notes if n.startswith("compute figures for pytorch kernels")]
    assert said and "gemm_efficiency_scale" in said[0]  # simulate says which figures timed the stack's kernels
    assert not any(n.startswith("compute figures for") for n in fast.notes)


@pytest.mark.parametrize("by_kernels,needle", [
    ({"triton": {"gemm_efficiency_scale": 0.8}}, "kernel family: nvidia, pytorch"),
    ({"pytorch": {"gemm_efficiency_scale": 9.0}}, "gemm_efficiency_scale"),
    ({"pytorch": {"gemm_eficiency_scale": 0.8}}, "unknown key"),
    ({}, "mapping of kernel family"),
    ([1], "mapping of kernel family"),
])
def test_a_bad_family_block_is_a_one_line_error(by_kernels, needle):
    with pytest.raises(SpecError, match=needle) as err:
        check_calibration({"compute_by_kernels": by_kernels}, "mine")
    assert "\n" not in str(err.value)


def test_the_shipped_stacks_say_whose_kernels_they_run():
    for name in ("torchtitan", "olmo-core", "fms-fsdp", "llm-foundry", "deepspeed-zero3"):
        assert load_stack(name).kernels is KernelFamily.PYTORCH, name
    for name in ("megatron-core", "nemo-24.03", "deepseek-v3", "megatron-lm-2021", "megatron-deepspeed"):
        assert load_stack(name).kernels is KernelFamily.NVIDIA, name
    assert load_stack("automodel").kernels is KernelFamily.NVIDIA  # torchtitan's base, Transformer Engine's modules


def test_the_hopper_presets_carry_a_pytorch_block_fitted_on_named_rows():
    for preset in ("dgx-h100", "h800", "h100-800g", "h200"):
        block = (load_cluster(preset).calibration.get("compute_by_kernels") or {}).get("pytorch")
        assert block and block["fitted_on"], preset
    assert ComputeCalibration.of(H100, "pytorch").gemm_efficiency_scale < ComputeCalibration.of(H100).gemm_efficiency_scale


def test_the_status_line_says_whose_figures_time_the_stacks_kernels():
    from echo_plan.specs.calibration import kernels_status

    assert kernels_status(H100, KernelFamily.PYTORCH).startswith("compute figures for pytorch kernels")
    assert kernels_status(H100, KernelFamily.NVIDIA) is None  # the compute block's own family: nothing to say
    other = kernels_status(load_cluster("b200"), KernelFamily.PYTORCH)
    assert other.startswith("no compute figures of this cluster's for pytorch kernels") and "dgx-h100" in other
    assert kernels_status(load_cluster("dgx-a100").replace(calibration={}), "pytorch") is None  # nothing calibrated
