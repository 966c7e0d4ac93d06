"""Charts over a whole search: throughput vs memory, step-time breakdown, search progress, pruning."""

from __future__ import annotations

import json
import math
from typing import Any

from echo_plan.replay.results import StepResult
from echo_plan.report.chart import (
    BEST_COLOR, BREAKDOWN_COLORS, BREAKDOWN_NAMES, FIT_COLOR, FRONT_COLOR, NOFIT_COLOR, CAPACITY_COLOR,
    Chart, base_layout, fmt_count, label_margin, log_ticks,
)
from echo_plan.report.pareto import pareto_front
from echo_plan.report.plans import short_label
from echo_plan.search.results import SearchOutcome, TrialState


def evaluated(outcome: SearchOutcome) -> list[tuple[int | None, StepResult]]:
    """(trial number, result) of every simulated plan, one per distinct plan, first trial kept.

    Falls back to the ranked plans when the outcome carries no trials (a trimmed JSON result).
    """
    seen: set[str] = set()
    out: list[tuple[int | None, StepResult]] = []
    for t in sorted(outcome.trials, key=lambda t: t.number):
        if t.state is TrialState.COMPLETE and t.result is not None:
            key = json.dumps(t.plan, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append((t.number, t.result))
    if not out:
        out = [(None, r) for r in outcome.ranked]
    return out


def hover_text(r: StepResult, trial: int | None = None) -> str:
    over = r.overflow
    if over is None:
        fit = "fits"
    else:
        fit = f"does NOT fit (stage {over[0]} over by {over[1]:.1f} GiB)"
    head = f"<b>{short_label(r.plan)}</b>" + (f"  (trial {trial})" if trial is not None else "")
    return (f"{head}<br>step {r.step_time_s:.3g} s · {fmt_count(r.tokens_per_s)} tokens/s · MFU {r.mfu:.1%}"
            f"<br>peak memory {r.memory_peak_gib:.1f} GiB, {fit}")


def capacity_gib(outcome: SearchOutcome) -> float | None:
    for _, r in evaluated(outcome):
        if r.memory:
            return r.memory[0].capacity_bytes / 2**30
    gpu = outcome.cluster.get("gpu") if isinstance(outcome.cluster, dict) else None
    return float(gpu["hbm_GiB"]) if isinstance(gpu, dict) and "hbm_GiB" in gpu else None


def throughput_memory_chart(outcome: SearchOutcome) -> Chart:
    points = evaluated(outcome)
    best = outcome.best
    data: list[dict[str, Any]] = []
    for fits, name, color, symbol in ((True, "fits in GPU memory", FIT_COLOR, "circle"),
                                       (False, "does not fit", NOFIT_COLOR, "x")):
        sel = [(n, r) for n, r in points if r.fits is fits]
        if sel:
            data.append({
                "type": "scatter", "mode": "markers", "name": f"{name} ({len(sel)})",
                "x": [r.memory_peak_gib for _, r in sel], "y": [r.tokens_per_s for _, r in sel],
                "text": [hover_text(r, n) for n, r in sel], "hovertemplate": "%{text}<extra></extra>",
                "marker": {"color": color, "size": 7, "symbol": symbol, "opacity": 0.75,
                           "line": {"width": 0.5, "color": "white"}},
            })
    front = pareto_front([(r.memory_peak_gib, r.tokens_per_s) for _, r in points])
    if front:
        data.append({
            "type": "scatter", "mode": "lines", "name": "Pareto front", "line": {"color": FRONT_COLOR,
                                                                                  "width": 2, "shape": "hv"},
            "x": [points[i][1].memory_peak_gib for i in front], "y": [points[i][1].tokens_per_s for i in front],
            "hoverinfo": "skip",
        })
    if best is not None:
        data.append({
            "type": "scatter", "mode": "markers", "name": "recommended",
            "x": [best.memory_peak_gib], "y": [best.tokens_per_s],
            "text": [hover_text(best)], "hovertemplate": "<b>recommended</b><br>%{text}<extra></extra>",
            "marker": {"color": BEST_COLOR, "size": 16, "symbol": "star", "line": {"width": 1, "color": "white"}},
        })
    mems = [r.memory_peak_gib for _, r in points if r.memory_peak_gib > 0]
    log_x = bool(mems) and max(mems) / min(mems) > 10
    cap = capacity_gib(outcome)
    headroom = next((r.memory[0].headroom_bytes / 2**30 for _, r in points if r.memory), 0.0)
    shapes, annotations = [], []
    if cap is not None:
        usable = cap - headroom
        shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": usable, "x1": usable, "y0": 0, "y1": 1,
                       "line": {"color": CAPACITY_COLOR, "width": 2, "dash": "dash"}})
        if headroom > 0:
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": cap, "x1": cap, "y0": 0, "y1": 1,
                           "line": {"color": CAPACITY_COLOR, "width": 1, "dash": "dot"}})
        # annotations on a log axis take log10 of the position (shapes take the value itself)
        text = (f"usable {usable:.0f} GiB ({cap:g} GiB less {headroom:.1f} headroom) " if headroom > 0
                else f"GPU memory {cap:g} GiB ")
        annotations.append({"x": math.log10(usable) if log_x else usable, "y": 1, "xref": "x", "yref": "paper",
                            "text": text, "showarrow": False, "xanchor": "right",
                            "yanchor": "top", "font": {"color": CAPACITY_COLOR}})
    layout = base_layout(420, xaxis={"title": {"text": "peak memory per GPU (GiB)" + (", log scale" if log_x else "")},
                                     "type": "log" if log_x else "linear",
                                     **({"tickvals": log_ticks(min(mems), max(mems))} if log_x else {})},
                         yaxis={"title": {"text": "throughput (tokens/s)"}},
                         shapes=shapes, annotations=annotations, hovermode="closest")
    return Chart("chart-scatter", "Throughput vs peak memory",
                 f"Every simulated plan ({len(points)}). Up is faster, left uses less memory; plans right of "
                 "the dashed line do not fit. The orange line is the Pareto front: no plan is both faster "
                 "and leaner than a plan on it. Hover a point to see its plan.", tuple(data), layout)


