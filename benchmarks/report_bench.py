"""Size and opening time of the HTML report for a large study (issue 5: < 10 MB, < 3 s).

    .venv/bin/python benchmarks/report_bench.py                 # a synthetic 2,000-trial study
    .venv/bin/python benchmarks/report_bench.py --source result.json   # or a real saved result / study .db

Prints the render time, the file size, and for each of --runs headless Chromium loads, measured
by the page itself from navigation start in real time: when Plotly had loaded and when every chart
had drawn (the figure held to the limit). The page is opened as ``report.html#sync``, which draws
everything before the load event (where headless Chromium reads the DOM) instead of painting the
text first and drawing chart by chart: the same work, without the yields between charts. The synthetic study follows
tests/report/report_synthetic.py (GPT-3 175B shapes on 96 H800s, a 1F1B timeline of the best plan).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "report"))

SIZE_LIMIT_MB = 10.0
OPEN_LIMIT_S = 3.0


def build_outcome(args):
    if args.source:
        from echo_plan.report.load import load_source

        return load_source(args.source, study_name=args.study_name)
    from report_synthetic import search_outcome

    return search_outcome(args.trials, seed=args.seed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=2000, help="synthetic trials (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--source", help="a saved result .json or a study .db instead of the synthetic study")
    ap.add_argument("--study-name")
    ap.add_argument("--runs", type=int, default=3, help="browser loads to time (default 3)")
    ap.add_argument("--keep", help="also copy the report here")
    args = ap.parse_args()

    from echo_plan.report import browser
    from echo_plan.report.api import make_report

    outcome = build_outcome(args)
    n_trials = len(getattr(outcome, "trials", ())) or sum(len(r.outcome.trials) for r in outcome.rows)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp) / "bench.html"
        t0 = time.perf_counter()
        written = make_report(outcome, out, fill_timeline=bool(args.source))
        render_s = time.perf_counter() - t0
        size_mb = written.size_bytes / 1e6
        best = getattr(outcome, "best", None)
        events = len(best.timeline) if best is not None else 0
        print(f"trials {n_trials}, timeline events {events}")
        print(f"render {render_s:.2f} s, size {size_mb:.2f} MB (limit {SIZE_LIMIT_MB:g} MB)")
        chromium = browser.find_chromium()
        if chromium is None:
            print("chromium not found: load time not measured")
            return 0 if size_mb < SIZE_LIMIT_MB else 1
        empty = Path(tmp) / "empty.html"
        empty.write_text("<!doctype html><html><body>empty</body></html>", encoding="utf-8")
        drawn = []
        for _ in range(args.runs):
            base = browser.load(empty, chromium, budget_ms=None)
            page = browser.load(out, chromium, budget_ms=None, fragment="sync")
            if page.js_errors or page.charts_ready == 0 or page.charts_ms is None:
                print(f"page did not draw: errors {page.js_errors}, charts {page.charts_ready}")
                return 1
            plotly = float(page.body_attr("data-plotly-ms") or "nan") / 1e3
            drawn.append(page.charts_ms / 1e3)
            print(f"  Plotly loaded {plotly:.2f} s, all {page.charts_ready} charts drawn {page.charts_ms / 1e3:.2f} s "
                  f"after navigation; Chromium wall {page.wall_s:.2f} s (empty page {base.wall_s:.2f} s)")
        load = statistics.median(drawn)
        print(f"open (median of {args.runs}): every chart drawn {load:.2f} s after navigation (limit {OPEN_LIMIT_S:g} s)")
        print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        ok = size_mb < SIZE_LIMIT_MB and load < OPEN_LIMIT_S
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
