"""Reports from the real commands: `search --report`, then `report` from the JSON it printed and
from the study it stored, with the real simulator on a small model (llama2-7b on 8 GPUs, a tiny
space: one trace key, so one tracing). `compare --report` goes through the same call."""

import json
import re

import pytest

from echo_plan.cli import main

SPACE = """
name: tiny
knobs:
  pp: [1, 2, 4]
fixed:
  tp: 2
  micro_batch_size: 1
  recompute: selective
  distributed_optimizer: true
"""


def charts(html_text):
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html_text, re.S)
    return {c["id"]: c for c in json.loads(m.group(1))["charts"]}


@pytest.fixture
def common(tmp_path):
    space = tmp_path / "tiny.yaml"
    space.write_text(SPACE)
    return ["--model", "llama2-7b", "--gbs", "16", "--space", str(space), "--cache-dir", str(tmp_path / "traces"),
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--no-progress"]


@pytest.mark.slow
def test_search_report_then_report_from_json_and_from_the_study(tmp_path, common, capsys):
    first = tmp_path / "search.html"
    assert main(["search", "--gpus", "8", *common, "--json", "--report", str(first)]) == 0
    out = capsys.readouterr()
    saved = tmp_path / "result.json"
    saved.write_text(out.out)  # stdout stays pure JSON; the report's path goes to stderr
    assert f"report written: {first}" in out.err
    page = first.read_text(encoding="utf-8")
    best = json.loads(out.out)["ranked"][0]
    assert "chart-timeline" in charts(page)  # the best plan was simulated once with its timeline
    assert "stored result" not in page and "note:" not in out.err  # expected right after a search

    timed = tmp_path / "timed.html"  # from the saved result, the extra simulation is said
    assert main(["report", str(saved), "-o", str(timed)]) == 0
    assert "simulated once more" in timed.read_text(encoding="utf-8")

    again = tmp_path / "again.html"
    assert main(["report", str(saved), "-o", str(again), "--no-simulate"]) == 0
    assert "chart-scatter" in charts(again.read_text(encoding="utf-8"))

    from_study = tmp_path / "study.html"
    assert main(["report", str(tmp_path / "studies.db"), "-o", str(from_study), "--no-simulate"]) == 0
    text = from_study.read_text(encoding="utf-8")
    scatter = charts(text)["chart-scatter"]
    top = [t for t in scatter["data"] if t["name"] == "recommended"][0]
    assert top["y"][0] == pytest.approx(best["tokens_per_s"], rel=1e-4)
    assert "No timeline" in text  # --no-simulate, and studies keep no timelines
    # the search stored its settings with the study, so the report shows its space, not a guess
    assert "not the search&#39;s settings" not in text and "knobs · pp" in text
