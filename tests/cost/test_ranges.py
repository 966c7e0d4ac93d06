"""Prediction ranges: the t interval, its leave-one-out coverage, the cluster's table and fallbacks."""

from __future__ import annotations

import math
import random

import pytest

from echo_plan.cost.ranges import (JUDGEMENT_SD, NOMINAL_COVERAGE, RangeTable, ResidualGroup, loo_coverage,
                                   prediction_range, t90)
from echo_plan.errors import SpecError
from echo_plan.specs import load_cluster, load_stack


def test_t_quantiles_shrink_to_the_normal_one():
    assert t90(1) > t90(4) > t90(11) > t90(200) > 1.28
    with pytest.raises(ValueError):
        t90(0)


def test_the_interval_is_centred_where_the_residuals_say():
    g = ResidualGroup("s", (0.10, 0.12, 0.08, 0.11, 0.09))  # predictions 10% slow
    lo, hi = g.log_interval()
    assert lo < -0.10 < hi and hi < 0  # measured is below predicted
    assert g.log_interval(widen=2.0)[1] - g.log_interval(widen=2.0)[0] == pytest.approx(2 * (hi - lo))


def test_leave_one_out_coverage_is_near_nominal_on_normal_residuals():
    rng = random.Random(7)
    covers = [loo_coverage([rng.gauss(0.02, 0.05) for _ in range(12)]) for _ in range(300)]
    assert abs(sum(covers) / len(covers) - NOMINAL_COVERAGE) < 0.05
    assert loo_coverage([0.1, 0.2]) is None


def test_table_errors_name_the_key():
    for data, needle in (({"by_stack": {"x": {"residuals": []}}}, "residuals"),
                         ({"by_stack": {"x": {"residuals": ["a"]}}}, "numbers"),
                         ({"by_stack": {"x": {"residuals": [9.0]}}}, "between -3 and 3"),
                         ({"nominal_coverage": 0.9}, "nominal_coverage"),
                         ({"colour": 1}, "colour")):
        with pytest.raises(SpecError, match=needle):
            RangeTable.from_mapping(data)


def test_the_range_falls_back_and_says_so():
    h100 = load_cluster("dgx-h100")
    own = prediction_range(h100, load_stack())
    assert own.low_factor < 1.0 < own.high_factor and "held-out validation rows of stack megatron-core" in own.basis
    other = prediction_range(h100, load_stack("megatron-lm-2021"))
    assert "widened" in other.basis and (other.high_factor - other.low_factor) > (own.high_factor - own.low_factor)
    bare = h100.replace(calibration={})
    guess = prediction_range(bare, load_stack())
    assert "judgement" in guess.basis and guess.high_factor == pytest.approx(math.exp(JUDGEMENT_SD * 1.2816))


def test_a_derived_stack_uses_its_base_presets_rows(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: megatron-core\nhidden_dropout: 0.1\n")
    r = prediction_range(load_cluster("h800"), load_stack(str(f)))
    assert "stack megatron-core" in r.basis and "widened" not in r.basis


def _with_moe_fit(cluster, errors: dict, range_rows: list, stack: str = "megatron-core"):
    cal = dict(cluster.calibration or {})
    nccl = dict(cal.get("nccl") or {})
    prov = dict(nccl.get("provenance") or {})
    prov["all_to_all_fit"] = {"fitted_on": {"moe_suite": ["a"]}, "residuals": errors, "range_rows": range_rows,
                              "stack": stack}
    cal["nccl"] = {**nccl, "provenance": prov}
    return cluster.replace(calibration=cal)


def test_an_moe_prediction_takes_the_held_out_moe_runs_range():
    """MoE runs the dense rows never saw decide an MoE prediction's range: 30% fast held-out runs put the
    measured step above the prediction; a dense model on the same cluster keeps the dense rows' range."""
    h100 = load_cluster("dgx-h100")
    cluster = _with_moe_fit(h100, {"a": 0.0, "b": -0.30, "c": -0.31, "d": -0.05, "e": 0.9},
                            ["b", "c", "d"])  # "a" was fitted, "e" is an fp8 row the ranges leave out
    moe = prediction_range(cluster, load_stack(), moe=True)
    assert "3 held-out mixture-of-experts validation rows" in moe.basis
    assert moe.low_factor < 1.0 < moe.high_factor and math.sqrt(moe.low_factor * moe.high_factor) > 1.2
    assert prediction_range(cluster, load_stack()) == prediction_range(h100, load_stack())
    other = prediction_range(cluster, load_stack("megatron-lm-2021"), moe=True)  # not the suite's stack
    assert "no mixture-of-experts validation rows" in other.basis and "widened" in other.basis
    assert "no mixture-of-experts validation rows" in prediction_range(h100.replace(calibration={}), load_stack(),
                                                                       moe=True).basis


def test_shipped_moe_ranges_come_from_held_out_bf16_rows():
    from echo_plan.cost.ranges import moe_residuals

    fit = load_cluster("dgx-h100").calibration["nccl"]["provenance"]["all_to_all_fit"]
    group = moe_residuals(load_cluster("dgx-h100").calibration)
    assert group is not None and set(group.rows) <= set(fit["held_out"])
    assert not any("fp8" in r for r in group.rows) and not set(group.rows) & set(fit["fitted_on"]["moe_h100"])
