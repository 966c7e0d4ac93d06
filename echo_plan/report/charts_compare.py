"""Charts of a compare: best throughput per cluster size, scaling efficiency, time and cost to train."""

from __future__ import annotations

from typing import Any

from echo_plan.report.chart import BEST_COLOR, FIT_COLOR, FRONT_COLOR, Chart, base_layout, fmt_count
from echo_plan.report.plans import short_label
from echo_plan.search.results import CompareOutcome, CompareRow


def rows_with_plan(outcome: CompareOutcome) -> list[CompareRow]:
    return sorted((r for r in outcome.rows if r.outcome.best is not None), key=lambda r: r.num_gpus)


def scaling_chart(outcome: CompareOutcome) -> Chart:
    rows = rows_with_plan(outcome)
    gpus = [r.num_gpus for r in rows]
    tps = [r.outcome.best.tokens_per_s for r in rows]  # type: ignore[union-attr]
    text = [f"<b>{r.num_gpus} GPUs</b>: {short_label(r.outcome.best.plan)}<br>"  # type: ignore[union-attr]
            f"{fmt_count(r.outcome.best.tokens_per_s)} tokens/s, step {r.outcome.best.step_time_s:.3g} s"  # type: ignore[union-attr]
            for r in rows]
    data: list[dict[str, Any]] = [{
        "type": "scatter", "mode": "lines+markers", "name": "best plan's throughput", "x": gpus, "y": tps,
        "text": text, "hovertemplate": "%{text}<extra></extra>",
        "line": {"color": FIT_COLOR, "width": 3}, "marker": {"size": 9},
    }]
    if rows:
        per_gpu = tps[0] / gpus[0]
        data.append({"type": "scatter", "mode": "lines", "name": f"linear scaling from {gpus[0]} GPUs",
                     "x": gpus, "y": [per_gpu * g for g in gpus], "hoverinfo": "skip",
                     "line": {"color": "#999", "dash": "dot"}})
    eff = [(r.num_gpus, r.scaling_efficiency) for r in rows if r.scaling_efficiency is not None]
    if eff:
        data.append({"type": "scatter", "mode": "lines+markers", "name": "scaling efficiency (right axis)",
                     "x": [g for g, _ in eff], "y": [e * 100 for _, e in eff], "yaxis": "y2",
                     "line": {"color": FRONT_COLOR, "width": 2}, "marker": {"symbol": "diamond", "size": 8},
                     "hovertemplate": "%{x} GPUs: %{y:.1f}% efficiency<extra></extra>"})
    layout = base_layout(400, xaxis={"title": {"text": "GPUs"}, "type": "log", "tickvals": gpus,
                                     "ticktext": [str(g) for g in gpus]},
                         yaxis={"title": {"text": "tokens/s (best plan)"}, "rangemode": "tozero"},
                         yaxis2={"title": {"text": "scaling efficiency"}, "overlaying": "y", "side": "right",
                                 "range": [0, 110], "showgrid": False, "tickmode": "array",
                                 "tickvals": [0, 25, 50, 75, 100], "ticktext": ["0%", "25%", "50%", "75%", "100%"]},
                         margin={"r": 70})
    return Chart("chart-scaling", "Throughput and scaling efficiency by cluster size",
                 "The best fitting plan at each size. Scaling efficiency is throughput per GPU relative to the "
                 "smallest size; the dotted line is perfect linear scaling.", tuple(data), layout)


def train_cost_chart(outcome: CompareOutcome) -> Chart | None:
    """Days to train the token budget per size, and its cost when a price was given; None without a budget."""
    rows = [r for r in rows_with_plan(outcome) if r.train_time_s is not None]
    if not rows:
        return None
    labels = [f"{r.num_gpus} GPUs" for r in rows]
    data: list[dict[str, Any]] = [{
        "type": "bar", "name": "days to train", "x": labels, "y": [r.train_time_s / 86400 for r in rows],  # type: ignore[operator]
        "marker": {"color": FIT_COLOR}, "text": [f"{r.train_time_s / 86400:.3g} d" for r in rows],  # type: ignore[operator]
        "textposition": "auto", "hovertemplate": "%{x}: %{y:.3g} days<extra></extra>", "offsetgroup": "days",
    }]
    costs = [(lab, r) for lab, r in zip(labels, rows) if r.cost is not None]
    hours = [(lab, r) for lab, r in zip(labels, rows) if r.gpu_hours is not None]
    extra: dict[str, Any] = {}
    if costs:
        data.append({"type": "bar", "name": "cost (right axis)", "x": [lab for lab, _ in costs],
                     "y": [r.cost for _, r in costs], "yaxis": "y2", "offsetgroup": "cost",
                     "marker": {"color": BEST_COLOR}, "text": [fmt_count(r.cost or 0.0) for _, r in costs],
                     "textposition": "auto", "hovertemplate": "%{x}: %{y:,.0f}<extra>cost</extra>"})
        extra["yaxis2"] = {"title": {"text": "cost"}, "overlaying": "y", "side": "right", "showgrid": False,
                           "rangemode": "tozero", "tickmode": "auto"}
    elif hours:
        data.append({"type": "bar", "name": "GPU-hours (right axis)", "x": [lab for lab, _ in hours],
                     "y": [r.gpu_hours for _, r in hours], "yaxis": "y2", "offsetgroup": "hours",
                     "marker": {"color": BEST_COLOR}, "hovertemplate": "%{x}: %{y:,.0f} GPU-hours<extra></extra>"})
        extra["yaxis2"] = {"title": {"text": "GPU-hours"}, "overlaying": "y", "side": "right",
                           "showgrid": False, "rangemode": "tozero", "tickmode": "auto"}
    layout = base_layout(380, barmode="group", yaxis={"title": {"text": "days to train"}}, margin={"r": 70},
                         **extra)
    budget = f"{fmt_count(outcome.tokens_budget)} tokens" if outcome.tokens_budget else "the token budget"
    price = (f" at {outcome.price_per_gpu_hour:g} per GPU-hour" if outcome.price_per_gpu_hour is not None else "")
    return Chart("chart-train-cost", "Time and cost to train",
                 f"Wall-clock days to train {budget} with the best plan at each size, and what it costs{price}.",
                 tuple(data), layout)
