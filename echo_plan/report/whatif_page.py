"""The HTML report of ``echo-plan whatif sensitivity``: what each slow component costs one plan."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from echo_plan import __version__
from echo_plan.report.chart import PALETTE, Chart, base_layout, fmt_seconds
from echo_plan.report.headline import Headline, Metric
from echo_plan.report.inputs import build_inputs
from echo_plan.report.plans import plan_in_words, short_label
from echo_plan.report.render import _page, _stamp
from echo_plan.report.sensitivity_view import SensitivityView
from echo_plan.report.table import Cell, Table
from echo_plan.files import write_atomic


def whatif_table(rows: Sequence[Any]) -> Table:
    cells = tuple((Cell(r.what, i, numeric=False),
                   Cell(f"{r.worst_loss:.1%}", r.worst_loss), Cell(str(r.worst_stage), r.worst_stage),
                   Cell(f"{r.best_loss:.1%}", r.best_loss), Cell(str(r.best_stage), r.best_stage))
                  for i, r in enumerate(rows))
    return Table(("fault", "lost (worst)", "at stage", "lost (best)", "at stage"),
                 ("one slow component and its severity", "share of throughput lost at the worst placement tried",
                  "the pipeline stage of that placement", "share of throughput lost at the best placement tried",
                  "the pipeline stage of that placement"),
                 (False, True, True, True, True), cells, (), len(cells))


def whatif_chart(rows: Sequence[Any]) -> Chart:
    labels = [r.what for r in rows]
    data = [{"type": "bar", "name": name, "x": labels, "y": [getattr(r, key) * 100 for r in rows],
             "marker": {"color": PALETTE[i]},
             "hovertemplate": f"%{{x}}<br>{name}: %{{y:.1f}}% of throughput lost<extra></extra>"}
            for i, (name, key) in enumerate((("worst placement", "worst_loss"), ("best placement", "best_loss")))]
    return Chart("chart-fault-sensitivity", "Throughput lost to each fault",
                 "Share of throughput the plan loses to one slow component, at the worst and the best placement "
                 "among the pipeline stages tried.", tuple(data),
                 base_layout(420, barmode="group", yaxis={"title": {"text": "throughput lost (%)"}}))


def whatif_headline(plan, healthy_s: float, rows: Sequence[Any]) -> Headline:
    worst = max(rows, key=lambda r: r.worst_loss) if rows else None
    title = f"{worst.what} costs {worst.worst_loss:.0%}" if worst else "No fault applies to this cluster"
    reasons = [f"The healthy step takes {fmt_seconds(healthy_s)}."]
    if worst is not None:
        reasons.append(f"The costliest fault tried is {worst.what}: {worst.worst_loss:.1%} of the throughput at "
                       f"stage {worst.worst_stage}, {worst.best_loss:.1%} at stage {worst.best_stage}.")
        mild = min(rows, key=lambda r: r.worst_loss)
        reasons.append(f"The cheapest is {mild.what}: at most {mild.worst_loss:.1%}.")
    reasons.append("Each fault is placed on the first GPU of a few pipeline stages (the first, the middle and the "
                   "last; every stage when there are at most four) and the plan simulated with it.")
    return Headline(title, plan_in_words(plan.model_dump(mode="json")),
                    (Metric("healthy step", fmt_seconds(healthy_s)), Metric("faults tried", str(len(rows)))),
                    tuple(reasons), reasons_title="What the simulation says")


def render_whatif_report(model_spec, cluster_spec, plan, healthy_s: float, rows: Sequence[Any],
                         generated_at: datetime | None = None) -> str:
    stamp = _stamp(generated_at)
    worst = max(rows, key=lambda r: r.worst_loss) if rows else None
    caption = (f"The plan loses up to {worst.worst_loss:.0%} of its throughput to {worst.what}." if worst
               else "No fault kind applies to this cluster.")
    view = SensitivityView(whatif_table(rows), whatif_chart(rows), caption)
    run = [("echo-plan", __version__), ("report made", stamp), ("plan", short_label(plan.model_dump(mode="json")))]
    context = {
        "title": f"Fault sensitivity of {model_spec.name} on {cluster_spec.name} ({cluster_spec.num_gpus} GPUs)",
        "subtitle": f"echo-plan {__version__} · whatif sensitivity · {stamp}",
        "headline": whatif_headline(plan, healthy_s, rows), "headline_label": "What one slow component costs",
        "search": None, "compare": None, "sensitivity": view,
        "inputs": build_inputs(model_spec.model_dump(mode="json"), cluster_spec.model_dump(mode="json"), {}, run),
        "notes": ["Faults are priced one at a time on a healthy cluster (docs/resilience.md)."],
        "generated_at": stamp,
    }
    return _page(context, [view.chart])


def write_whatif_report(path: str | Path, model_spec, cluster_spec, plan, healthy_s: float,
                        rows: Sequence[Any]) -> Path:
    write_atomic(path, render_whatif_report(model_spec, cluster_spec, plan, healthy_s, rows))
    return Path(path)
