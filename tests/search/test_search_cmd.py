"""``echo-plan search`` and ``compare`` end to end with the real simulator on a small model."""

from __future__ import annotations

import csv
import json

import pytest

from echo_plan.cli import main
from echo_plan.search.serialize import compare_from_json, outcome_from_json

SPACE = """
name: tiny
knobs:
  tp: [1, 2, 4]
  pp: [1, 2]
  micro_batch_size: [1, 2]
fixed:
  recompute: selective
  distributed_optimizer: true
"""


@pytest.fixture
def common(tmp_path):
    space = tmp_path / "tiny.yaml"
    space.write_text(SPACE)
    return ["--model", "llama2-7b", "--gbs", "32", "--space", str(space), "--cache-dir", str(tmp_path / "traces"),
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--no-progress"]


def test_search_prints_a_ranked_table_and_writes_csv_and_json(tmp_path, common, capsys):
    out_csv = tmp_path / "out" / "ranked.csv"
    assert main(["search", "--gpus", "8", *common, "--csv", str(out_csv), "--explain"]) == 0
    text = capsys.readouterr().out
    assert "step s" in text and "tokens/s" in text and "MFU" in text
    assert "dominated by" in text
    assert "tp:" in text  # the per-knob-value explanation
    rows = list(csv.DictReader(out_csv.open()))
    assert rows and rows[0]["rank"] == "1"
    steps = [float(r["step_time_s"]) for r in rows]
    assert steps == sorted(steps)

    # the same search again is resumed from storage, and --json gives the SearchOutcome
    assert main(["search", "--gpus", "8", *common, "--json"]) == 0
    outcome = outcome_from_json(json.loads(capsys.readouterr().out))
    assert any("resumed" in n for n in outcome.notes)
    assert outcome.traces_made == 0
    assert [float(r.step_time_s) for r in outcome.ranked] == pytest.approx(steps)


def test_compare_runs_a_search_per_size(tmp_path, common, capsys):
    assert main(["compare", "--gpus", "8,16", *common, "--tokens", "10B", "--price-per-gpu-hour", "2", "--json"]) == 0
    c = compare_from_json(json.loads(capsys.readouterr().out))
    assert [r.num_gpus for r in c.rows] == [8, 16]
    assert c.rows[0].scaling_efficiency == pytest.approx(1.0)
    for row in c.rows:
        assert row.cost == pytest.approx(row.gpu_hours * 2)
        assert row.train_time_s == pytest.approx(10e9 / row.outcome.best.tokens_per_s)


@pytest.mark.parametrize("args, words", [
    (["--sampler", "annealing"], "--sampler"),
    (["--trials", "0"], "--trials"),
    (["--top", "0"], "--top"),
])
def test_bad_options_are_one_line_errors(common, capsys, args, words):
    assert main(["search", "--gpus", "8", *common, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_a_bad_space_file_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("knobs:\n  tp: [1, 2]\n  tensor_parallel: [4]\n")
    assert main(["search", "--space", str(bad), "--storage", "memory"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel" in err and "valid knobs" in err


def test_a_space_no_plan_can_take_says_why(tmp_path, capsys):
    space = tmp_path / "odd.yaml"
    space.write_text("knobs:\n  tp: [3]\n")
    assert main(["search", "--gpus", "8", "--space", str(space), "--storage", "memory", "--explain"]) == 2
    captured = capsys.readouterr()
    assert "tp x cp x pp does not divide the GPUs" in captured.err


def test_an_unreachable_ray_address_fails_fast(common, capsys):
    import time

    t0 = time.perf_counter()
    assert main(["search", "--gpus", "8", *common, "--ray-address", "127.0.0.1:1"]) == 2
    assert time.perf_counter() - t0 < 30
    assert "--ray-address 127.0.0.1:1" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--price-per-gpu-hour", "inf"], "--price-per-gpu-hour inf"),
    (["--tokens", "1e40"], "--tokens '1e40' is more than"),
    (["--gpus", ",".join(str(8 * i) for i in range(1, 100))], "at most 64"),
    (["--gpus", "8,99999999999"], "more than 1,048,576"),
])
def test_compare_refuses_absurd_numbers_before_searching(args, says, capsys):
    assert main(["compare", "--storage", "memory", "--no-progress", *args]) == 2
    err = capsys.readouterr()
    assert says in err.err and err.out == ""


def test_a_search_whose_plans_are_all_too_big_points_at_offloading_the_optimizer(tmp_path, capsys):
    space = tmp_path / "one-server.yaml"
    space.write_text("knobs:\n  tp: [8]\n  recompute: [none, full]\nfixed:\n  sequence_parallel: true\n")
    argv = ["search", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "8", "--gbs", "32", "--space",
            str(space), "--storage", "memory", "--no-progress", "--cache-dir", str(tmp_path / "traces")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--offload-optimizer (the optimizer in CPU memory) may" in err
    assert main(argv + ["--offload-optimizer", "--trials", "2", "--json"]) == 0  # dp 1: the one-rank shard moves
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert ranked and all(r["plan"]["offload_optimizer"] and r["plan"]["distributed_optimizer"] for r in ranked)
    assert all(m["optimizer_bytes"] == 0 < m["host_bytes"] for r in ranked for m in r["memory_per_stage"])
    compare = ["compare" if a == "search" else a for a in argv]
    assert main(compare + ["--offload-optimizer", "--trials", "2", "--json"]) == 0  # compare takes it too
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["num_gpus"] == 8 and all(r["plan"]["offload_optimizer"] for r in row["outcome"]["ranked"])
