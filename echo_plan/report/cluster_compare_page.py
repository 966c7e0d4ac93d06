"""The HTML report of ``compare --cluster a,b,c``: the best plan of each kind of cluster at each size, side by
side with what a decision needs (time to train the token budget, GPU-hours, cost at each cluster's price,
GPU energy), a chart of throughput per GPU by size, and one of cost against days to train."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from echo_plan import __version__
from echo_plan.files import write_atomic
from echo_plan.report.chart import PALETTE, Chart, base_layout, fmt_count, fmt_seconds
from echo_plan.report.headline import Headline, Metric
from echo_plan.report.inputs import Inputs, cluster_rows, model_rows
from echo_plan.report.render import _page, _stamp
from echo_plan.report.table import Cell, Table
from echo_plan.search.compare_cluster import ENERGY_NOTE, ClusterComparison

NO_VALUE = 1e308  # sorts after every real value (as the ranked table's missing cells)


@dataclass(frozen=True, slots=True)
class ClusterCompareView:
    table: Table
    caption: str
    throughput: Chart
    cost_time: Chart | None


def short_status(status: str) -> str:
    """A calibration status in a table cell's words (the headline says it in full)."""
    if status == "calibrated":
        return "own runs"
    if status.startswith("calibration inherited from "):
        source = status.removeprefix("calibration inherited from ").split(" ")[0]
        return f"from {source}" + (" (prior)" if "another GPU generation" in status else "")
    return "none"


def _num(value: float | None, text: str) -> Cell:
    return Cell(text if value is not None else "-", value if value is not None else NO_VALUE)


def cluster_table(c: ClusterComparison) -> Table:
    rows = []
    for r in c.rows():
        rng = r["step_time_range_s"]
        per_gpu = r["tokens_per_s"] / r["num_gpus"] if r["tokens_per_s"] else None
        rows.append((
            Cell(r["cluster"], r["cluster"], numeric=False), Cell(r["gpu"], r["gpu"], numeric=False),
            Cell(str(r["num_gpus"]), r["num_gpus"]),
            Cell(r["plan"] or "no plan fits", r["plan"] or "~", numeric=False),
            _num(r["step_time_s"], fmt_seconds(r["step_time_s"]) if r["step_time_s"] else ""),
            Cell(f"{rng[0]:.3g}-{rng[1]:.3g} s" if rng else "-", rng[0] if rng else NO_VALUE),
            _num(r["tokens_per_s"], fmt_count(r["tokens_per_s"]) if r["tokens_per_s"] else ""),
            _num(per_gpu, f"{per_gpu:,.0f}" if per_gpu else ""),
            _num(r["train_days"], f"{r['train_days']:.1f}" if r["train_days"] else ""),
            _num(r["gpu_hours"], f"{r['gpu_hours']:,.0f}" if r["gpu_hours"] else ""),
            _num(r["cost"], f"{r['cost']:,.0f}" if r["cost"] else ""),
            _num(r["energy_MWh"], f"{r['energy_MWh']:.1f}" if r["energy_MWh"] else ""),
            Cell(short_status(r["calibration"]), r["calibration"], numeric=False),
        ))
    headers = ("cluster", "GPU", "GPUs", "best plan", "step", "80% range", "tokens/s", "tokens/s per GPU", "days",
               "GPU-hours", "cost", "MWh", "calibration")
    titles = ("the cluster as named", "its GPU", "cluster size", "the fastest plan that fits at this size",
              "predicted step time", "where the step time falls 8 times in 10 (from validation rows)",
              "training throughput", "throughput per GPU", "days to train the token budget",
              "GPUs x hours to train the token budget", "GPU-hours x the cluster's price per GPU-hour",
              "the GPUs at board power for the whole run (an estimate)",
              "what calibrates this cluster's GPU: its own runs, a preset's (a prior across GPU generations), or none")
    numeric = (False, False, True, False, True, True, True, True, True, True, True, True, False)
    return Table(headers, titles, numeric, tuple(rows), (), len(rows))


