"""Leave-one-suite-out (issue 31): which recipes a left-out suite takes away, and how the ranges pool."""

from __future__ import annotations

import math

import pytest

from echo_plan.calibrate.loso import LosoRow, LosoSuite, fed_by, family, overall, pooled_ranges, with_coverage
from echo_plan.calibrate.preset_files import recipes, recipes_without
from echo_plan.cost.ranges import RangeMethod
from echo_plan.specs import load_stack


def test_a_left_out_suite_takes_its_recipes_with_it_or_hands_them_to_its_stand_in():
    every = recipes()
    without_nemo = recipes_without(every, "nemo_h100_dgxc")
    assert without_nemo["compute-sm90"]["suite"] == "long_context_h100"  # its stand-in, by the same rule
    assert "all-to-all-sm90" in without_nemo
    assert "compute-sm80" not in recipes_without(every, "megatron_weak_scaling_a100")  # no other A100 suite
    assert "all-to-all-sm90" not in recipes_without(every, "moe_h100")
    assert recipes_without(every, "long_context_h100") == every  # it fed nothing
    assert fed_by("long_context_h100") == [] and fed_by("moe_h100") == ["all-to-all-sm90"]
    assert family("h800") == family("dgx-h100") == {"dgx-h100", "h800"}
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
