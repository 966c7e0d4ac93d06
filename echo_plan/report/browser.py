"""Open a report in headless Chromium: load it, read back the drawn page, check its layout, take a screenshot.

Used by the browser test and ``benchmarks/report_bench.py`` to check a report as a person would see
it (charts drawn, no JavaScript errors) and how long it takes to open.
"""

from __future__ import annotations

import html as html_text
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from echo_plan.errors import EchoPlanError

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Flags for a quiet, offline, sandbox-free headless run (CI containers run as root, without a GPU).
BASE_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-quic", "--disable-dev-shm-usage",
              "--hide-scrollbars", "--mute-audio")


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass(frozen=True, slots=True)
class PageLoad:
    """What the page looked like once loaded."""

    dom: str  # the serialized DOM after scripts ran
    console: tuple[str, ...]  # console messages Chromium logged at error level, and JavaScript exceptions
    wall_s: float  # the Chromium run from start to exit, browser start-up included

    @property
    def js_errors(self) -> list[str]:
        """Errors the page caught itself (window.onerror into <html data-js-errors>)."""
        m = re.search(r'<html[^>]*\sdata-js-errors="([^"]*)"', self.dom)
        if not m:
            return ["the page did not record its error list (data-js-errors missing)"]
        raw = m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">")
        try:
            return [str(e) for e in json.loads(raw)]
        except json.JSONDecodeError:
            return [f"unreadable error list: {raw[:200]}"]

    def body_attr(self, name: str) -> str | None:
        m = re.search(r"<body[^>]*\s" + re.escape(name) + r'="([^"]*)"', self.dom)
        return m.group(1) if m else None

    @property
    def charts_ready(self) -> int:
        value = self.body_attr("data-charts-ready")
        return int(value) if value and value.isdigit() else 0

    @property
    def charts_expected(self) -> int | None:
        """How many charts the page's own data asks to draw (set by report.js before it draws)."""
        value = self.body_attr("data-charts-expected")
        return int(value) if value and value.isdigit() else None

    @property
    def charts_ms(self) -> float | None:
        """Milliseconds from navigation start until every chart had drawn, measured by the page."""
        value = self.body_attr("data-charts-ms")
        return float(value) if value else None

    @property
    def plots_drawn(self) -> int:
        """Plot containers that Plotly drew into (they hold its .main-svg)."""
        return len(re.findall(r'class="[^"]*js-plotly-plot', self.dom))


