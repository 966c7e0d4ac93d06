"""Blackwell's precisions in launch configs, both ways: MXFP8 and NVFP4 for Megatron-LM and Megatron-Bridge, refused in
one line where a format cannot say them."""

from __future__ import annotations

import pytest

from echo_plan.interop.launch import CannotExpress, LaunchFormat, canonical_plan, export_launch, import_launch
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack

MODEL, CLUSTER = load_model("llama3-70b"), load_cluster("gb200-nvl72", gpus=64)
CASES = [("fp8", {"fp8_recipe": "mxfp8", "fp8_param_gather": True}), ("fp8", {"fp8_recipe": "mxfp8",
                                                                             "fp8_param_gather": False}),
         ("fp4", {"fp4_param_gather": True}), ("fp4", {"fp4_param_gather": False})]


def _plan(dtype: str) -> PlanSpec:
    return PlanSpec(tp=2, pp=4, dp=8, virtual_stages=5, global_batch_size=256, sequence_parallel=True,
                    distributed_optimizer=True, dtype=dtype)


@pytest.mark.parametrize("fmt", [LaunchFormat.MEGATRON_LM, LaunchFormat.MEGATRON_BRIDGE])
@pytest.mark.parametrize("dtype, changes", CASES)
def test_block_scaled_precisions_round_trip(fmt, dtype, changes):
    stack = load_stack("megatron-core", changes)
    exported = export_launch(fmt, MODEL, _plan(dtype), stack, CLUSTER)
    job = import_launch(exported.text, "exported", load_stack("megatron-core"), fmt=fmt)
    assert canonical_plan(job.plan, MODEL) == canonical_plan(_plan(dtype), MODEL)
    if dtype == "fp8":
        assert job.stack.fp8_recipe.value == "mxfp8" and job.stack.fp8_param_gather == changes["fp8_param_gather"]
    else:
        assert job.stack.fp4_param_gather == changes["fp4_param_gather"]


def test_megatron_lm_says_nvfp4_and_mxfp8_with_its_own_flags():
    text = export_launch(LaunchFormat.MEGATRON_LM, MODEL, _plan("fp4"), load_stack("megatron-core",
                                                                                   {"fp4_param_gather": True}),
                         CLUSTER).text
    assert "--fp4-format e2m1" in text and "--fp4-recipe nvfp4" in text and "--fp4-param-gather" in text
    assert "--fp8-format" not in text
    mx = export_launch(LaunchFormat.MEGATRON_LM, MODEL, _plan("fp8"), load_stack("megatron-core",
                                                                                 {"fp8_recipe": "mxfp8"}), CLUSTER).text
    assert "--fp8-recipe mxfp8" in mx and "--reuse-grad-buf-for-mxfp8-param-ag" in mx  # needed by MXFP8 parameters


def test_importing_both_precisions_or_another_fp4_recipe_is_one_line():
    from echo_plan.interop.launch import CannotImport

    base = export_launch(LaunchFormat.MEGATRON_LM, MODEL, _plan("fp4"), load_stack("megatron-core"), CLUSTER).text
    for bad, field in ((base.replace("--fp4-recipe nvfp4", "--fp4-recipe custom"), "fp4_recipe"),
                       (base.replace("--fp4-format e2m1", "--fp4-format e2m1 --fp8-format e4m3"), "fp4")):
        with pytest.raises(CannotImport) as err:
            import_launch(bad, "job.sh", load_stack("megatron-core"), fmt=LaunchFormat.MEGATRON_LM)
        assert err.value.setting == field and "\n" not in str(err.value)


def test_torchtitan_refuses_what_its_export_cannot_say():
    for dtype, stack in (("fp4", load_stack("torchtitan")), ("fp8", load_stack("torchtitan", {"fp8_recipe": "mxfp8"}))):
        plan = PlanSpec(dp=64, global_batch_size=256, dtype=dtype, sharding="parameters")
        with pytest.raises(CannotExpress) as err:
            export_launch(LaunchFormat.TORCHTITAN, MODEL, plan, stack, CLUSTER)
        assert err.value.knob in ("dtype", "fp8_recipe") and "\n" not in str(err.value)
