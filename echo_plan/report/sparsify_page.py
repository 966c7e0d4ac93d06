"""The HTML report of ``echo-plan sparsify``: break-even densities and step time across densities."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from echo_plan import __version__
from echo_plan.report.chart import PALETTE, Chart, base_layout, fmt_seconds
from echo_plan.report.headline import Headline, Metric
from echo_plan.report.inputs import build_inputs
from echo_plan.report.plans import plan_in_words, short_label
from echo_plan.report.table import Cell, Table
from echo_plan.report.render import _page, _stamp
from echo_plan.files import write_atomic


@dataclass(frozen=True, slots=True)
class SparsifyView:
    table: Table
    chart: Chart
    caption: str


def sparsify_chart(o) -> Chart:
    """Step time against density per method (log density), the dense step as a dashed line."""
    data: list[dict[str, Any]] = []
    grid = [d for c in o.curves for d, _, _ in c.points]
    lo, hi = (min(grid), max(grid)) if grid else (1e-3, 1.0)
    for i, c in enumerate(o.curves):
        data.append({"type": "scatter", "mode": "lines+markers", "name": c.method.value,
                     "x": [d for d, _, _ in c.points], "y": [t for _, t, _ in c.points],
                     "line": {"color": PALETTE[i % len(PALETTE)]},
                     "hovertemplate": f"{c.method.value}<br>density %{{x:.3g}}<br>%{{y:.4f}} s per step<extra></extra>"})
    data.append({"type": "scatter", "mode": "lines", "name": "dense all-reduce", "x": [lo, hi],
                 "y": [o.dense_step_time_s] * 2, "line": {"color": "#222", "dash": "dash"},
                 "hovertemplate": "dense<br>%{y:.4f} s per step<extra></extra>"})
    layout = base_layout(420, xaxis={"type": "log", "title": {"text": "density (share of gradient elements sent)"}},
                         yaxis={"type": "log", "title": {"text": "step time (s)"}})
    return Chart("chart-sparsify", "Step time across densities",
                 "Each line is one sparse exchange at the densities tabulated; below the dashed dense line it pays "
                 "(per step: convergence is not modelled).", tuple(data), layout)


def sparsify_table(o) -> Table:
    rows = []
    for c in o.curves:
        be = c.break_even_density
        at = {d: t for d, t, _ in c.points}
        best_d = min(at, key=at.get)
        rows.append((Cell(c.method.value, c.method.value, numeric=False),
                     Cell("never" if be is None else f"{be:.3g}", -1.0 if be is None else be),
                     Cell(fmt_seconds(at[best_d]), at[best_d]), Cell(f"{best_d:g}", best_d),
                     Cell(f"{o.dense_step_time_s / at[best_d] - 1:+.1%}", o.dense_step_time_s / at[best_d] - 1)))
    return Table(("method", "break-even density", "best step", "at density", "gain vs dense"),
                 ("the sparse exchange", "largest density whose step is no slower than the dense reduction",
                  "fastest step among the densities tabulated", "the density of that step",
                  "dense step / best step - 1"),
                 (False, True, True, True, True), tuple(rows), (), len(rows))


def render_sparsify_report(o, model_spec, cluster_spec, generated_at: datetime | None = None) -> str:
    stamp = _stamp(generated_at)
    paying = [c for c in o.curves if c.break_even_density is not None]
    reasons = [f"The dense reduction takes {fmt_seconds(o.dense_step_time_s)} per step on a data-parallel group "
               f"of {o.dp}."]
    for c in o.curves:
        reasons.append(f"{c.method.value}: " + ("never pays at any density down to 1e-6." if c.break_even_density
                                                 is None else f"pays below density {c.break_even_density:.3g}."))
    reasons.append("Not modelled: convergence. A sparsifier changes how many steps reach a given loss; these "
                   "figures price one step.")
    best = max(paying, key=lambda c: c.break_even_density) if paying else None
    headline = Headline(
        f"{best.method.value} pays below density {best.break_even_density:.3g}" if best else "No sparsifier pays",
        plan_in_words(o.plan), (Metric("dense step", fmt_seconds(o.dense_step_time_s)),
                                Metric("data-parallel group", str(o.dp))), tuple(reasons),
        reasons_title="What the simulation says")
    view = SparsifyView(sparsify_table(o), sparsify_chart(o), "Break-even density per method for this plan.")
    run = [("echo-plan", __version__), ("report made", stamp), ("plan", short_label(o.plan))]
    context = {
        "title": f"Gradient sparsification for {o.model} on {o.cluster} ({o.num_gpus} GPUs)",
        "subtitle": f"echo-plan {__version__} · sparsify · {stamp}",
        "headline": headline, "headline_label": "Where sparsification pays", "search": None, "compare": None,
        "sparsify": view, "inputs": build_inputs(model_spec.model_dump(mode="json"), cluster_spec.model_dump(mode="json"),
                                                 {}, run),
        "notes": ["Selection, error feedback and combine kernels are traced ops; index and value exchanges are "
                  "collectives on the data-parallel group's placement (docs/sparsification.md)."],
        "generated_at": stamp,
    }
    return _page(context, [view.chart])


def write_sparsify_report(o, path: str | Path, model_spec, cluster_spec) -> Path:
    write_atomic(path, render_sparsify_report(o, model_spec, cluster_spec))
    return Path(path)
