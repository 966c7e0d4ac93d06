"""``compare --cluster a,b``: several kinds of cluster side by side (issue 35)."""

from __future__ import annotations

import json

import pytest

from echo_plan.cli import main
from echo_plan.errors import EchoPlanError
from echo_plan.search.compare_cluster import parse_names, parse_prices


def test_prices_are_one_for_all_or_one_per_cluster():
    assert parse_prices(None, ["a", "b"]) == [None, None]
    assert parse_prices("2.5", ["a", "b"]) == [2.5, 2.5]
    assert parse_prices("2,6", ["a", "b"]) == [2.0, 6.0]
    for bad in ("1,2,3", "x", "-1", "0", "inf"):
        with pytest.raises(EchoPlanError, match="--price-per-gpu-hour"):
            parse_prices(bad, ["a", "b"])
    assert parse_names("h800, b200,h800") == ["h800", "b200"]


def _compared(tmp_path, capsys) -> dict:
    """One compare of two cluster types at two sizes (made once: it is the slowest part of this file)."""
    report = tmp_path / "clusters.html"
    args = ["compare", "--model", "gpt-13b", "--cluster", "h800,gb200-nvl72", "--gpus", "16,32", "--gbs", "64",
            "--trials", "4", "--tokens", "10B", "--price-per-gpu-hour", "2,5", "--processes", "1", "--json",
            "--no-progress", "--storage", f"sqlite:///{tmp_path / 's.db'}",
            "--cache-dir", str(tmp_path / "cache"), "--report", str(report)]
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"report written: {report}" in out.err  # stdout carries the JSON alone
    return {**json.loads(out.out), "report": report.read_text(encoding="utf-8")}


def test_every_cluster_and_size_gets_its_best_plan_cost_and_energy_in_one_report(tmp_path, capsys):
    compared = _compared(tmp_path, capsys)
    rows = compared["rows"]
    assert [(r["cluster"], r["num_gpus"]) for r in rows] == [("h800", 16), ("h800", 32), ("gb200-nvl72", 16),
                                                             ("gb200-nvl72", 32)]
    watts = {"h800": 700, "gb200-nvl72": 1200}
    for r in rows:
        assert r["cost"] == pytest.approx(r["gpu_hours"] * r["price_per_gpu_hour"])
        assert r["energy_MWh"] == pytest.approx(r["gpu_hours"] * watts[r["cluster"]] / 1e6)
        assert r["step_time_range_s"][0] <= r["step_time_s"] <= r["step_time_range_s"][1]
    assert {r["calibration"] for r in rows if r["cluster"] == "h800"} == {"calibrated"}
    # the Blackwell preset's figures are the H100's, a prior across generations, and the row says so
    assert all("another GPU generation" in r["calibration"] for r in rows if r["cluster"] == "gb200-nvl72")
    assert "estimate" in compared["energy_note"]
    # the one report holds every cluster and size with its cost
    html = compared["report"]
    assert "Which cluster for gpt-13b: h800, gb200-nvl72" in html
    assert 'id="clusters"' in html and "chart-cluster-throughput" in html and "chart-cluster-cost" in html
    for r in rows:
        assert f"{r['cost']:,.0f}" in html  # each cluster and size's cost, as the table shows it
    assert "another GPU generation" in html and "from dgx-h100 (prior)" in html  # said plainly, and in its cell


def test_a_bad_report_path_or_price_list_is_refused_in_one_line(capsys, tmp_path):
    assert main(["compare", "--cluster", "h800,b200", "--gpus", "16", "--report", str(tmp_path / "r.txt")]) == 2
    err = capsys.readouterr().err
    assert "--report" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "r.txt").exists()
    assert main(["compare", "--cluster", "h800,b200", "--gpus", "16", "--price-per-gpu-hour", "1,2,3"]) == 2
    assert "one per cluster" in capsys.readouterr().err


def test_a_yaml_list_names_the_clusters_and_their_prices(tmp_path, capsys):
    from echo_plan.search.compare_cluster import read_cluster_list

    listed = tmp_path / "clusters.yaml"
    listed.write_text("clusters:\n  - {cluster: h800, price_per_gpu_hour: 2.1}\n  - {cluster: b200}\n")
    assert read_cluster_list(str(listed)) == (["h800", "b200"], [2.1, None])
    assert read_cluster_list("h800") is None
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\n")
    assert read_cluster_list(str(own)) is None  # a cluster file of one's own, not a list
    for bad in ("clusters: []\n", "clusters:\n  - {cluster: h800, price: 2}\n",
                "clusters:\n  - {cluster: h800, price_per_gpu_hour: -1}\n"):
        listed.write_text(bad)
        with pytest.raises(EchoPlanError):
            read_cluster_list(str(listed))
    listed.write_text("clusters:\n  - {cluster: h800, price_per_gpu_hour: 2.1}\n  - {cluster: b200}\n")
    assert main(["compare", "--cluster", str(listed), "--gpus", "16", "--price-per-gpu-hour", "3"]) == 2
    assert "it gives the prices" in capsys.readouterr().err


def test_with_a_pytorch_native_stack_each_cluster_says_whose_figures_time_its_kernels(tmp_path, capsys):
    """h800 carries figures of its own for PyTorch's kernels, gb200-nvl72 does not (its compute figures are the
    H100's Transformer Engine ones, a prior): a side-by-side comparison says so per cluster."""
    args = ["compare", "--model", "gpt-13b", "--cluster", "h800,gb200-nvl72", "--gpus", "16", "--gbs", "64",
            "--stack", "torchtitan", "--trials", "2", "--processes", "1", "--no-progress",
            "--storage", f"sqlite:///{tmp_path / 's.db'}", "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "h800: compute figures for pytorch kernels" in out
    assert "gb200-nvl72: no compute figures of this cluster's for pytorch kernels" in out
