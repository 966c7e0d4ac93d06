"""Prediction ranges: the t interval, its leave-one-out coverage, the cluster's table and fallbacks."""

from __future__ import annotations

import math
import random

import pytest

from echo_plan.cost.ranges import JUDGEMENT_SD, NOMINAL_COVERAGE, RangeTable, loo_coverage, prediction_range
from echo_plan.errors import SpecError
from echo_plan.specs import load_cluster, load_stack


def test_leave_one_out_coverage_is_near_nominal_on_normal_residuals():
    rng = random.Random(7)
    covers = [loo_coverage([rng.gauss(0.02, 0.05) for _ in range(12)]) for _ in range(300)]
    assert abs(sum(covers) / len(covers) - NOMINAL_COVERAGE) < 0.05
    assert loo_coverage([0.1, 0.2]) is None


def test_the_range_falls_back_and_says_so():
    h100 = load_cluster("dgx-h100")
    own = prediction_range(h100, load_stack())
    assert own.low_factor < 1.0 < own.high_factor and "validation rows of stack megatron-core" in own.basis
    other = prediction_range(h100, load_stack("megatron-lm-2021"))
    assert "widened" in other.basis and (other.high_factor - other.low_factor) > (own.high_factor - own.low_factor)
    bare = h100.replace(calibration={})
    guess = prediction_range(bare, load_stack())
    assert "judgement" in guess.basis and guess.high_factor == pytest.approx(math.exp(JUDGEMENT_SD * 1.2816))


def test_a_stack_without_rows_borrows_those_of_its_kernel_family_first():
    """torchtitan has no rows of its own on dgx-h100; OLMo-core's and fms-fsdp's (PyTorch's kernels, like
    torchtitan's) are nearer its errors than Megatron-Core's, which has more rows; a stack of NVIDIA's kernels
    without rows of its own borrows the largest group of its own family."""
    h100 = load_cluster("dgx-h100")
    groups = RangeTable.from_mapping(h100.calibration["ranges"]).groups
    assert "torchtitan" not in groups and groups["megatron-core"].n > groups["olmo-core"].n > groups["fms-fsdp"].n
    kin = prediction_range(h100, load_stack("torchtitan"))
    assert "rows of stack olmo-core, whose kernels are the same family (pytorch)" in kin.basis and "widened" in kin.basis
    other = prediction_range(h100, load_stack("megatron-lm-2021"))
    assert "rows of stack megatron-core, whose kernels are the same family (nvidia)" in other.basis