def throughput_chart(c: ClusterComparison) -> Chart:
    """Tokens/s per GPU of the best plan at each size, one line per cluster."""
    data: list[dict[str, Any]] = []
    sizes: set[int] = set()
    for i, (name, outcome, *_rest) in enumerate(c.outcomes):
        rows = sorted((r for r in outcome.rows if r.outcome.best is not None), key=lambda r: r.num_gpus)
        sizes.update(r.num_gpus for r in rows)
        data.append({
            "type": "scatter", "mode": "lines+markers", "name": name,
            "x": [r.num_gpus for r in rows], "y": [r.outcome.best.tokens_per_s / r.num_gpus for r in rows],
            "text": [f"<b>{name}, {r.num_gpus} GPUs</b><br>step {r.outcome.best.step_time_s:.3g} s" for r in rows],
            "hovertemplate": "%{text}<br>%{y:,.0f} tokens/s per GPU<extra></extra>",
            "line": {"color": PALETTE[i % len(PALETTE)], "width": 3}, "marker": {"size": 9},
        })
    ticks = sorted(sizes)
    layout = base_layout(400, xaxis={"title": {"text": "GPUs"}, "type": "log", "tickvals": ticks,
                                     "ticktext": [str(g) for g in ticks]},
                         yaxis={"title": {"text": "tokens/s per GPU (best plan)"}, "rangemode": "tozero"})
    return Chart("chart-cluster-throughput", "Throughput per GPU by cluster and size",
                 "Each line is one kind of cluster; each point the best fitting plan at that size. Higher is more "
                 "work from each GPU you pay for; a falling line is lost scaling.", tuple(data), layout)


def cost_time_chart(c: ClusterComparison) -> Chart | None:
    """Cost (or GPU-hours without prices) against days to train, a point per cluster and size; None without a
    token budget."""
    rows = [r for r in c.rows() if r["train_days"]]
    if not rows:
        return None
    priced = all(r["cost"] is not None for r in rows)
    names = list(dict.fromkeys(r["cluster"] for r in rows))
    data = []
    for i, name in enumerate(names):
        mine = [r for r in rows if r["cluster"] == name]
        data.append({
            "type": "scatter", "mode": "markers+text", "name": name, "x": [r["train_days"] for r in mine],
            "y": [r["cost"] if priced else r["gpu_hours"] for r in mine],
            "text": [str(r["num_gpus"]) for r in mine], "textposition": "top center",
            "customdata": [[r["plan"], r["energy_MWh"] or 0.0] for r in mine],
            "hovertemplate": f"<b>{name}</b>, %{{text}} GPUs<br>%{{x:.1f}} days<br>"
                             + ("cost %{y:,.0f}" if priced else "%{y:,.0f} GPU-hours")
                             + "<br>%{customdata[0]}<br>%{customdata[1]:.1f} MWh<extra></extra>",
            "marker": {"size": 12, "color": PALETTE[i % len(PALETTE)]},
        })
    layout = base_layout(420, xaxis={"title": {"text": "days to train the token budget"}, "rangemode": "tozero"},
                         yaxis={"title": {"text": "cost" if priced else "GPU-hours"}, "rangemode": "tozero"})
    what = "cost at each cluster's price per GPU-hour" if priced else "GPU-hours (give prices to see the cost)"
    return Chart("chart-cluster-cost", "Cost against time to train",
                 f"A point per cluster and size (the label is its GPU count): {what} against days. Down and to the "
                 "left is better; points on the lower-left edge are the choices worth weighing.", tuple(data), layout)


