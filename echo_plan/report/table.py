"""The ranked table: top plans with the knobs that vary as columns, cells unlike #1 highlighted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from echo_plan.replay.results import StepResult
from echo_plan.report.chart import fmt_count, fmt_seconds
from echo_plan.report.plans import constant_knobs, differing_knobs, knob_value, short_label
from echo_plan.search.results import CompareRow

NO_VALUE = 1e308  # sorts after every real value (JSON/JS have no infinity literal)


@dataclass(frozen=True, slots=True)
class Cell:
    text: str
    sort: float | str  # what the column sorts by
    differs: bool = False  # a knob set otherwise than in the recommended plan
    numeric: bool = True


@dataclass(frozen=True, slots=True)
class Table:
    headers: tuple[str, ...]
    titles: tuple[str, ...]  # per column: what the header means (hover)
    numeric: tuple[bool, ...]  # per column: sorts as a number
    rows: tuple[tuple[Cell, ...], ...]
    constant: tuple[tuple[str, str], ...]  # (knob, value) the same in every row
    total: int  # how many ranked plans there are (the table may show fewer)

    @property
    def has_differences(self) -> bool:
        return any(c.differs for row in self.rows for c in row)


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def ranked_table(ranked: tuple[StepResult, ...], tokens_budget: float | None = None, top: int = 25) -> Table:
    shown = list(ranked[:top])
    plans = [r.plan for r in shown]
    knobs = differing_knobs(plans) if len(plans) > 1 else []
    best = shown[0] if shown else None
    headers = ["#"] + [k.header for k in knobs] + ["step time", "80% range", "vs #1", "tokens/s", "MFU", "peak GiB"]
    titles = ["rank"] + [k.long for k in knobs] + [
        "predicted training step time", "where the measured step time is expected, 80% of the time",
        "slower than the recommended plan", "training throughput",
        "model FLOPs utilisation", "peak memory of the fullest GPU"]
    if tokens_budget:
        headers.append("time to train")
        titles.append("wall-clock time to train the token budget")
    rows = []
    for i, r in enumerate(shown):
        cells = [Cell(str(i + 1), i + 1)]
        for k in knobs:
            text = knob_value(r.plan, k)
            num = _as_number(text)
            cells.append(Cell(text, num if num is not None else text,
                              differs=best is not None and text != knob_value(best.plan, k), numeric=num is not None))
        slower = r.step_time_s / best.step_time_s - 1 if best and best.step_time_s > 0 else 0.0
        rng = r.step_time_range_s
        cells += [
            Cell(fmt_seconds(r.step_time_s, 4), r.step_time_s),
            Cell(f"{fmt_seconds(rng[0])} - {fmt_seconds(rng[1])}" if rng else "-", rng[1] if rng else NO_VALUE),
            Cell("-" if i == 0 else f"+{slower:.1%}", slower),
            Cell(fmt_count(r.tokens_per_s), r.tokens_per_s),
            Cell(f"{r.mfu:.1%}", r.mfu),
            Cell(f"{r.memory_peak_gib:.1f}", r.memory_peak_gib),
        ]
        if tokens_budget:
            cells.append(_optional(tokens_budget / r.tokens_per_s if r.tokens_per_s > 0 else None, fmt_seconds))
        rows.append(tuple(cells))
    numeric = tuple(all(row[j].numeric for row in rows) if rows else True for j in range(len(headers)))
    constant = tuple((k.long, v) for k, v in constant_knobs(plans)) if len(plans) > 1 else ()
    return Table(tuple(headers), tuple(titles), numeric, tuple(rows), constant, len(ranked))


def sizes_table(rows: tuple[CompareRow, ...]) -> Table:
    """One row per cluster size: its best plan and what it would take to train."""
    has_time = any(r.train_time_s is not None for r in rows)
    has_hours = any(r.gpu_hours is not None for r in rows)
    has_cost = any(r.cost is not None for r in rows)
    headers = ["GPUs", "best plan", "step time", "tokens/s", "MFU", "peak GiB", "scaling eff."]
    headers += (["time to train"] if has_time else []) + (["GPU-hours"] if has_hours else [])
    headers += ["cost"] if has_cost else []
    has_good = any(r.goodput_tokens_per_s is not None for r in rows)
    has_fail_time = any(r.train_time_failures_s is not None for r in rows)
    headers += (["goodput tokens/s", "ETTR"] if has_good else []) + (["time with failures"] if has_fail_time else [])
    out = []
    for r in sorted(rows, key=lambda r: r.num_gpus):
        b = r.outcome.best
        cells = [Cell(str(r.num_gpus), r.num_gpus)]
        if b is None:
            cells += [Cell("no plan fits", "~", numeric=False)] + [Cell("-", NO_VALUE) for _ in range(5)]
        else:
            eff = r.scaling_efficiency
            cells += [Cell(short_label(b.plan), short_label(b.plan), numeric=False),
                      Cell(fmt_seconds(b.step_time_s), b.step_time_s),
                      Cell(fmt_count(b.tokens_per_s), b.tokens_per_s),
                      Cell(f"{b.mfu:.1%}", b.mfu), Cell(f"{b.memory_peak_gib:.1f}", b.memory_peak_gib),
                      Cell("-" if eff is None else f"{eff:.0%}", -1.0 if eff is None else eff)]
        if has_time:
            trng = b.tokens_per_s_range if b is not None else None
            if trng and r.train_time_s is not None:
                lo, hi = r.train_time_s * b.tokens_per_s / trng[1], r.train_time_s * b.tokens_per_s / trng[0]
                cells.append(Cell(f"{fmt_seconds(r.train_time_s)} ({fmt_seconds(lo)} - {fmt_seconds(hi)})",
                                  r.train_time_s))
            else:
                cells.append(_optional(r.train_time_s, fmt_seconds))
        if has_hours:
            cells.append(_optional(r.gpu_hours, lambda v: f"{v:,.0f}"))
        if has_cost:
            cells.append(_optional(r.cost, lambda v: f"{v:,.0f}"))
        if has_good:
            cells.append(_optional(r.goodput_tokens_per_s, fmt_count))
            cells.append(_optional(r.ettr, lambda v: f"{v:.1%}"))
        if has_fail_time:
            cells.append(_optional(r.train_time_failures_s, fmt_seconds))
        out.append(tuple(cells))
    numeric = tuple(all(row[j].numeric for row in out) if out else True for j in range(len(headers)))
    return Table(tuple(headers), tuple(headers), numeric, tuple(out), (), len(rows))


def _optional(value: float | None, fmt: Callable[[float], str]) -> Cell:
    return Cell("-", NO_VALUE) if value is None else Cell(fmt(value), value)


def knob_value_table(pruned_by_knob: dict[str, dict[str, dict[str, int]]]) -> Table | None:
    """Per value of each varying knob: candidates, how many passed the checks, how many were
    simulated, and the main reason the rest were pruned ("why was TP 4 never tried")."""
    counts = ("candidates", "valid", "evaluated")
    rows = []
    for knob, values in pruned_by_knob.items():
        if len(values) < 2:
            continue
        for value, row in values.items():
            reasons = {k: n for k, n in row.items() if k not in counts and n > 0}
            main = max(reasons.items(), key=lambda kv: (kv[1], kv[0]), default=None)
            why = "-" if main is None else f"{main[0]} ({main[1]})"
            rows.append((Cell(knob.replace("_", " "), knob, numeric=False), Cell(str(value), str(value), numeric=False),
                         Cell(str(row.get("candidates", 0)), row.get("candidates", 0)),
                         Cell(str(row.get("valid", 0)), row.get("valid", 0)),
                         Cell(str(row.get("evaluated", 0)), row.get("evaluated", 0),
                              differs=row.get("evaluated", 0) == 0),
                         Cell(why, why, numeric=False)))
    if not rows:
        return None
    headers = ("knob", "value", "candidates", "passed checks", "simulated", "most pruned for")
    titles = ("search-space knob", "its value", "candidate plans with this value",
              "of those, plans that passed the validity and memory checks", "of those, plans the search simulated",
              "the commonest reason plans with this value were pruned")
    return Table(headers, titles, (False, False, True, True, True, False), tuple(rows), (), len(rows))
