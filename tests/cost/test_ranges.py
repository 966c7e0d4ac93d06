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