def cluster_headline(c: ClusterComparison) -> Headline:
    rows = [r for r in c.rows() if r["tokens_per_s"]]
    if not rows:
        return Headline("No plan fits", "No cluster and size in the comparison has a plan that fits its memory.",
                        (), ("Try more GPUs, a larger GPU, or a smaller micro-batch.",))
    fastest = max(rows, key=lambda r: r["tokens_per_s"])
    per_gpu = max(rows, key=lambda r: r["tokens_per_s"] / r["num_gpus"])
    metrics = [Metric("fastest", f"{fastest['cluster']}, {fastest['num_gpus']} GPUs",
                      f"{fmt_count(fastest['tokens_per_s'])} tokens/s"),
               Metric("most work per GPU", f"{per_gpu['cluster']}, {per_gpu['num_gpus']} GPUs",
                      f"{per_gpu['tokens_per_s'] / per_gpu['num_gpus']:,.0f} tokens/s per GPU")]
    reasons = [f"{fastest['cluster']} at {fastest['num_gpus']} GPUs runs {fastest['plan']} at a "
               f"{fmt_seconds(fastest['step_time_s'])} step."]
    costed = [r for r in rows if r["cost"] is not None]
    if costed:
        cheapest = min(costed, key=lambda r: r["cost"])
        metrics.append(Metric("cheapest", f"{cheapest['cluster']}, {cheapest['num_gpus']} GPUs",
                              f"{cheapest['cost']:,.0f} to train"))
        reasons.append(f"The cheapest way to train the token budget is {cheapest['cluster']} at "
                       f"{cheapest['num_gpus']} GPUs: {cheapest['cost']:,.0f} over {cheapest['train_days']:.1f} days.")
    energy = [r for r in rows if r["energy_MWh"]]
    if energy:
        least = min(energy, key=lambda r: r["energy_MWh"])
        reasons.append(f"Least GPU energy: {least['cluster']} at {least['num_gpus']} GPUs, "
                       f"{least['energy_MWh']:.1f} MWh ({ENERGY_NOTE.split(': ', 1)[1]}).")
    for name, _, _, _, status in c.outcomes:
        if status != "calibrated":
            reasons.append(f"{name}: {status}, so its figures are less certain than a calibrated cluster's "
                           "(its range says how much).")
    return Headline(f"{fastest['cluster']} is fastest", f"Best plans of {len(c.outcomes)} kinds of cluster compared "
                    "at each size.", tuple(metrics), tuple(reasons), reasons_title="What the comparison says")


def cluster_inputs(c: ClusterComparison, run: list[tuple[str, str]]) -> Inputs:
    first = c.outcomes[0][1]
    models = model_rows(first.model)
    clusters: list[tuple[str, str]] = []
    sources: list[str] = []
    for name, outcome, price, _watts, status in c.outcomes:
        clusters += [(f"{name} · {k}", v) for k, v in cluster_rows(outcome.cluster) if k != "name"]
        clusters.append((f"{name} · price per GPU-hour", "not given" if price is None else f"{price:g}"))
        sources += [str(s) for s in outcome.cluster.get("sources") or () if str(s) not in sources]
    summary = (("model", dict(models).get("name", "?")),
               ("clusters", "; ".join(f"{n} ({o.cluster.get('gpu', {}).get('name', '?')}, {s})"
                                      for n, o, _, _, s in c.outcomes)))
    return Inputs(tuple(models), tuple(clusters), tuple(sources), (), tuple(run), summary)


def render_cluster_compare_report(c: ClusterComparison, generated_at: datetime | None = None) -> str:
    stamp = _stamp(generated_at)
    sizes = sorted({r.num_gpus for _, o, *_ in c.outcomes for r in o.rows})
    model = c.outcomes[0][1].model.get("name", "model")
    names = [o[0] for o in c.outcomes]
    cap = ("The best fitting plan of each cluster at each size, from a search per cluster and size. Click a column "
           "header to sort.")
    if not any(r["train_days"] for r in c.rows()):
        cap += " Give a token budget (--tokens) to see days, GPU-hours, cost and energy."
    view = ClusterCompareView(cluster_table(c), cap, throughput_chart(c), cost_time_chart(c))
    run = [("echo-plan", __version__), ("report made", stamp), ("clusters compared", ", ".join(names)),
           ("sizes", ", ".join(str(s) for s in sizes) + " GPUs")]
    context = {
        "title": f"Which cluster for {model}: {', '.join(names)}",
        "subtitle": f"echo-plan {__version__} · {len(names)} clusters x {len(sizes)} sizes · {stamp}",
        "headline": cluster_headline(c), "headline_label": "Recommended cluster",
        "search": None, "compare": None, "clusters": view,
        "inputs": cluster_inputs(c, run),
        "notes": [ENERGY_NOTE, *[n for _, o, *_ in c.outcomes for n in o.notes]],
        "generated_at": stamp,
    }
    return _page(context, [view.throughput, view.cost_time])


def write_cluster_compare_report(c: ClusterComparison, path: str | Path) -> Path:
    """Render and write atomically (a whole file or none); returns the path written."""
    target = Path(path)
    write_atomic(target, render_cluster_compare_report(c))
    return target
