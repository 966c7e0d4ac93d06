"""The report as a person sees it: headless Chromium loads it from disk, the charts draw, no errors,
and the page is laid out right (every report kind: search, compare, sparsify, whatif, and a search
of an MoE model with its fault section).

Skipped where Chromium is missing (``.ci/run`` installs Debian's ``chromium``).
"""

import re
import struct

import pytest
import yaml
from report_synthetic import compare_outcome, search_outcome

from echo_plan.cli import main
from echo_plan.report import browser
from echo_plan.report.cluster_compare_page import write_cluster_compare_report
from echo_plan.report.render import write_report

CHROMIUM = browser.find_chromium()
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"),
]


def png_size(path):
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def check_drawn(load, expected_charts):
    assert load.js_errors == [], load.js_errors
    assert load.console == (), load.console
    assert load.charts_ready == expected_charts
    assert load.plots_drawn == expected_charts
    # Plotly drew SVG with data in it: scatter points, bars, the heatmap image
    assert load.dom.count('class="main-svg"') >= expected_charts
    assert re.search(r'class="point"', load.dom)
    assert "<image" in load.dom  # the timeline raster


def test_search_report_loads_draws_and_screenshots(tmp_path):
    html = write_report(search_outcome(120, seed=5), tmp_path / "search.html")
    png = tmp_path / "search.png"
    load = browser.load(html, CHROMIUM, screenshot_to=png, window=(1280, 1600), profile_root=tmp_path)
    check_drawn(load, 7)  # the timeline, its full-resolution start, and the rest
    assert "tp" in re.search(r'<div class="plan">(.*?)</div>', load.dom).group(1)
    assert png_size(png) == (1280, 1600)
    assert png.stat().st_size > 50_000  # a drawn page, not a blank one


def test_compare_report_loads_and_draws_before_load_in_sync_mode(tmp_path):
    html = write_report(compare_outcome(n_trials=30), tmp_path / "compare.html")
    # report.html#sync (the benchmark's timing mode) draws everything before the load event, where
    # headless Chromium reads the DOM in real time (no virtual time)
    load = browser.load(html, CHROMIUM, budget_ms=None, fragment="sync", profile_root=tmp_path)
    check_drawn(load, 9)
    assert 0 < float(load.body_attr("data-plotly-ms")) <= load.charts_ms
    assert 'id="sizes"' in load.dom


def test_a_script_error_is_caught_and_reported(tmp_path):
    html = write_report(search_outcome(20, seed=2), tmp_path / "broken.html")
    text = html.read_text(encoding="utf-8")
    html.write_text(text.replace('var payload = JSON.parse(', 'var payload = JSON.parse("{" + ', 1), encoding="utf-8")
    load = browser.load(html, CHROMIUM, profile_root=tmp_path)
    assert load.js_errors and "JSON" in " ".join(load.js_errors)
    assert load.charts_ready == 0


def synthetic_sensitivity(outcome):
    from echo_plan.report.sensitivity_view import sensitivity_view
    from echo_plan.specs.faults import FaultKind
    from echo_plan.resilience.sensitivity import SensitivityRow

    data = [(r.plan, [SensitivityRow(FaultKind.STRAGGLER, 1.25, 0.2 - 0.02 * i, 1, 0.1, 0),
                      SensitivityRow(FaultKind.LINK, 0.5, 0.05 + 0.01 * i, 0, 0.01, 1)])
            for i, r in enumerate(outcome.ranked[:3])]
    return sensitivity_view(data)


def test_search_report_with_fault_sensitivity_draws_it(tmp_path):
    outcome = search_outcome(40, seed=2)
    html = write_report(outcome, tmp_path / "faults.html", sensitivity=synthetic_sensitivity(outcome))
    load = browser.load(html, CHROMIUM, profile_root=tmp_path)
    check_drawn(load, 8)
    assert 'id="fault-sensitivity"' in load.dom and "loses 20% of its throughput" in load.dom


# ---- layout: every report kind, and the probe's own faults ----------------------------------------