def test_a_derived_stack_uses_its_base_presets_rows(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: megatron-core\nhidden_dropout: 0.1\n")
    r = prediction_range(load_cluster("h800"), load_stack(str(f)))
    assert "stack megatron-core" in r.basis and "widened" not in r.basis


def _with_moe_rows(cluster, residuals: list, stack: str = "megatron-core"):
    cal = dict(cluster.calibration or {})
    ranges = dict(cal.get("ranges") or {"nominal_coverage": NOMINAL_COVERAGE})
    ranges["moe_by_stack"] = {stack: {"residuals": residuals, "rows": [f"r{i}" for i in range(len(residuals))],
                                      "source": "moe suite"}}
    cal["ranges"] = ranges
    return cluster.replace(calibration=cal)


def test_an_moe_prediction_takes_the_moe_runs_range():
    """MoE runs decide an MoE prediction's range: 30% fast runs widen it well past the dense rows' range; a
    dense model on the same cluster keeps the dense rows' range."""
    h100 = load_cluster("dgx-h100")
    cluster = _with_moe_rows(h100, [-0.30, -0.31, -0.05, 0.02])
    moe = prediction_range(cluster, load_stack(), moe=True)
    assert "4 mixture-of-experts validation rows" in moe.basis
    dense = prediction_range(h100, load_stack())
    assert moe.low_factor < dense.low_factor and moe.high_factor > dense.high_factor > 1.0
    assert prediction_range(cluster, load_stack()) == dense
    other = prediction_range(cluster, load_stack("megatron-lm-2021"), moe=True)  # not the rows' stack
    assert "no mixture-of-experts validation rows" in other.basis and "widened" in other.basis
    assert "no mixture-of-experts validation rows" in prediction_range(h100.replace(calibration={}), load_stack(),
                                                                       moe=True).basis


def test_the_shipped_ranges_are_leave_one_suite_out_and_say_so():
    from echo_plan.cost.ranges import RangeMethod, moe_residuals

    for name in ("dgx-h100", "h800", "dgx-a100"):
        cal = load_cluster(name).calibration
        assert RangeTable.from_mapping(cal["ranges"]).method is RangeMethod.LEAVE_ONE_SUITE_OUT
        assert "leave-one-suite-out" in prediction_range(load_cluster(name), load_stack(
            "megatron-lm-2021" if "a100" in name else "megatron-core")).basis
    groups = moe_residuals(load_cluster("dgx-h100").calibration)
    assert set(groups) == {"megatron-core", "automodel"}  # each stack's MoE rows range its own predictions
    assert all(r.startswith(("moe_h100: ", "moe_h100_bridge: ")) for r in groups["megatron-core"].rows)
    assert all(r.startswith("automodel_h100: ") for r in groups["automodel"].rows)
    # Blackwell MoE predictions: from the MoE runs of the same die, not the H100's
    for name, suites in (("gb200-nvl72", ("moe_gb200", "moe_b200")), ("b200", ("moe_gb200", "moe_b200")),
                         ("gb300-nvl72", ("moe_gb300", "moe_b300")), ("b300", ("moe_gb300", "moe_b300"))):
        groups = moe_residuals(load_cluster(name).calibration)
        assert {r.split(":")[0] for r in groups["megatron-core"].rows} == set(suites)
        basis = prediction_range(load_cluster(name), load_stack("megatron-core"), moe=True).basis
        assert "mixture-of-experts validation rows" in basis and all(s in basis for s in suites)


def _table(**extra):
    return RangeTable.from_mapping({"nominal_coverage": NOMINAL_COVERAGE, "method": "leave-one-suite-out",
                                    "by_stack": {"megatron-core": {"residuals": [0.01, -0.02, 0.015, 0.0]}}, **extra})


def test_a_gpu_no_row_ran_on_takes_the_range_of_calibrations_carried_to_another_gpu():
    """The table's dense rows ran on H100 SXM: H800 (the same compute key) keeps their range; H200 (more memory
    bandwidth) and Grand Teton's 500 W H100 take the transfer group's, and say why; without a transfer group the
    range is the table's, as before."""
    h100, h800, h200, gt = (load_cluster(n) for n in ("dgx-h100", "h800", "h200", "h100-gt"))
    assert h100.gpu.compute_key == h800.gpu.compute_key
    assert len({h100.gpu.compute_key, h200.gpu.compute_key, gt.gpu.compute_key}) == 3
    transfer = {"residuals": [-0.2, 0.15, -0.25, 0.1, -0.18], "source": "carried"}
    table = _table(gpus=[h100.gpu.compute_key], transfer=transfer).as_json()
    stack = load_stack("megatron-core")
    own = prediction_range(h800.replace(calibration={"ranges": table}), stack)
    for other in (h200, gt):
        far = prediction_range(other.replace(calibration={"ranges": table}), stack)
        assert math.log(far.high_factor / far.low_factor) > 2 * math.log(own.high_factor / own.low_factor)
        assert "no validation run on this GPU" in far.basis and "carried" in far.basis
    assert "no validation run" not in own.basis
    plain = prediction_range(h200.replace(calibration={"ranges": _table(gpus=[h100.gpu.compute_key]).as_json()}), stack)
    assert plain.high_factor == pytest.approx(own.high_factor)


def test_the_gpus_and_transfer_keys_are_checked():
    with pytest.raises(SpecError, match="gpus"):
        _table(gpus="H100")
    with pytest.raises(SpecError, match="transfer"):
        _table(transfer={"residuals": []})
    t = _table(gpus=["k"], transfer={"residuals": [0.1, 0.2]})
    assert RangeTable.from_mapping(t.as_json()) == t


def test_the_shipped_presets_say_which_gpus_their_ranges_ran_on():
    """As shipped: H800 shares the H100 rows' GPU and keeps their range; H200 (the H100's calibration by `from`)
    and B300 (no dense B300 run) get the transfer range, wider, and say so."""
    stack = load_stack("megatron-core")
    h800, h200, b300 = (prediction_range(load_cluster(n), stack) for n in ("h800", "h200", "b300"))
    assert "no validation run on this GPU" not in h800.basis
    for r in (h200, b300):
        assert "no validation run on this GPU" in r.basis
        assert math.log(r.high_factor / r.low_factor) > math.log(h800.high_factor / h800.low_factor)