def breakdown_chart(outcome: SearchOutcome, top: int = 10) -> Chart:
    results = list(outcome.ranked[:top])
    labels = [f"#{i + 1} {short_label(r.plan)}" for i, r in enumerate(results)]
    data = []
    for key, color in BREAKDOWN_COLORS.items():
        values = [r.breakdown.as_json()[key] for r in results]
        data.append({
            "type": "bar", "orientation": "h", "name": BREAKDOWN_NAMES[key], "y": labels, "x": values,
            "marker": {"color": color},
            "hovertemplate": f"%{{y}}<br>{BREAKDOWN_NAMES[key]}: %{{x:.3g}} s<extra></extra>",
        })
    layout = base_layout(max(260, 70 + 34 * len(results)), barmode="stack",
                         xaxis={"title": {"text": "step time (s)"}},
                         yaxis={"autorange": "reversed"}, margin={"l": label_margin(labels)})
    return Chart("chart-breakdown", f"Where the step time goes (top {len(results)} plans)",
                 "Each bar is one plan's step; its segments add up to the step time: compute, communication "
                 "that is not hidden behind compute, pipeline bubble, slowdown from overlapping kernels, and "
                 "the optimizer step.", tuple(data), layout)


def progress_chart(outcome: SearchOutcome) -> Chart:
    done = sorted(((t.number, t.result) for t in outcome.trials
                   if t.state is TrialState.COMPLETE and t.result is not None), key=lambda x: x[0])
    data: list[dict[str, Any]] = []
    for fits, name, color in ((True, "fits", FIT_COLOR), (False, "does not fit", NOFIT_COLOR)):
        sel = [(n, r) for n, r in done if r.fits is fits]
        if sel:
            data.append({"type": "scatter", "mode": "markers", "name": f"trial: {name}",
                         "x": [n for n, _ in sel], "y": [r.step_time_s for _, r in sel],
                         "text": [f"trial {n}: {short_label(r.plan)}" for n, r in sel],
                         "hovertemplate": "%{text}<br>step %{y:.4g} s<extra></extra>",
                         "marker": {"color": color, "size": 5}})
    xs, ys, best = [], [], float("inf")
    for n, r in done:
        if r.fits and r.step_time_s < best:
            best = r.step_time_s
            xs.append(n)
            ys.append(best)
    if xs:
        last = done[-1][0]
        if xs[-1] != last:
            xs.append(last)
            ys.append(best)
        data.append({"type": "scatter", "mode": "lines", "name": "best so far (fits)", "x": xs, "y": ys,
                     "line": {"color": BEST_COLOR, "width": 2.5, "shape": "hv"},
                     "hovertemplate": "best after trial %{x}: %{y:.3g} s<extra></extra>"})
    steps = [r.step_time_s for _, r in done if r.step_time_s > 0]
    log = bool(steps) and max(steps) / min(steps) > 20
    layout = base_layout(340, xaxis={"title": {"text": "trial"}},
                         yaxis={"title": {"text": "step time (s)"}, "type": "log" if log else "linear"})
    return Chart("chart-progress", "Best step time by trial",
                 f"{len(done)} simulated trials in the order the sampler ({outcome.sampler}) proposed them; the "
                 "red line is the fastest fitting plan found so far.", tuple(data), layout)


def pruned_chart(outcome: SearchOutcome) -> Chart:
    counts = dict(outcome.pruned_counts)
    failed = sum(1 for t in outcome.trials if t.state is TrialState.FAILED)
    if failed:
        counts["evaluation failed"] = counts.get("evaluation failed", 0) + failed
    items = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    data = ({"type": "bar", "orientation": "h", "y": [k for k, _ in items], "x": [v for _, v in items],
             "marker": {"color": "#9D755D"}, "name": "pruned",
             "text": [str(v) for _, v in items], "textposition": "auto",
             "hovertemplate": "%{y}: %{x} candidates<extra></extra>"},)
    layout = base_layout(max(200, 80 + 30 * len(items)), showlegend=False,
                         xaxis={"title": {"text": "candidates"}},
                         yaxis={"autorange": "reversed"}, margin={"l": label_margin([k for k, _ in items])})
    total = sum(outcome.pruned_counts.values())
    return Chart("chart-pruned", "Candidates pruned, by reason",
                 f"{total} of {outcome.candidates_total} candidate plans were rejected before simulation "
                 "(invalid for this model and cluster, or estimated not to fit)"
                 + (f"; {failed} evaluation{'s' if failed > 1 else ''} failed" if failed else "") + ".", data, layout)
