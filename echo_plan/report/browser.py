"""Open a report in headless Chromium: load it, read back the drawn page, take a screenshot.

Used by the browser test and ``benchmarks/report_bench.py`` to check a report as a person would see
it (charts drawn, no JavaScript errors) and how long it takes to open.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
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


def screenshot(html: Path, png: Path, chromium: str, width: int = 1400, height: int = 2400,
               budget_ms: int = 5000, timeout_s: float = 60.0, profile_root: Path | None = None) -> Path:
    """A PNG of the top ``width`` x ``height`` pixels of the loaded page."""
    png = Path(png).resolve()
    with tempfile.TemporaryDirectory(prefix="echo-plan-chromium-", dir=profile_root) as profile:
        args = [chromium, *BASE_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                f"--virtual-time-budget={budget_ms}", f"--screenshot={png}", Path(html).resolve().as_uri()]
        proc, _ = _run(args, timeout_s, profile)
    if proc.returncode != 0 or not png.exists():
        raise EchoPlanError(f"Chromium could not take a screenshot (exit {proc.returncode}): "
                            f"{proc.stderr.strip()[-500:]}")
    return png


def main(argv: list[str] | None = None) -> int:
    """``python -m echo_plan.report.browser REPORT.html [--screenshot PNG]``: check a report in
    headless Chromium (charts drawn, no script errors) and optionally save a screenshot."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m echo_plan.report.browser", description=main.__doc__)
    ap.add_argument("report", type=Path)
    ap.add_argument("--screenshot", type=Path, help="save a PNG of the top of the page here")
    ap.add_argument("--size", default="1400x2200", help="window WIDTHxHEIGHT in pixels (default 1400x2200)")
    args = ap.parse_args(argv)
    chromium = find_chromium()
    if chromium is None:
        print("headless Chromium not found (apt-get install chromium)")
        return 2
    try:
        width, height = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        print(f"--size {args.size!r}: expected WIDTHxHEIGHT, e.g. 1400x2200")
        return 2
    if args.screenshot is not None:
        args.screenshot.parent.mkdir(parents=True, exist_ok=True)
    page = load(args.report, chromium, screenshot_to=args.screenshot, window=(width, height))
    print(f"{page.charts_ready} charts drawn, {page.plots_drawn} plots, JavaScript errors: {page.js_errors or 'none'}")
    if args.screenshot is not None:
        print(f"screenshot: {args.screenshot}")
    return 0 if page.charts_ready and not page.js_errors and not page.console else 1


if __name__ == "__main__":
    raise SystemExit(main())
