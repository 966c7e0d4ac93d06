"""A chart of the report: a Plotly figure as plain JSON-ready data, plus shared styling.

Figures are built as dictionaries (Plotly's JSON schema) rather than with plotly.graph_objects,
which keeps rendering fast and the numbers rounded so a 2,000-trial report stays small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GiB = float(2**30)

# Tableau 10 colours (Tableau's public palette), one meaning each across the report.
BREAKDOWN_COLORS = {
    "compute": "#4C78A8",
    "tp_comm_exposed": "#F58518",
    "ep_comm_exposed": "#EECA3B",
    "host_exposed": "#FF9DA6",
    "pp_comm_exposed": "#E45756",
    "dp_comm_exposed": "#72B7B2",
    "bubble": "#BAB0AC",
    "interference": "#B279A2",
    "optimizer": "#54A24B",
}
BREAKDOWN_NAMES = {
    "compute": "compute",
    "tp_comm_exposed": "exposed TP comm.",
    "ep_comm_exposed": "exposed expert exchange",
    "host_exposed": "waiting for the host",
    "pp_comm_exposed": "exposed PP comm.",
    "dp_comm_exposed": "exposed DP comm.",
    "bubble": "pipeline bubble",
    "interference": "interference",
    "optimizer": "optimizer step",
}
MEMORY_COLORS = {
    "weights": "#4C78A8",
    "gradients": "#F58518",
    "optimizer": "#54A24B",
    "activations": "#E45756",
    "buffers": "#BAB0AC",
}
FIT_COLOR = "#4C78A8"
NOFIT_COLOR = "#C9C9C9"
BEST_COLOR = "#D62728"
FRONT_COLOR = "#F58518"
CAPACITY_COLOR = "#B00020"
PALETTE = ("#4C78A8", "#F58518", "#E45756", "#72B7B2", "#54A24B", "#EECA3B", "#B279A2",
           "#FF9DA6", "#9D755D", "#BAB0AC")


@dataclass(frozen=True, slots=True)
class Chart:
    """One figure: an element id, a title, a sentence saying how to read it, and the figure."""

    id: str
    title: str
    caption: str
    data: tuple[dict[str, Any], ...]
    layout: dict[str, Any] = field(default_factory=dict)

    def spec(self) -> dict[str, Any]:
        return {"id": self.id, "data": [rounded(t) for t in self.data], "layout": rounded(self.layout)}


def base_layout(height: int = 380, **extra: Any) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "height": height,
        "margin": {"l": 70, "r": 30, "t": 36, "b": 50},
        "font": {"family": "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif", "size": 12,
                 "color": "#222"},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "hoverlabel": {"align": "left"},
        "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0, "traceorder": "normal"},
        "xaxis": {"gridcolor": "#eee", "zeroline": False},
        "yaxis": {"gridcolor": "#eee", "zeroline": False},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(layout.get(key), dict):
            layout[key] = {**layout[key], **value}
        else:
            layout[key] = value
    return layout


def label_margin(labels: list[str] | tuple[str, ...], px_per_char: float = 6.6, pad: int = 16) -> int:
    """A left margin wide enough for these axis labels at the report's 12 px font, so Plotly need
    not measure them and lay the chart out twice (``automargin``)."""
    longest = max((len(x) for x in labels), default=0)
    return int(min(480, pad + px_per_char * longest))


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values 1, 2, 5, 10, 20, 50, ... covering [lo, hi] for a log axis (readable, not crowded)."""
    ticks: list[float] = []
    if lo <= 0 or hi <= 0:
        return ticks
    decade = 10.0 ** math.floor(math.log10(lo))
    while decade <= hi * 10:
        for m in (1, 2, 5):
            v = m * decade
            if lo / 2 <= v <= hi * 2:
                ticks.append(v)
        decade *= 10
    return ticks


def rounded(obj: Any, digits: int = 5) -> Any:
    """The same structure with floats rounded to ``digits`` significant digits (smaller files)."""
    if isinstance(obj, float):
        if obj == 0.0 or obj != obj or obj in (float("inf"), float("-inf")):
            return obj
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def fmt_seconds(s: float, digits: int = 3) -> str:
    """3.2 ms, 1.45 s, 2.1 min, 3.4 h, 12.3 days: the unit a person would say."""
    if s < 1.0:
        return f"{s * 1e3:.{digits}g} ms"
    if s < 120:
        return f"{s:.{digits}g} s"
    if s < 2 * 3600:
        return f"{s / 60:.{digits}g} min"
    if s < 3 * 86400:
        return f"{s / 3600:.{digits}g} h"
    return f"{s / 86400:.{digits}g} days"


def fmt_count(x: float) -> str:
    """12.3k, 4.56M, 1.2B: large counts in a few digits."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"
