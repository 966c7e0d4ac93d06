"""The calibration blocks of the shipped presets (calibrate/blocks.py): rows named for attention."""

from __future__ import annotations

import pytest

from echo_plan.calibrate.blocks import compute_block
from echo_plan.calibrate.preset_files import recipes, recipes_without
from echo_plan.errors import EchoPlanError
from echo_plan.specs import load_cluster
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.suites import fitted_rows


def test_the_rows_named_for_attention_are_fitted_and_see_the_attention_figure():
    """h100-gt's recipe names two long-sequence float8 rows: the shipped preset was fitted on them (validate counts
    them as fitted, not held out), and its attention figure is no longer the prior the 8K rows could not see."""
    recipe = recipes()["compute-h100-gt"]
    named = set(recipe["attention_rows"])
    assert len(named) >= 2
    cluster = load_cluster("h100-gt")
    assert named <= fitted_rows(cluster, recipe["suite"])
    compute = cluster.calibration["compute"]
    assert not any(note.startswith("attention_efficiency_scale") for note in compute.get("notes") or ())
    assert compute["attention_efficiency_scale"] != pytest.approx(1.0, abs=0.05)
    # the fp8 figure the attention rows' GEMMs ran at is the one the fp8 fit gave, not its prior
    assert compute["fp8_gemm_efficiency_scale"] != 1.0 and "fp8_fit" in compute


def test_a_row_named_for_attention_that_the_suite_lacks_is_a_one_line_error():
    recipe = {**recipes()["compute-h100-gt"], "attention_rows": ["llama3-8b fp8 8 GPUs at 1M tokens"]}
    with pytest.raises(EchoPlanError, match="attention_rows names 'llama3-8b fp8 8 GPUs at 1M tokens'"):
        compute_block(recipe, validation_dir(), load_cluster("h100-gt"))


def test_a_stand_in_suite_does_not_inherit_the_rows_named_for_attention():
    every = {"r": {"suite": "a", "fit_rows": ["x"], "attention_rows": ["long x"], "presets": ["h100-gt"],
                   "stand_in": {"suite": "b", "fit_rows": "even"}}}
    assert recipes_without(every, "a")["r"]["attention_rows"] == []
    assert recipes_without(every, "c") == every


def test_an_fp8_only_recipe_starts_from_the_figures_fitted_in_the_same_run():
    """fp8-blackwell and fp8-blackwell-ultra take dgx-h100's compute figures: the ones just fitted when the same run
    refits dgx-h100 (not its file's, which one refit would leave a run behind), and the shipped presets agree."""
    from echo_plan.calibrate.blocks import COMPUTE_FIGURES, inherited_compute

    fitted = {"compute": {"gemm_efficiency_scale": 0.5, "attention_efficiency_scale": 0.6,
                          "memory_bandwidth_scale": 0.7, "kernel_overhead_us": 8.0, "fp8_gemm_efficiency_scale": 2.0}}
    got = inherited_compute("dgx-h100", fitted)
    assert {k: got[k] for k in COMPUTE_FIGURES} == {k: fitted["compute"][k] for k in COMPUTE_FIGURES}
    assert "fp8_gemm_efficiency_scale" not in got  # each recipe fits its own low-precision rates
    shipped = inherited_compute("dgx-h100")
    assert shipped["gemm_efficiency_scale"] == load_cluster("dgx-h100").calibration["compute"]["gemm_efficiency_scale"]
    for name, recipe in recipes().items():
        if not recipe.get("fp8_only"):
            continue
        base = load_cluster(recipe["inherit"]).calibration["compute"]
        for preset in recipe["presets"]:
            mine = load_cluster(preset).calibration["compute"]
            assert {k: mine[k] for k in COMPUTE_FIGURES} == {k: base[k] for k in COMPUTE_FIGURES}, (name, preset)


def test_a_kernel_family_recipe_fits_only_its_figures_and_validate_counts_its_rows_as_fitted():
    """compute-sm90-pytorch fits the GEMM figure of PyTorch's kernels on OLMo-core's rows: the shipped block holds
    that figure and its provenance only (the rest follow the compute block), its rows are not counted as held out,
    and left out with its suite the recipe fits its stand-in instead."""
    from echo_plan.cost.calibration import COMPUTE_INFO

    recipe = recipes()["compute-sm90-pytorch"]
    for preset in recipe["presets"]:
        block = load_cluster(preset).calibration["compute_by_kernels"][recipe["kernels"]]
        assert set(block) - set(COMPUTE_INFO) == set(recipe["fit_figures"]), preset
        named = set(block["fitted_on"][recipe["suite"]])
        assert named and named <= fitted_rows(load_cluster(preset), recipe["suite"])
        assert not set(block["held_out"][recipe["suite"]]) & named
    without = recipes_without(recipes(), recipe["suite"])["compute-sm90-pytorch"]
    assert without["suite"] == recipe["stand_in"]["suite"] and without["kernels"] == recipe["kernels"]