SMALL_MOE = dict(name="small-moe", num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=4,
                 vocab_size=4096, seq_length=512, activation="swiglu", norm="rmsnorm", position_embedding="rotary",
                 ffn_hidden_size=1024, tied_embeddings=False,
                 moe=dict(num_experts=16, top_k=2, expert_ffn_hidden_size=256, first_dense_layers=1))


def _cli_report(tmp, name, argv):
    out = tmp / f"{name}.html"
    assert main([*argv, "--report", str(out), "--cache-dir", str(tmp / "cache")]) == 0
    return out


def synthetic_cluster_comparison():
    """Four kinds of cluster compared at two sizes, 48 and 96 GPUs (synthetic compares stand in for their searches)."""
    from echo_plan.search.compare_cluster import ClusterComparison

    kinds = (("h800", 700, 2.0, "calibrated"), ("h200", 700, 3.0, "calibrated"),
             ("b200", 1000, 4.5, "calibration inherited from dgx-h100 (another GPU generation)"),
             ("gb200-nvl72", 1200, 5.5, "calibration inherited from dgx-h100 (another GPU generation)"))
    return ClusterComparison(tuple((name, compare_outcome(nodes=(6, 12), n_trials=20 + k), price, watts, status)
                                   for k, (name, watts, price, status) in enumerate(kinds)))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One report of each kind, made as a user makes them (the synthetic search and compare outcomes
    stand in for long searches)."""
    tmp = tmp_path_factory.mktemp("reports")
    outcome = search_outcome(40, seed=2)
    model = tmp / "small-moe.yaml"
    model.write_text(yaml.safe_dump(SMALL_MOE))
    return {
        "search": write_report(search_outcome(120, seed=5), tmp / "search.html"),
        "search-faults": write_report(outcome, tmp / "faults.html", sensitivity=synthetic_sensitivity(outcome)),
        "compare": write_report(compare_outcome(n_trials=30), tmp / "compare.html"),
        "clusters": write_cluster_compare_report(synthetic_cluster_comparison(), tmp / "clusters.html"),
        "sparsify": _cli_report(tmp, "sparsify", ["sparsify", "--model", "llama3-8b", "--gpus", "16", "--tp", "2"]),
        "whatif": _cli_report(tmp, "whatif", ["whatif", "sensitivity", "--model", "llama3-8b", "--gpus", "16",
                                              "--tp", "2", "--pp", "2"]),
        "moe-faults": _cli_report(tmp, "moe", ["search", "--model", str(model), "--gpus", "16", "--gbs", "64",
                                               "--trials", "6"]),
    }


@pytest.mark.parametrize("kind", ["search", "search-faults", "compare", "clusters", "sparsify", "whatif",
                                  "moe-faults"])
def test_every_report_kind_is_laid_out_right(reports, kind, tmp_path):
    check = browser.check_layout(reports[kind], CHROMIUM, profile_root=tmp_path)
    assert check.all_problems() == []
    assert check.facts["charts_ready"] == check.facts["charts_expected"] > 0
    if kind == "clusters":  # four kinds of cluster in one report: the table, both charts, each cluster named
        text = reports[kind].read_text(encoding="utf-8")
        assert check.facts["charts_expected"] == 2 and 'href="#clusters"' in text
        assert all(name in text for name in ("h800", "h200", "b200", "gb200-nvl72"))
    if kind in ("search-faults", "moe-faults", "whatif"):
        assert 'href="#fault-sensitivity"' in reports[kind].read_text(encoding="utf-8")


def _misplace(html_path, out):
    """The page as it was before issue 29: the fault section written inside the navigation too."""
    text = html_path.read_text(encoding="utf-8")
    start = text.index('<section class="card" id="fault-sensitivity">')
    end = text.index("</section>", text.index('id="sec-chart-fault-sensitivity"')) + len("</section>")
    nav_end = text.index("</nav>")
    out.write_text(text[:nav_end] + text[start:end] + text[nav_end:], encoding="utf-8")
    return out


def test_the_probe_finds_a_section_in_the_navigation(reports, tmp_path):
    bad = _misplace(reports["search-faults"], tmp_path / "bad.html")
    problems = "\n".join(browser.check_layout(bad, CHROMIUM, profile_root=tmp_path).all_problems())
    for needle in ("is outside <main>", "the navigation holds section#fault-sensitivity",
                   "id 'fault-sensitivity' is used more than once", "the recommendation starts",
                   "(the navigation ends at"):
        assert needle in problems, problems


def test_the_probe_finds_overflow_walls_of_text_and_links_to_nowhere(reports, tmp_path):
    text = reports["search"].read_text(encoding="utf-8")
    text = text.replace("<main>", '<main><div style="width:3000px">wide</div>', 1)
    text = text.replace('<a href="#ranked">', '<a href="#nowhere">', 1)
    text = text.replace("</main>", "<dl class='kv'><dt>raw</dt><dd>" + "x " * 20000 + "</dd></dl></main>", 1)
    bad = tmp_path / "bad.html"
    bad.write_text(text, encoding="utf-8")
    problems = "\n".join(browser.check_layout(bad, CHROMIUM, profile_root=tmp_path).all_problems())
    for needle in ("overflows the page width", "points to #nowhere, which does not exist", "px tall"):
        assert needle in problems, problems


def test_the_probe_finds_sections_out_of_the_navigation_order(reports, tmp_path):
    text = reports["search"].read_text(encoding="utf-8")
    # the memory link before the breakdown link, while the sections stay in their order
    mem, brk = '<a href="#sec-chart-memory">Memory</a>', '<a href="#sec-chart-breakdown">Breakdown</a>'
    text = text.replace(brk, "@@BRK@@", 1).replace(mem, brk, 1).replace("@@BRK@@", mem, 1)
    bad = tmp_path / "bad.html"
    bad.write_text(text, encoding="utf-8")
    problems = "\n".join(browser.check_layout(bad, CHROMIUM, profile_root=tmp_path).all_problems())
    assert "against the navigation's order" in problems, problems


def test_the_layout_check_waits_for_a_chart_that_draws_late(reports, tmp_path):
    """A chart that draws after the first load's virtual time (a loaded machine) is waited for, as the screenshot
    waits: the page is loaded again with three times the budget instead of reporting "0 of 1 charts drew"."""
    late = tmp_path / "late.html"
    text = reports["whatif"].read_text(encoding="utf-8")
    call = "drawn.push(Plotly.newPlot(el, c.data, c.layout, config));"
    assert call in text
    late.write_text(text.replace(call, "drawn.push(new Promise(function (ok) { setTimeout(function () { "
                                       "ok(Plotly.newPlot(el, c.data, c.layout, config)); }, 60000); }));", 1),
                    encoding="utf-8")
    check = browser.check_layout(late, CHROMIUM, budget_ms=60000, profile_root=tmp_path)
    assert check.all_problems() == []
    assert check.facts["charts_ready"] == check.facts["charts_expected"] == 1


def test_screenshot_waits_for_every_chart_and_keeps_the_old_file_on_failure(reports, tmp_path):
    png = tmp_path / "shot.png"
    page = browser.screenshot(reports["compare"], png, CHROMIUM, window=(1200, 1500), profile_root=tmp_path)
    assert page.charts_ready == page.charts_expected == 9
    assert png_size(png) == (1200, 1500)
    before = png.read_bytes()
    broken = tmp_path / "broken.html"
    text = reports["compare"].read_text(encoding="utf-8")
    broken.write_text(text.replace("Plotly.newPlot(el", "Plotly.nope(el", 1), encoding="utf-8")
    with pytest.raises(browser.EchoPlanError):
        browser.screenshot(broken, png, CHROMIUM, window=(1200, 1500), attempts=1, profile_root=tmp_path)
    assert png.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".echo-plan-shot-")] == []


def test_browser_command_line_checks_layout_and_takes_a_screenshot(reports, tmp_path, capsys):
    png = tmp_path / "cli.png"
    assert browser.main([str(reports["whatif"]), "--screenshot", str(png), "--layout", "--size", "1200x1400"]) == 0
    assert png_size(png) == (1200, 1400)
    assert "1 of 1 charts drawn" in capsys.readouterr().out
    assert browser.main([str(tmp_path / "missing.html")]) == 2
    assert browser.main([str(reports["whatif"]), "--size", "huge"]) == 2
    assert browser.main([str(reports["whatif"]), "--screenshot", str(tmp_path / "x.jpg")]) == 2
