"""Step times from the frameworks' logs (fixtures written from their documented log lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_plan.errors import EchoPlanError
from echo_plan.interop.launch.logs import read_log_steps

DATA = Path(__file__).parent / "launch_data"


def test_megatron_log_median_after_warm_up():
    steps = read_log_steps((DATA / "megatron_lm_step.log").read_text(), "m.log")
    assert steps.framework == "megatron"
    # iterations 15..35 kept: 7.8123, 7.7901, 7.8059, 9.950 (a slow interval), 7.8004 -> median 7.8059
    assert steps.kept == pytest.approx((7.8123, 7.7901, 7.8059, 9.95, 7.8004))
    assert steps.step_s == pytest.approx(7.8059)


def test_nemo_log():
    steps = read_log_steps((DATA / "nemo_step.log").read_text(), "n.log", skip=9)
    assert steps.framework == "nemo" and steps.kept == pytest.approx((7.82, 7.80, 7.84))
    assert steps.step_s == pytest.approx(7.82)


def test_torchtitan_log_needs_the_jobs_tokens_and_gpus():
    text = (DATA / "torchtitan_step.log").read_text()
    with pytest.raises(EchoPlanError, match="--launch"):
        read_log_steps(text, "t.log")
    steps = read_log_steps(text, "t.log", tokens_per_step=64 * 8192, gpus=8)
    assert steps.framework == "torchtitan"
    assert steps.step_s == pytest.approx(64 * 8192 / (3456 * 8))  # median tps of steps 20, 30, 40


def test_a_warmup_only_log_and_a_log_without_steps_are_one_line_errors():
    with pytest.raises(EchoPlanError, match="warm-up"):
        read_log_steps((DATA / "megatron_lm_step.log").read_text(), "m.log", skip=100)
    with pytest.raises(EchoPlanError, match="no step times"):
        read_log_steps("loading checkpoint...\nhello\n", "x.log")
    with pytest.raises(EchoPlanError, match="--skip-steps"):
        read_log_steps("", "x.log", skip=-1)


@pytest.mark.parametrize("skip", [0, 5, 10, 20])
def test_more_warm_up_skipped_never_keeps_more_steps(skip):
    text = (DATA / "megatron_lm_step.log").read_text()
    fewer = read_log_steps(text, "m.log", skip=skip + 5)
    assert len(fewer.kept) <= len(read_log_steps(text, "m.log", skip=skip).kept)
