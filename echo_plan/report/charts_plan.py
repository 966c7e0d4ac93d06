"""Charts of one plan's step: the pipeline timeline and the memory of each pipeline stage."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from echo_plan.replay.results import StepResult, TimelineEvent
from echo_plan.report.chart import CAPACITY_COLOR, GiB, MEMORY_COLORS, PALETTE, Chart, base_layout, label_margin

# Fixed colours for the categories the replay emits; any other category takes the next free colour.
CATEGORY_COLORS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "backward-input": "#F2A93B",  # zero-bubble B: the input gradient (schedules zb-h1, zb-v, dualpipe)
    "backward-weight": "#8C564B",  # zero-bubble W: the weight gradients, deferred
    "recompute": "#9ECAE9",
    "p2p": "#E45756",
    "tp": "#B279A2",
    "dp": "#72B7B2",
    "optimizer": "#54A24B",
}
# Rows of a stage, top to bottom: the replay's streams (echo_plan/replay), the two pipeline
# directions drawn on one row to keep the chart short.
STREAM_ROW = {"compute": "compute", "tp_comm": "TP comm", "pp_fwd": "PP comm", "pp_bwd": "PP comm",
              "pp_comm": "PP comm", "pp_gather": "PP recv gather", "dp_comm": "DP comm"}
ROW_ORDER = ("compute", "TP comm", "PP comm", "PP recv gather", "DP comm")


def _row_labels(events: tuple[TimelineEvent, ...], pp: int) -> tuple[dict[tuple[int, str], str], list[str]]:
    """The row label of each (rank, stream), and the rows in drawing order."""
    ranks = sorted({e.rank for e in events})
    word = "stage" if len(ranks) <= max(pp, 1) else "rank"
    rows_of: dict[int, set[str]] = defaultdict(set)
    labels: dict[tuple[int, str], str] = {}
    for e in events:
        row = STREAM_ROW.get(e.stream, e.stream.replace("_", " "))
        rows_of[e.rank].add(row)
        labels[(e.rank, e.stream)] = f"{word} {e.rank} · {row}"
    order: list[str] = []
    for rank in ranks:
        rows = sorted(rows_of[rank], key=lambda r: (ROW_ORDER.index(r) if r in ROW_ORDER else len(ROW_ORDER), r))
        order += [f"{word} {rank} · {row}" for row in rows]
    return labels, order


def category_colors(categories: list[str]) -> dict[str, str]:
    colors = dict(CATEGORY_COLORS)
    spare = [c for c in PALETTE if c not in colors.values()] or list(PALETTE)
    for i, cat in enumerate(c for c in categories if c not in colors):
        colors[cat] = spare[i % len(spare)]
    return colors


def raster(events: tuple[TimelineEvent, ...], row_of: dict[tuple[int, str], int], n_rows: int,
           cat_index: dict[str, int], bins: int) -> tuple[float, list[list[int | None]], list[list[str]]]:
    """The step cut into ``bins`` equal time slots per row: which category and event fills each slot.

    A slot shows the event running at its middle, so where events are shorter than a slot (forward
    and backward chunks of many micro-batches) the slots sample them in proportion to their time;
    a slot whose middle is idle shows the event that overlaps it longest, so even an event shorter
    than a slot shows. Returns (slot width in seconds, category index or None, event name per slot).
    """
    end = max(e.start_s + e.duration_s for e in events)
    width = end / bins if end > 0 else 1.0
    z: list[list[int | None]] = [[None] * bins for _ in range(n_rows)]
    names = [[""] * bins for _ in range(n_rows)]
    rank = [[(False, 0.0)] * bins for _ in range(n_rows)]  # (covers the middle, overlap) of the shown event
    for e in events:
        row = row_of[(e.rank, e.stream)]
        e0, e1 = e.start_s, e.start_s + e.duration_s
        first, last = int(e0 / width), min(bins - 1, int(e1 / width))
        for b in range(max(0, first), last + 1):
            mid = (b + 0.5) * width
            key = (e0 <= mid < e1, min(e1, (b + 1) * width) - max(e0, b * width))
            if z[row][b] is None or key > rank[row][b]:
                rank[row][b] = key
                z[row][b] = cat_index[e.category]
                names[row][b] = e.name
    return width, z, names


# Heatmap cells the browser draws at about 10 us each on a busy 2-core machine (measured with
# benchmarks/report_bench.py): ~36k cells keep the timeline near a third of a second.
CELL_BUDGET = 36_000


def timeline_chart(result: StepResult, bins: int | None = None) -> Chart | None:
    """Stages (and their streams) by time, coloured by what runs; None without events.

    Drawn as a raster (a heatmap of ``bins`` time slots per row; by default as many as keep the
    chart within CELL_BUDGET cells, 300 to 1000, about one per pixel column) so that a step of tens
    of thousands of events draws as fast as one of ten, and hovering anywhere names the event.
    """
    events = result.timeline
    if not events:
        return None
    labels, order = _row_labels(events, int(result.plan.get("pp", 1)))
    if bins is None:
        bins = max(300, min(1000, CELL_BUDGET // len(order)))
    row_of = {key: order.index(label) for key, label in labels.items()}
    present = {e.category for e in events}
    cats = sorted(present, key=lambda c: (list(CATEGORY_COLORS).index(c) if c in CATEGORY_COLORS else 99, c))
    colors = category_colors(cats)
    width, z, names = raster(events, row_of, len(order), {c: i for i, c in enumerate(cats)}, bins)
    k = len(cats)
    scale = []
    for i, c in enumerate(cats):
        scale += [[i / k, colors[c]], [(i + 1) / k, colors[c]]]
    end_s = bins * width
    unit, scale_to = ("s", 1.0) if end_s >= 2.0 else ("ms", 1e3)
    data: list[dict[str, Any]] = [{
        "type": "heatmap", "x": [(b + 0.5) * width * scale_to for b in range(bins)], "y": order, "z": z,
        "text": names, "zmin": -0.5, "zmax": k - 0.5, "colorscale": scale, "showscale": False, "ygap": 3,
        "hoverongaps": False, "name": "timeline",
        "hovertemplate": "%{y}<br>%{text}<br>at %{x:.4g} " + unit + "<extra></extra>",
    }]
    for c in cats:  # legend entries: the heatmap itself has none
        data.append({"type": "scatter", "mode": "markers", "name": c, "x": [None], "y": [None],
                     "marker": {"color": colors[c], "symbol": "square", "size": 12}, "hoverinfo": "skip"})
    row_px = 30 if len(order) <= 16 else 22
    layout = base_layout(max(240, 90 + row_px * len(order)), hovermode="closest",
                         xaxis={"title": {"text": f"time in the step ({unit})"}, "range": [0, end_s * scale_to]},
                         yaxis={"autorange": "reversed", "showgrid": False,
                                "categoryorder": "array", "categoryarray": order},
                         margin={"l": label_margin(order)})
    return Chart("chart-timeline", "Pipeline timeline of the recommended plan",
                 f"One simulated step ({len(events)} events): each row is a pipeline stage's compute or "
                 "communication stream, coloured by what runs: forward and backward chunks of micro-batches, "
                 "point-to-point transfers, gradient reduction, the optimizer step. White on a compute row is "
                 f"pipeline bubble or waiting. Each row is cut into {bins} slots of {width * 1e3:.3g} ms; a slot "
                 "shows what runs at its middle (or a shorter event inside it). Hover to name an event."
                 + (" Zero-bubble and DualPipe schedules split a backward into 'backward-input' (B: the input "
                    "gradient the previous stage waits for) and 'backward-weight' (W: the weight gradients, run "
                    "later to fill bubbles)." if "backward-weight" in present else "")
                 + (" 'PP recv gather' rows: without sequence parallelism a stage receives each message in 1/tp "
                    "parts and all-gathers it over TP before using it (coloured as p2p)."
                    if any(e.stream == "pp_gather" for e in events) else ""),
                 tuple(data), layout)


WINDOW_MIN_PASSES = 6  # a window below a sixth of the step is worth its own chart


def timeline_window_chart(result: StepResult, bins: int = 600) -> Chart | None:
    """The start of the step at full resolution: warm-up and the first steady-state micro-batches, where
    the whole-step chart of a long step squeezes many passes into each slot (None for short steps)."""
    events = result.timeline
    pp = max(1, int(result.plan.get("pp", 1)))
    if not events or pp < 2:
        return None
    first = min(e.rank for e in events)
    backward = [e.start_s for e in events if e.rank == first and e.stream == "compute"
                and e.category in ("backward", "backward-input")]
    if not backward:
        return None
    end = 2.5 * min(backward)  # stage 0's warm-up (its first backward starts), then as long again and half more
    if end <= 0 or end * WINDOW_MIN_PASSES > max(e.start_s + e.duration_s for e in events):
        return None  # a short step: the whole-step chart already shows every pass
    window = tuple(e for e in events if e.start_s < end)
    from dataclasses import replace

    clipped = tuple(replace(e, duration_s=min(e.duration_s, end - e.start_s)) for e in window)
    chart = timeline_chart(replace(result, timeline=clipped), bins)
    if chart is None:
        return None
    return replace(chart, id="chart-timeline-window",
                   title="The start of the step, at full resolution",
                   caption=f"The first {end * 1e3:.4g} ms of the same step ({len(clipped)} events): the warm-up "
                           "forwards, the first forward/backward pairs, each point-to-point transfer and each wait "
                           "between them, drawn at full resolution (the whole step above samples them). Hover "
                           "to name an event.")


def memory_chart(result: StepResult) -> Chart | None:
    """Stacked memory of each pipeline stage against the GPU's capacity; None without memory records."""
    if not result.memory:
        return None
    stages = [f"stage {m.stage}" for m in result.memory]
    parts = {
        "weights": [m.weights_bytes for m in result.memory],
        "gradients": [m.gradients_bytes for m in result.memory],
        "optimizer": [m.optimizer_bytes for m in result.memory],
        "activations": [m.activations_bytes for m in result.memory],
        "buffers": [m.buffers_bytes for m in result.memory],
    }
    data = [{"type": "bar", "name": name, "x": stages, "y": [b / GiB for b in values],
             "marker": {"color": MEMORY_COLORS[name]},
             "hovertemplate": f"%{{x}}<br>{name}: %{{y:.2f}} GiB<extra></extra>"}
            for name, values in parts.items()]
    cap = max(m.capacity_bytes for m in result.memory) / GiB
    top = max(m.total_bytes for m in result.memory) / GiB
    layout = base_layout(
        360, barmode="stack",
        yaxis={"title": {"text": "GiB per GPU"}, "range": [0, max(cap, top) * 1.12]},
        shapes=[{"type": "line", "xref": "paper", "x0": 0, "x1": 1, "y0": cap, "y1": cap,
                 "line": {"color": CAPACITY_COLOR, "width": 2, "dash": "dash"}}],
        annotations=[{"xref": "paper", "x": 1, "y": cap, "text": f"capacity {cap:g} GiB", "showarrow": False,
                      "xanchor": "right", "yanchor": "bottom", "font": {"color": CAPACITY_COLOR}}],
    )
    caption = f"Peak memory of one GPU of each stage, by what holds it, against the {cap:g} GiB the GPU has."
    if len(result.memory) > 1 and result.plan.get("schedule") != "gpipe":
        caption += " Under 1F1B early stages keep more micro-batches' activations in flight."
    return Chart("chart-memory", "Memory per pipeline stage of the recommended plan", caption,
                 tuple(data), layout)
