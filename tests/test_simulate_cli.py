"""``echo-plan simulate``: JSON keys, table, trace file, and one-line errors."""

from __future__ import annotations

import json

import pytest

from echo_plan.cli import main

BASE = ["simulate", "--model", "gpt-13b", "--cluster", "h800", "--gpus", "32", "--tp", "8", "--pp", "2",
        "--mbs", "1", "--gbs", "16"]


@pytest.fixture()
def cache_args(tmp_path_factory):
    return ["--cache-dir", str(tmp_path_factory.getbasetemp() / "cli-traces")]


def test_json_has_the_issue_keys(capsys, cache_args):
    assert main(BASE + ["--json", "--sequence-parallel", "--recompute", "selective"] + cache_args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
                "memory_peak_gib", "fits", "breakdown"):
        assert key in out
    assert out["plan"]["dp"] == 2  # 32 GPUs / (8 x 2)
    assert set(out["breakdown"]) == {"compute", "tp_comm_exposed", "ep_comm_exposed", "host_exposed", "pp_comm_exposed",
                                     "dp_comm_exposed", "bubble", "interference", "optimizer"}
    assert out["breakdown"]["ep_comm_exposed"] == 0.0  # a dense model has no expert exchange
    assert sum(out["breakdown"].values()) == pytest.approx(out["step_time_s"], rel=1e-9)


def test_vpp_implies_interleaved_and_trace_is_written(capsys, tmp_path, cache_args):
    trace = tmp_path / "step.json"
    assert main(BASE + ["--vpp", "2", "--json", "--trace", str(trace)] + cache_args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["schedule"] == "interleaved"
    data = json.loads(trace.read_text())
    assert any(e["ph"] == "X" and e["name"].startswith("F mb0 chunk1") for e in data["traceEvents"])
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_table_shows_memory_and_overflow(capsys, cache_args):
    args = ["simulate", "--model", "gpt3-175b", "--cluster", "h800", "--gpus", "8", "--tp", "8", "--mbs", "1",
            "--gbs", "1", "--no-interference"]
    assert main(args + cache_args) == 0
    out = capsys.readouterr().out
    assert "Memory per pipeline stage" in out and "NO" in out and "over the usable memory" in out
    assert "GiB headroom" in out  # what "usable" leaves out is said


@pytest.mark.parametrize("extra", [
    ["--tp", "3"],  # 32 GPUs are not a multiple of 3 x 2
    ["--dp", "4"],  # 8 x 2 x 4 != 32
    ["--layer-split", "20,x"],
    ["--schedule", "sideways"],
    ["--interference", "no-such-file.yaml"],
    ["--cp", "0"],
    ["--cp", "3"],  # 32 GPUs are not a multiple of 8 x 3 x 2
    ["--cp", "2", "--seq-length", "2050"],  # 2050 tokens do not split into 4 equal chunks
    ["--seq-length", "0"],
])
def test_bad_input_is_one_line_and_exit_2(capsys, extra, cache_args):
    assert main(BASE + extra + cache_args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_cp_plan_reports_its_layout(capsys, cache_args):
    args = ["simulate", "--model", "llama3-8b", "--cluster", "h800", "--gpus", "8", "--tp", "2", "--cp", "2",
            "--seq-length", "4096", "--gbs", "4", "--sequence-parallel", "--json"]
    assert main(args + cache_args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["cp"] == 2 and out["plan"]["dp"] == 2 and out["step_time_s"] > 0
    assert main(args[:-1] + cache_args) == 0  # the table's plan line names every degree the GPUs multiply to
    assert "tp2 cp2 pp1 dp2 " in capsys.readouterr().out