def _run(args: list[str], timeout_s: float, profile: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run Chromium with its home and caches inside ``profile``; returns the process and its wall time."""
    env = {**os.environ, "HOME": profile, "XDG_CONFIG_HOME": profile, "XDG_CACHE_HOME": profile}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, errors="replace", env=env)
    except subprocess.TimeoutExpired:
        raise EchoPlanError(f"Chromium did not finish within {timeout_s:g} s") from None
    return proc, time.perf_counter() - t0


def _console_errors(stderr: str) -> tuple[str, ...]:
    """Console messages at error level and uncaught exceptions from Chromium's stderr log."""
    out = []
    for line in stderr.splitlines():
        if "CONSOLE" in line and ("ERROR" in line or "Uncaught" in line):
            out.append(line.strip())
        elif "Uncaught" in line:
            out.append(line.strip())
    return tuple(out)


def load(html: Path, chromium: str, budget_ms: int | None = 5000, timeout_s: float = 90.0,
         screenshot_to: Path | None = None, window: tuple[int, int] = (1400, 2400), fragment: str = "",
         profile_root: Path | None = None) -> PageLoad:
    """Load ``html`` and return its DOM after the scripts ran (``budget_ms`` of virtual time lets
    timers settle; None reads the DOM at the load event, in real time, for timing);
    with ``screenshot_to``, the same run also saves a PNG of the top ``window`` pixels.
    ``fragment`` is added to the URL (``"sync"``: the report draws before its load event).
    Chromium's profile, home and caches live in a temporary folder under ``profile_root`` (default:
    the system's temporary folder), removed afterwards.

    Headless Chromium now and then dumps the DOM before the page's scripts have run (seen with
    Chromium 156: about one load in four under load, whatever the virtual-time budget); a load
    that drew no chart and reported no error is retried, at most ``RETRIES`` times, so a page
    that really draws nothing still fails."""
    page = _load_once(html, chromium, budget_ms, timeout_s, screenshot_to, window, fragment, profile_root)
    for _ in range(RETRIES):
        if page.charts_ready or page.js_errors or page.console or budget_ms is None:
            break
        page = _load_once(html, chromium, budget_ms, timeout_s, screenshot_to, window, fragment, profile_root)
    return page


RETRIES = 2


def _load_once(html: Path, chromium: str, budget_ms: int | None, timeout_s: float, screenshot_to: Path | None,
               window: tuple[int, int], fragment: str, profile_root: Path | None) -> PageLoad:
    with tempfile.TemporaryDirectory(prefix="echo-plan-chromium-", dir=profile_root) as profile:
        args = [chromium, *BASE_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                f"--window-size={window[0]},{window[1]}"]
        if budget_ms is not None:
            args.append(f"--virtual-time-budget={budget_ms}")
        if screenshot_to is not None:
            args.append(f"--screenshot={Path(screenshot_to).resolve()}")
        url = Path(html).resolve().as_uri() + (f"#{fragment}" if fragment else "")
        args += ["--dump-dom", url]
        proc, wall = _run(args, timeout_s, profile)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise EchoPlanError(f"Chromium failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    if screenshot_to is not None and not Path(screenshot_to).exists():
        raise EchoPlanError(f"Chromium wrote no screenshot: {proc.stderr.strip()[-500:]}")
    return PageLoad(proc.stdout, _console_errors(proc.stderr), wall)


def screenshot(html: Path, png: Path, chromium: str, window: tuple[int, int] = (1400, 2200), attempts: int = 3,
               timeout_s: float = 90.0, profile_root: Path | None = None) -> PageLoad:
    """Save a PNG of the top ``window`` pixels of the report once every chart has drawn.

    The page is opened as ``REPORT.html#sync``, where it draws every chart before its load event;
    the DOM read in the same run must show as many drawn charts as the page asks for
    (``data-charts-expected``), else the capture is taken again with three times the virtual time.
    The PNG is written beside ``png`` and moved into place only when it shows every chart: a failed
    capture leaves an existing ``png`` as it was."""
    png = Path(png)
    budget_ms = 5000
    page = None
    with tempfile.TemporaryDirectory(prefix=".echo-plan-shot-", dir=png.resolve().parent) as tmp:
        shot = Path(tmp) / "shot.png"
        for _ in range(max(1, attempts)):
            page = load(html, chromium, budget_ms=budget_ms, timeout_s=timeout_s, screenshot_to=shot, window=window,
                        fragment="sync", profile_root=profile_root)
            if page.js_errors or page.console:
                raise EchoPlanError(f"the report has script errors: {[*page.js_errors, *page.console][:3]}")
            if page.charts_expected is not None and page.charts_ready == page.charts_expected:
                os.replace(shot, png)
                return page
            budget_ms *= 3
    assert page is not None
    raise EchoPlanError(f"only {page.charts_ready} of {page.charts_expected} charts had drawn after {attempts} "
                        f"captures; no screenshot written")


# The layout check: a copy of the report gets templates/layout_probe.js before its closing </body>;
# once every chart has drawn, the probe checks that every section card lies inside the main column,
# that the navigation is one row of links, that sections come in the order of the links and each link
# scrolls to its section, that element ids are unique, that nothing overflows the page width, that the
# recommendation starts above the fold, that no listed value is a wall of text, and that every chart
# drew, and writes what it found into the page. The report a user gets is never changed.
PROBE = Path(__file__).with_name("templates") / "layout_probe.js"


@dataclass(frozen=True, slots=True)
class LayoutCheck:
    """What the probe found: ``problems`` is empty for a page laid out right."""

    problems: tuple[str, ...]
    facts: dict = field(default_factory=dict)  # nav height, headline position, charts expected / drawn
    js_errors: tuple[str, ...] = ()
    console: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and not self.js_errors and not self.console

    def all_problems(self) -> list[str]:
        return [*self.problems, *(f"script error: {e}" for e in self.js_errors),
                *(f"console: {c}" for c in self.console)]


def with_probe(report_html: str, budget_ms: int = 60000) -> str:
    """The report's text with the probe script added just before its last ``</body>``; the probe waits for the
    charts up to half the load's virtual time ``budget_ms`` (``probeMaxWaits``, polls of 50 ms), so a load with
    more time waits longer."""
    at = report_html.rfind("</body>")
    if at < 0:
        raise EchoPlanError("not an echo-plan report: it has no </body>")
    probe = f"window.probeMaxWaits = {max(1, budget_ms // 100)};\n" + PROBE.read_text(encoding="utf-8")
    return report_html[:at] + f"<script>{probe}</script>\n" + report_html[at:]


def read_layout(dom: str) -> dict | None:
    m = re.search(r'<body[^>]*\sdata-layout="([^"]*)"', dom)
    if not m:
        return None
    try:
        return json.loads(html_text.unescape(m.group(1)))
    except json.JSONDecodeError:
        return None


def check_layout(report: Path, chromium: str, window: tuple[int, int] = (1280, 1600), budget_ms: int = 60000,
                 profile_root: Path | None = None) -> LayoutCheck:
    """Load a probed copy of ``report`` in a ``window``-sized headless Chromium and return what it found."""
    text = Path(report).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="echo-plan-layout-", dir=profile_root) as tmp:
        probed = Path(tmp) / "probed.html"
        probed.write_text(with_probe(text, budget_ms), encoding="utf-8")
        page = load(probed, chromium, budget_ms=budget_ms, window=window, profile_root=profile_root)
        for _ in range(RETRIES):  # a dump taken before the scripts ran (browser.load's docstring), or before every
            # chart drew (a loaded machine): loaded again, the latter with three times the virtual time, as screenshot
            found = read_layout(page.dom)
            if page.js_errors or (found is not None and found.get("charts_ready") == found.get("charts_expected")):
                break
            if found is not None:
                budget_ms *= 3
                probed.write_text(with_probe(text, budget_ms), encoding="utf-8")
            page = load(probed, chromium, budget_ms=budget_ms, window=window, profile_root=profile_root)
    facts = read_layout(page.dom)
    if facts is None:
        return LayoutCheck(("the layout probe did not finish: the page never reported its layout",), {},
                           tuple(page.js_errors), page.console)
    problems = tuple(str(p) for p in facts.pop("problems", ()))
    return LayoutCheck(problems, facts, tuple(page.js_errors), page.console)


def main(argv: list[str] | None = None) -> int:
    """``python -m echo_plan.report.browser REPORT.html [--screenshot PNG] [--layout]``: check a report in
    headless Chromium (every chart drawn, no script errors; with --layout, the layout checks of
    echo_plan.report.layout too) and optionally save a screenshot taken once every chart has drawn."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m echo_plan.report.browser", description=main.__doc__)
    ap.add_argument("report", type=Path)
    ap.add_argument("--screenshot", type=Path, help="save a PNG of the top of the page here")
    ap.add_argument("--size", default="1400x2200", help="window WIDTHxHEIGHT in pixels (default 1400x2200)")
    ap.add_argument("--layout", action="store_true", help="also check the layout (sections, navigation, overflow)")
    args = ap.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("error: headless Chromium not found (apt-get install chromium)")
        return 2
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
        if not (100 <= width <= 10000 and 100 <= height <= 20000):
            raise ValueError
    except ValueError:
        print(f"error: --size {args.size!r}: expected WIDTHxHEIGHT, each 100 to 10000 (height to 20000), e.g. 1400x2200")
        return 2
    if not args.report.is_file():
        print(f"error: {args.report}: no such report file")
        return 2
    try:
        if args.screenshot is not None:
            if args.screenshot.suffix.lower() != ".png":
                print(f"error: --screenshot {args.screenshot}: the file should end in .png")
                return 2
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            page = screenshot(args.report, args.screenshot, chromium, window=(width, height))
        else:
            page = load(args.report, chromium, window=(width, height))
        problems = []
        if args.layout:
            problems = check_layout(args.report, chromium, window=(width, min(height, 1600))).all_problems()
    except EchoPlanError as exc:
        print(f"error: {exc}")
        return 1
    print(f"{page.charts_ready} of {page.charts_expected} charts drawn, JavaScript errors: {page.js_errors or 'none'}")
    for p in problems:
        print(f"layout: {p}")
    if args.screenshot is not None:
        print(f"screenshot: {args.screenshot}")
    drawn = page.charts_ready and page.charts_ready == page.charts_expected
    return 0 if drawn and not page.js_errors and not page.console and not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
