"""The HTML report of a search and of a compare, from synthetic outcomes built in the test."""

import json
import re
from dataclasses import replace

import pytest
from report_synthetic import compare_outcome, search_outcome

from echo_plan.errors import EchoPlanError
from echo_plan.report.plans import short_label
from echo_plan.report.render import render_report, write_report


def charts_of(html: str) -> dict[str, dict]:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert m, "the chart data block is missing"
    return {c["id"]: c for c in json.loads(m.group(1))["charts"]}


@pytest.fixture(scope="module")
def outcome():
    return search_outcome(n_trials=80, seed=3, gbs=256)


@pytest.fixture(scope="module")
def html(outcome):
    return render_report(outcome)


def test_self_contained_with_no_external_resources(html):
    assert html.lstrip().lower().startswith("<!doctype html>")
    assert not re.search(r"<script[^>]+\bsrc=", html, re.I)
    assert not re.search(r"<link[^>]+\bhref=", html, re.I)
    assert "Plotly" in html and len(html) > 3_000_000  # plotly.js is inlined


def test_headline_names_the_best_plan_and_its_numbers(outcome, html):
    best = outcome.best
    head = html[html.index('id="headline"'):html.index('id="ranked"')]
    assert short_label(best.plan) in head
    assert f"{best.mfu:.1%}" in head
    assert "time to train" in head  # the outcome has a token budget
    assert "faster than the runner-up" in head


def test_every_chart_has_an_element_and_data(html):
    charts = charts_of(html)
    assert set(charts) == {"chart-scatter", "chart-breakdown", "chart-timeline", "chart-timeline-window",
                           "chart-memory", "chart-progress", "chart-pruned"}
    for cid, c in charts.items():
        assert f'id="{cid}"' in html
        assert c["data"], cid


def test_scatter_shows_every_distinct_simulated_plan_and_the_capacity_line(outcome, html):
    scatter = charts_of(html)["chart-scatter"]
    distinct = {json.dumps(t.plan, sort_keys=True) for t in outcome.trials if t.result is not None}
    markers = [t for t in scatter["data"] if t["name"].startswith(("fits", "does not fit"))]
    assert sum(len(t["x"]) for t in markers) == len(distinct)
    assert scatter["layout"]["shapes"][0]["x0"] == 80
    best = [t for t in scatter["data"] if t["name"] == "recommended"][0]
    assert best["y"][0] == pytest.approx(outcome.best.tokens_per_s, rel=1e-4)


def test_breakdown_bars_add_up_to_each_step_time(outcome, html):
    bars = charts_of(html)["chart-breakdown"]["data"]
    n = len(bars[0]["x"])
    assert n == min(10, len(outcome.ranked))
    for i in range(n):
        assert sum(t["x"][i] for t in bars) == pytest.approx(outcome.ranked[i].step_time_s, rel=1e-3)


def test_memory_chart_stacks_each_stage_total(outcome, html):
    bars = charts_of(html)["chart-memory"]["data"]
    for stage, mem in enumerate(outcome.best.memory):
        assert sum(t["y"][stage] for t in bars) == pytest.approx(mem.total_bytes / 2**30, rel=1e-3)


def test_ranked_table_is_in_step_time_order_and_marks_differing_knobs(outcome, html):
    table = html[html.index('id="ranked"'):html.index('id="sec-chart-scatter"')]
    headers = re.findall(r"<th[^>]*>(.*?)</th>", table)
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S)[1:]
    assert len(rows) == min(50, len(outcome.ranked))
    assert len(re.findall(r'<tr class="more">', table)) == max(0, len(rows) - 10)  # folded after 10
    col = headers.index("step time")
    steps = [float(re.findall(r'data-sort="([^"]*)"', r)[col]) for r in rows]
    assert steps == sorted(steps) and steps[0] == pytest.approx(outcome.best.step_time_s)
    first_cells = re.findall(r"<td[^>]*>", rows[0])
    assert not any("diff" in c for c in first_cells)  # #1 differs from nothing
    assert any("diff" in c for r in rows[1:] for c in re.findall(r"<td[^>]*>", r))


def test_progress_best_line_never_rises(html):
    line = [t for t in charts_of(html)["chart-progress"]["data"] if t["name"].startswith("best")][0]
    assert all(b <= a for a, b in zip(line["y"], line["y"][1:]))


def test_text_from_the_outcome_is_escaped_and_cannot_close_the_script(outcome):
    evil = "</script><script>alert(1)</script>"
    html = render_report(replace(outcome, model={**outcome.model, "name": evil}, notes=(evil,)))
    assert evil not in html
    charts_of(html)  # the data block still parses


def test_no_fitting_plan_still_gives_a_report(outcome):
    nofit = replace(outcome, ranked=())
    html = render_report(nofit)
    assert "No plan fits" in html
    assert "chart-scatter" in charts_of(html)


def test_missing_timeline_is_said(outcome):
    best = replace(outcome.best, timeline=())
    html = render_report(replace(outcome, ranked=(best, *outcome.ranked[1:])))
    assert "chart-timeline" not in charts_of(html)
    assert "No timeline" in html


def test_compare_report_has_sizes_scaling_and_cost():
    c = compare_outcome(gbs=256)
    html = render_report(c)
    charts = charts_of(html)
    assert {"chart-scaling", "chart-train-cost", "chart-scatter", "chart-timeline"} <= set(charts)
    sizes = html[html.index('id="sizes"'):]
    for row in c.rows:
        assert f'data-sort="{row.num_gpus}"' in sizes
    eff = [t for t in charts["chart-scaling"]["data"] if t["name"].startswith("scaling efficiency")][0]
    assert eff["y"][0] == pytest.approx(100.0)
    assert "Most economical" in html or "most economical" in html


