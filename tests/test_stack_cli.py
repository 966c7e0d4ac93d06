"""The stack, the range and the memory headroom as a user meets them on the command line."""

from __future__ import annotations

import json

import pytest

from echo_plan.cli import main

SIM = ["simulate", "-m", "llama2-7b", "-c", "h800", "--gpus", "16", "--tp", "2", "--pp", "2", "--gbs", "32"]


def run_json(args, capsys, tmp_path):
    assert main(args + ["--json", "--cache-dir", str(tmp_path / "c")]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_carries_the_range_the_stack_and_the_headroom(tmp_path, capsys):
    out = run_json(SIM, capsys, tmp_path)
    lo, hi = out["step_time_range_s"]
    assert lo < out["step_time_s"] * 1.2 and hi > out["step_time_s"] * 0.8 and lo < hi
    t_lo, t_hi = out["tokens_per_s_range"]
    assert t_lo == pytest.approx(out["tokens_per_s"] * out["step_time_s"] / hi)
    assert out["range_coverage"] == 0.8 and "leave-one-suite-out" in out["range_basis"] and out["stack"] == "megatron-core"
    assert all(m["headroom_gib"] == pytest.approx(0.02 * 80) for m in out["memory_per_stage"])  # memory.yaml


def test_more_headroom_can_turn_a_fitting_plan_away(tmp_path, capsys):
    base = run_json(SIM, capsys, tmp_path)
    free = min(m["free_gib"] for m in base["memory_per_stage"])
    tight = run_json(SIM + ["--memory-headroom", f"{free + 1:.1f}GiB"], capsys, tmp_path)
    assert base["fits"] and not tight["fits"] and tight["step_time_s"] == base["step_time_s"]
    share = run_json(SIM + ["--memory-headroom", "0%"], capsys, tmp_path)
    assert all(m["headroom_gib"] == 0 for m in share["memory_per_stage"])


@pytest.mark.parametrize("value,needle", [("8", "needs a unit"), ("100%", "[0%, 100%)"), ("90GiB", "below 80"),
                                          ("-5%", "[0%, 100%)"), ("lots", "memory-headroom")])
def test_bad_headroom_is_one_line(value, needle, capsys):
    assert main(SIM + ["--memory-headroom", value]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_a_stack_changes_the_prediction_and_unknown_ones_are_named(tmp_path, capsys):
    core = run_json(SIM + ["--sequence-parallel"], capsys, tmp_path)
    drop = tmp_path / "dropout.yaml"
    drop.write_text("base: megatron-core\nhidden_dropout: 0.1\nattention_dropout: 0.1\n")
    dropped = run_json(SIM + ["--sequence-parallel", "--stack", str(drop)], capsys, tmp_path)
    assert dropped["step_time_s"] > core["step_time_s"] and dropped["stack"] == "dropout"
    assert main(SIM + ["--stack", "megatron-9"]) == 2
    assert "megatron-core" in capsys.readouterr().err  # the known stacks are listed
    assert main(SIM + ["--stack", "megatron-lm-2021", "--sequence-parallel"]) == 2
    assert "no sequence parallelism" in capsys.readouterr().err


def test_presets_lists_the_stacks(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "megatron-core" in out and "megatron-lm-2021" in out
