"""Render a SearchOutcome or CompareOutcome into one self-contained HTML file (Jinja2 + inline Plotly)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from echo_plan import __version__
from echo_plan.errors import EchoPlanError
from echo_plan.report.chart import Chart, fmt_seconds
from echo_plan.report.charts_compare import scaling_chart, train_cost_chart
from echo_plan.report.charts_plan import memory_chart, timeline_chart, timeline_window_chart
from echo_plan.report.charts_search import breakdown_chart, evaluated, progress_chart, pruned_chart, \
    throughput_memory_chart
from echo_plan.report.headline import compare_headline, search_headline
from echo_plan.report.inputs import build_inputs
from echo_plan.report.launch_view import launch_snippets
from echo_plan.report.table import knob_value_table, ranked_table, sizes_table
from echo_plan.search.results import CompareOutcome, SearchOutcome, TrialState, simulated_this_study
from echo_plan.files import write_atomic

Outcome = SearchOutcome | CompareOutcome


@dataclass(frozen=True, slots=True)
class SearchView:
    table: Any
    knobs: Any  # the per-knob-value table, or None
    charts: dict[str, Chart | None]
    run: tuple[tuple[str, str], ...]
    timeline_note: str | None
    launch: tuple = ()  # LaunchSnippet per framework for the recommended plan


def _run_rows(o: SearchOutcome) -> tuple[tuple[str, str], ...]:
    states = {s: sum(1 for t in o.trials if t.state is s) for s in TrialState}
    simulated = len(evaluated(o))
    rows = [
        ("sampler", f"{o.sampler} (seed {o.seed})"),
        ("trials", f"{len(o.trials)}: {simulated_this_study(o.trials)} simulated this study (as the CLI counts), "
                   f"{states[TrialState.COMPLETE]} complete with repeats, {states[TrialState.PRUNED]} pruned, "
                   f"{states[TrialState.FAILED]} failed"),
        ("candidates", f"{o.candidates_total} in the space, {sum(o.pruned_counts.values())} pruned before "
                       f"simulation, {simulated} distinct plans simulated, {len(o.ranked)} fit"),
        ("traces", f"{o.traces_made} made, {o.trace_cache_hits} from the cache"),
        ("search time", fmt_seconds(o.wall_s)),
        ("study", f"{o.study_name} in {o.storage}" if o.storage else o.study_name),
    ]
    return tuple(rows)


def search_view(o: SearchOutcome, timeline_note: str | None = None) -> SearchView:
    best = o.best
    charts: dict[str, Chart | None] = {
        "scatter": throughput_memory_chart(o),
        "breakdown": breakdown_chart(o) if o.ranked else None,
        "timeline": timeline_chart(best) if best is not None else None,
        "timeline_window": timeline_window_chart(best) if best is not None else None,
        "memory": memory_chart(best) if best is not None else None,
        "progress": progress_chart(o) if o.trials else None,
        "pruned": pruned_chart(o) if (o.pruned_counts or any(t.state is TrialState.FAILED for t in o.trials))
        else None,
    }
    if best is not None and not best.timeline and timeline_note is None:
        timeline_note = "No timeline: this result carries no timeline events of the recommended plan."
    return SearchView(ranked_table(o.ranked, o.tokens_budget, top=50), knob_value_table(o.pruned_by_knob), charts,
                      _run_rows(o), timeline_note, launch_snippets(o))


def _environment() -> Any:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("echo_plan.report", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html", "j2"), default_for_string=True),
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
    )


def _asset(env: Any, name: str) -> str:
    source, _, _ = env.loader.get_source(env, name)
    return source


def _script_json(obj: Any) -> str:
    """JSON safe to embed in a <script> element (no '</script>' can close it early)."""
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _page(context: dict[str, Any], charts: Sequence[Chart | None]) -> str:
    from markupsafe import Markup
    from plotly.offline import get_plotlyjs

    env = _environment()
    specs = [c.spec() for c in charts if c is not None]
    plotly_js = get_plotlyjs()
    if "</script" in plotly_js.lower():  # would end the inline script early
        raise EchoPlanError("this plotly build's JavaScript cannot be inlined (it contains '</script')")
    page = env.get_template("report.html.j2").render(
        css=Markup(_asset(env, "style.css")), report_js=Markup(_asset(env, "report.js")),
        plotly_js=Markup(plotly_js), data_json=Markup(_script_json({"charts": specs})),
        version=__version__, **context,
    )
    return page


def _stamp(generated_at: datetime | None) -> str:
    return (generated_at or datetime.now(timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")


def _gpus(cluster: dict[str, Any]) -> str:
    try:
        return f"{int(cluster['num_nodes']) * int(cluster['gpus_per_node'])} GPUs"
    except (KeyError, TypeError, ValueError):
        return "?"


def render_search_report(outcome: SearchOutcome, *, notes: Sequence[str] = (), timeline_note: str | None = None,
                         generated_at: datetime | None = None, sensitivity: Any = None) -> str:
    """The HTML report of one search: headline, ranked table, charts of the search and the best plan."""
    view = search_view(outcome, timeline_note)
    stamp = _stamp(generated_at)
    model, cluster = outcome.model.get("name", "model"), outcome.cluster.get("name", "cluster")
    run = [("echo-plan", __version__), ("report made", stamp), ("sampler", f"{outcome.sampler} (seed {outcome.seed})"),
           ("study", outcome.study_name)]
    context = {
        "title": f"Training plan for {model} on {cluster} ({_gpus(outcome.cluster)})",
        "subtitle": f"echo-plan {__version__} · {len(outcome.trials)} trials · sampler {outcome.sampler} · {stamp}",
        "headline": search_headline(outcome), "headline_label": "Recommended plan",
        "search": view, "compare": None,
        "inputs": build_inputs(outcome.model, outcome.cluster, outcome.space, run),
        "notes": [*outcome.notes, *notes], "generated_at": stamp, "sensitivity": sensitivity,
    }
    return _page(context, [*view.charts.values(), sensitivity.chart if sensitivity else None])


def detail_row(outcome: CompareOutcome):
    """The size shown in detail in a compare report: the fastest one with a fitting plan."""
    rows = [r for r in outcome.rows if r.outcome.best is not None]
    if not rows:
        return max(outcome.rows, key=lambda r: r.num_gpus, default=None)
    return max(rows, key=lambda r: (r.outcome.best.tokens_per_s, -r.num_gpus))  # type: ignore[union-attr]


def render_compare_report(outcome: CompareOutcome, *, notes: Sequence[str] = (), timeline_note: str | None = None,
                          generated_at: datetime | None = None, sensitivity: Any = None) -> str:
    """The HTML report of a compare: sizes side by side, then the fastest size's search in detail."""
    if not outcome.rows:
        raise EchoPlanError("the compare result has no cluster sizes to report")
    stamp = _stamp(generated_at)
    row = detail_row(outcome)
    view = search_view(row.outcome, timeline_note) if row is not None else None
    compare_charts = {"scaling": scaling_chart(outcome), "train_cost": train_cost_chart(outcome)}
    sizes = ", ".join(str(r.num_gpus) for r in sorted(outcome.rows, key=lambda r: r.num_gpus))
    cap = "The best fitting plan at each size, from a search at each size. Click a column header to sort."
    if outcome.tokens_budget is None:
        cap += " Give a token budget to see the time to train."
    space = row.outcome.space if row is not None else {}
    run = [("echo-plan", __version__), ("report made", stamp), ("sizes compared", f"{sizes} GPUs"),
           ("compare time", fmt_seconds(outcome.wall_s))]
    if outcome.price_per_gpu_hour is not None:
        run.append(("price per GPU-hour", f"{outcome.price_per_gpu_hour:g}"))
    context = {
        "title": f"Cluster size for {outcome.model.get('name', 'model')} on {outcome.cluster.get('name', 'cluster')}",
        "subtitle": f"echo-plan {__version__} · {sizes} GPUs compared · {stamp}",
        "headline": compare_headline(outcome), "headline_label": "Recommended size and plan",
        "search": view,
        "compare": {"table": sizes_table(outcome.rows), "table_caption": cap, "charts": compare_charts,
                    "detail_gpus": row.num_gpus if row is not None else 0},
        "inputs": build_inputs(outcome.model, outcome.cluster, space, run),
        "notes": [*outcome.notes, *notes], "generated_at": stamp,
    }
    charts = list(compare_charts.values()) + (list(view.charts.values()) if view is not None else [])
    return _page(context, charts)


def render_report(outcome: Outcome, **kwargs: Any) -> str:
    if isinstance(outcome, CompareOutcome):
        return render_compare_report(outcome, **kwargs)
    if isinstance(outcome, SearchOutcome):
        return render_search_report(outcome, **kwargs)
    raise EchoPlanError(f"cannot make a report of a {type(outcome).__name__}")


def write_report(outcome: Outcome, path: str | Path, **kwargs: Any) -> Path:
    """Render and write the report atomically (a whole file or none); returns the path written."""
    target = Path(path)
    if target.suffix.lower() not in (".html", ".htm"):
        raise EchoPlanError(f"report file {str(target)!r} should end in .html")
    return write_atomic(target, render_report(outcome, **kwargs))
