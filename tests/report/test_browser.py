"""The report as a person sees it: headless Chromium loads it from disk, the charts draw, no errors.

Skipped where Chromium is missing (``.ci/run`` installs Debian's ``chromium``).
"""

import re
import struct

import pytest
from report_synthetic import compare_outcome, search_outcome

from echo_plan.report import browser
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
    from echo_plan.resilience.faults import FaultKind
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