def test_write_report_is_atomic_and_checks_the_suffix(outcome, tmp_path):
    out = write_report(outcome, tmp_path / "sub" / "r.html")
    assert out.read_text(encoding="utf-8").rstrip().endswith("</html>")
    assert [p.name for p in out.parent.iterdir()] == ["r.html"]  # no temporary file left
    with pytest.raises(EchoPlanError, match=r"\.html"):
        write_report(outcome, tmp_path / "r.txt")


def test_knob_value_table_answers_why_a_value_was_never_tried(outcome, html):
    part = html[html.index('id="knob-values"'):html.index('id="inputs"')]
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", part, re.S)[1:]
    tp16 = [r for r in rows if re.match(r'\s*<td data-sort="tp"[^>]*>tp</td><td data-sort="16"', r)]
    assert len(tp16) == 1
    assert 'class="diff"' in tp16[0] and "tp exceeds a node" in tp16[0]  # never simulated, and why
    assert len(rows) == sum(len(v) for v in outcome.pruned_by_knob.values() if len(v) > 1)


def test_empty_search_and_compare_still_render():
    o = search_outcome(10, gbs=256)
    empty = replace(o, trials=(), ranked=(), pruned_counts={"out of memory (estimate)": 50})
    assert "No plan fits" in render_report(empty)
    c = compare_outcome(n_trials=10, gbs=256)
    none_fit = replace(c, rows=tuple(replace(r, outcome=replace(r.outcome, ranked=(), trials=())) for r in c.rows))
    html = render_report(none_fit)
    assert "No plan fits at any size" in html
    assert "no plan fits" in html[html.index('id="sizes"'):]
    with pytest.raises(EchoPlanError, match="no cluster sizes"):
        render_report(replace(c, rows=()))


def test_search_report_has_a_fault_sensitivity_section(tmp_path):
    from echo_plan.report.render import render_report
    from echo_plan.report.sensitivity_view import sensitivity_view
    from echo_plan.specs.faults import FaultKind
    from echo_plan.resilience.sensitivity import SensitivityRow

    outcome = search_outcome(30, seed=1)
    data = [(r.plan, [SensitivityRow(FaultKind.LINK, 0.5, 0.18 - 0.1 * i, 0, 0.02, 1)])
            for i, r in enumerate(outcome.ranked[:2])]
    html = render_report(outcome, sensitivity=sensitivity_view(data))
    assert 'id="fault-sensitivity"' in html and "chart-fault-sensitivity" in html
    assert "loses 18% of its throughput to one NIC at 50% rate; plan #2 loses 8%" in html


def test_report_counts_simulated_trials_as_the_cli_does():
    from echo_plan.search.results import simulated_this_study

    outcome = search_outcome(60, seed=4)
    html = render_report(outcome)
    assert f"{simulated_this_study(outcome.trials)} simulated this study" in html


def test_a_long_step_gets_its_start_at_full_resolution():
    from echo_plan.report.charts_plan import timeline_window_chart

    best = search_outcome(120, seed=5).best
    chart = timeline_window_chart(best)
    assert chart is not None and chart.id == "chart-timeline-window"
    legend = {t["name"] for t in chart.data if t["type"] == "scatter"}
    assert {"forward", "backward", "p2p"} <= legend  # transfers are drawn, not sampled away
    heat = chart.data[0]
    end = max(e.start_s + e.duration_s for e in best.timeline)
    assert heat["x"][-1] < end * (1e3 if heat["x"][-1] < end * 1e3 else 1)  # a window, not the whole step


def test_the_recommended_plan_comes_with_its_launch_configs(outcome, html):
    from echo_plan.report.launch_view import launch_snippets

    snippets = launch_snippets(outcome)
    assert [s.fmt for s in snippets] == ["megatron-lm", "megatron-bridge", "torchtitan"]
    for s in snippets:  # a config to copy, or the one line why not; never both, never neither
        assert bool(s.text) != bool(s.refusal)
        if s.text:
            assert f'data-copy="launch-{s.fmt}"' in html and f'id="launch-{s.fmt}"' in html
        else:
            assert "\n" not in s.refusal and s.refusal.split(":")[0] in html
        assert (s.rank == 1) == (s.passed_over == "")  # a later plan says why the faster ones were passed over
    lm = next(s for s in snippets if s.fmt == "megatron-lm")
    if lm.text:
        shown = outcome.ranked[lm.rank - 1].plan
        assert f"--tensor-model-parallel-size {shown['tp']}" in lm.text
    assert 'href="#launch"' in html


def test_no_launch_card_without_a_recommended_plan(outcome):
    from echo_plan.report.launch_view import launch_snippets

    assert launch_snippets(replace(outcome, ranked=())) == ()


def test_a_plan_megatron_cannot_run_hands_the_card_to_the_next_one(outcome):
    from echo_plan.report.launch_view import launch_snippets

    first = outcome.ranked[0]
    dualpipe = replace(first, plan={**first.plan, "schedule": "dualpipe"})
    snippets = launch_snippets(replace(outcome, ranked=(dualpipe,) + outcome.ranked))
    lm = next(s for s in snippets if s.fmt == "megatron-lm")
    assert lm.rank == 2 and "schedule dualpipe" in lm.passed_over
