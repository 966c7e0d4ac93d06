"""The search report's fault sensitivity section: what one slow component costs the top plans."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo_plan.report.chart import PALETTE, Chart, base_layout
from echo_plan.report.plans import short_label
from echo_plan.report.table import Cell, Table
from echo_plan.resilience.sensitivity import HEADLINE_SEVERITY, sensitivity
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.trace.cache import TraceCache

TOP_PLANS = 3


@dataclass(frozen=True, slots=True)
class SensitivityView:
    table: Table
    chart: Chart
    caption: str


def sensitivity_rows(outcome, cache_dir: str | None = None) -> list[tuple[dict, list]]:
    """(plan, rows at the headline severities) of the top plans, simulated with each fault and the stack the
    search used."""
    model = ModelSpec.build(dict(outcome.model), "model in the result")
    cluster = ClusterSpec.build(dict(outcome.cluster), "cluster in the result")
    stack = SoftwareSpec.build(dict(outcome.stack), "stack in the result") if outcome.stack else None
    memo, cache = SimulationMemo(), TraceCache(cache_dir)
    out = []
    for result in outcome.ranked[:TOP_PLANS]:
        plan = PlanSpec.build(dict(result.plan), "ranked plan")

        def step(faults, plan=plan):
            return simulate(model, cluster, plan, stack=stack, cache=cache, memo=memo, faults=faults).step_time_s

        _, rows = sensitivity(plan, cluster, step, severities={k: (v,) for k, v in HEADLINE_SEVERITY.items()})
        out.append((result.plan, list(rows)))
    return out


def sensitivity_view(data: list[tuple[dict, list]]) -> SensitivityView | None:
    if not data:
        return None
    kinds = [r.what for r in data[0][1]]
    headers = ("plan", *kinds)
    rows = []
    traces: list[dict[str, Any]] = []
    for i, (plan, frows) in enumerate(data):
        label = f"#{i + 1} {short_label(plan)}"
        rows.append((Cell(label, i, numeric=False),
                     *(Cell(f"{r.worst_loss:.1%} (stage {r.worst_stage})", r.worst_loss) for r in frows)))
        traces.append({"type": "bar", "name": label, "x": kinds, "y": [r.worst_loss * 100 for r in frows],
                       "marker": {"color": PALETTE[i % len(PALETTE)]},
                       "hovertemplate": f"{label}<br>%{{x}}: %{{y:.1f}}% of throughput lost<extra></extra>"})
    table = Table(headers, ("ranked plan", *(f"throughput lost to {k}, worst placement" for k in kinds)),
                  (False, *([True] * len(kinds))), tuple(rows), (), len(rows))
    chart = Chart("chart-fault-sensitivity", "Fault sensitivity of the top plans",
                  "Share of throughput each plan loses to one slow component, at its worst placement among the "
                  "stages tried; a plan that loses less is the safer choice on a cluster with stragglers.",
                  tuple(traces), base_layout(380, barmode="group", yaxis={"title": {"text": "throughput lost (%)"}}))
    first = data[0][1]
    worst = max(first, key=lambda r: r.worst_loss)
    caption = f"The recommended plan loses {worst.worst_loss:.0%} of its throughput to {worst.what}"
    if len(data) > 1:
        second = {r.kind: r for r in data[1][1]}.get(worst.kind)
        if second is not None:
            caption += f"; plan #2 loses {second.worst_loss:.0%}"
    return SensitivityView(table, chart, caption + ".")
