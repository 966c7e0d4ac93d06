"""The ranges section of a cluster's calibration: the t quantiles, a residual group's interval by the table's
method, and the one-line errors that name the bad key."""

from __future__ import annotations

import pytest

from echo_plan.errors import SpecError
from echo_plan.specs.calibration_ranges import RangeTable, ResidualGroup, t90


def test_t_quantiles_shrink_to_the_normal_one():
    assert t90(1) > t90(4) > t90(11) > t90(200) > 1.28
    with pytest.raises(ValueError):
        t90(0)


def test_the_interval_is_centred_where_the_residuals_say():
    g = ResidualGroup("s", (0.10, 0.12, 0.08, 0.11, 0.09))  # predictions 10% slow
    lo, hi = g.log_interval()
    assert lo < -0.10 < hi and hi < 0  # measured is below predicted
    assert g.log_interval(widen=2.0)[1] - g.log_interval(widen=2.0)[0] == pytest.approx(2 * (hi - lo))


def test_table_errors_name_the_key():
    for data, needle in (({"by_stack": {"x": {"residuals": []}}}, "residuals"),
                         ({"by_stack": {"x": {"residuals": ["a"]}}}, "numbers"),
                         ({"by_stack": {"x": {"residuals": [9.0]}}}, "between -3 and 3"),
                         ({"nominal_coverage": 0.9}, "nominal_coverage"),
                         ({"colour": 1}, "colour")):
        with pytest.raises(SpecError, match=needle):
            RangeTable.from_mapping(data)


def test_a_leave_one_suite_out_range_is_centred_on_the_prediction_and_counts_bias_as_spread():
    """Another suite's bias is not this one's: a leave-one-suite-out table does not shift the range by
    the residuals' mean (the held-out-rows table does), and a larger common bias widens it."""
    res = [0.05, 0.06, 0.04, 0.05, 0.07, 0.03]
    held = RangeTable.from_mapping({"by_stack": {"s": {"residuals": res}}})
    loso = RangeTable.from_mapping({"method": "leave-one-suite-out", "by_stack": {"s": {"residuals": res}}})
    lo, hi = held.log_interval(held.groups["s"])
    assert hi < 0  # centred where the rows say: measured below predicted
    lo2, hi2 = loso.log_interval(loso.groups["s"])
    assert lo2 == pytest.approx(-hi2) and lo2 < -0.07 and hi2 > 0.07
    more = RangeTable.from_mapping({"method": "leave-one-suite-out",
                                    "by_stack": {"s": {"residuals": [r + 0.05 for r in res]}}})
    assert more.log_interval(more.groups["s"])[1] > hi2
    with pytest.raises(SpecError, match="method"):
        RangeTable.from_mapping({"method": "by eye", "by_stack": {}})
