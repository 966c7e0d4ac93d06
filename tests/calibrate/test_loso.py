"""Leave-one-suite-out (issue 31): which recipes a left-out suite takes away, and how the ranges pool."""

from __future__ import annotations

import math

import pytest

from echo_plan.calibrate.loso import (LosoRow, LosoSuite, carried, fed_by, family, gpu_keys, overall, pooled_ranges,
                                     transfer_group, with_coverage)
from echo_plan.calibrate.preset_files import recipes, recipes_without
from echo_plan.cost.ranges import RangeMethod
from echo_plan.specs import load_cluster, load_stack


def test_a_left_out_suite_takes_its_recipes_with_it_or_hands_them_to_its_stand_in():
    every = recipes()
    without_nemo = recipes_without(every, "nemo_h100_dgxc")
    assert without_nemo["compute-sm90"]["suite"] == "long_context_h100"  # its stand-in, by the same rule
    assert "all-to-all-sm90" in without_nemo
    assert "compute-sm80" not in recipes_without(every, "megatron_weak_scaling_a100")  # no other A100 suite
    assert "all-to-all-sm90" not in recipes_without(every, "moe_h100")
    assert recipes_without(every, "long_context_h100") == every  # it fed nothing
    assert fed_by("long_context_h100") == [] and fed_by("moe_h100") == ["all-to-all-sm90"]
    assert family("h800") == family("dgx-h100") == family("h100-800g") == {"dgx-h100", "h800", "h100-800g"}
    assert fed_by("moe_b200") == ["host-issue-x86"]  # the host's issue time: no stand-in, dropped with its suite
    assert "host-issue-x86" not in recipes_without(every, "moe_b200") and "host-issue-x86" in without_nemo


def test_the_rows_the_host_time_was_fitted_on_are_not_held_out():
    from echo_plan.specs import load_cluster
    from echo_plan.validation.suites import fitted_rows

    fitted = recipes()["host-issue-x86"]["fit_rows"]
    for preset in recipes()["host-issue-x86"]["presets"]:
        assert set(fitted) <= fitted_rows(load_cluster(preset), "moe_b200")
    assert fitted_rows(load_cluster("gb200-nvl72"), "moe_b200") == set()  # no host figure there


def _suite(name, residuals, cluster="dgx-h100", moe=False, stack="megatron-core"):
    s = load_stack(stack)
    rows = tuple(LosoRow(f"r{i}", s, moe, math.exp(r) - 1, r) for i, r in enumerate(residuals))
    return LosoSuite(name, cluster, family(cluster), "test", rows)


def test_the_ranges_pool_other_suites_of_the_generation_dense_and_moe_apart():
    a = _suite("a", [0.02, -0.03, 0.01])
    b = _suite("b", [0.05, 0.06])
    m = _suite("m", [-0.3, 0.2], moe=True)
    elsewhere = _suite("x", [0.5, 0.5], cluster="dgx-a100", stack="megatron-lm-2021")
    table = pooled_ranges([a, b, m, elsewhere], family("h800"))
    assert table.method is RangeMethod.LEAVE_ONE_SUITE_OUT
    assert table.groups["megatron-core"].n == 5 and table.moe_groups["megatron-core"].n == 2
    assert "megatron-lm-2021" not in table.groups  # another GPU generation's rows stay out
    assert pooled_ranges([a, b, m], family("h800"), leave_out="b").groups["megatron-core"].n == 3


def test_a_suite_is_covered_by_the_range_of_the_others_only():
    """A suite far from the others falls outside their range; the overall share counts every row."""
    near = _suite("near", [0.01, -0.01, 0.02, 0.0])
    also = _suite("also", [0.0, 0.015, -0.02])
    far = _suite("far", [0.4, 0.45])
    marked = {s.name: s for s in with_coverage([near, also, far])}
    assert marked["far"].coverage == 0.0 and marked["near"].coverage == 1.0
    o = overall(marked.values())
    assert o.rows == 9 and o.coverage == pytest.approx(7 / 9)
    assert overall(marked.values(), skip=["far"]).coverage == 1.0


def test_a_suite_whose_gpu_no_sibling_ran_is_carried_and_pools_into_the_transfer_group():
    """A GPU whose calibration's other suites all ran on another GPU (h100-gt alone in its family; gb200 beside b200
    runs) is in a user's position with a GPU of their own: its rows form the transfer group, never a suite with a
    sibling on its own GPU (two H100 suites); the group leaves the left-out suite out."""
    h1, h2 = _suite("h1", [0.01, 0.02]), _suite("h2", [-0.01, 0.0])
    gt = _suite("gt", [-0.2, -0.25, -0.15], cluster="h100-gt")
    gb = _suite("gb", [-0.1, -0.12], cluster="gb200-nvl72")
    b2 = _suite("b2", [0.03], cluster="b200")
    moe = _suite("moe", [0.4], cluster="h100-gt", moe=True)  # MoE rows never make a GPU "ran"
    suites = [h1, h2, gt, gb, b2, moe]
    keys = gpu_keys(suites)
    assert {s.name for s in carried(suites, keys)} == {"gt", "gb", "b2"}
    group = transfer_group(suites, keys)
    assert len(group["residuals"]) == 6 and all(not label.startswith("h") for label in group["rows"])
    assert len(transfer_group(suites, keys, leave_out="gt")["residuals"]) == 3
    table = pooled_ranges(suites, family("dgx-h100"), keys=keys)
    assert table.gpus == (load_cluster("dgx-h100").gpu.compute_key,) and table.transfer.n == 6


def test_a_left_out_suite_on_a_gpu_of_its_own_is_covered_by_the_transfer_range():
    """With its own GPU's rows gone, a suite is judged by the range of calibrations carried to another GPU (wide
    when those were far off), not by the other GPU's narrow one."""
    h1, h2 = _suite("h1", [0.005, -0.005, 0.0]), _suite("h2", [0.02, -0.02, 0.01])
    gt = _suite("gt", [-0.2, -0.22, -0.18], cluster="h100-gt")
    gb = _suite("gb", [-0.21, -0.19, -0.2], cluster="gb200-nvl72")
    marked = {s.name: s for s in with_coverage([h1, h2, gt, gb])}
    assert marked["gt"].coverage == 1.0 and marked["gb"].coverage == 1.0
    assert marked["h1"].coverage == 1.0  # its own GPU's sibling gives the narrow range
