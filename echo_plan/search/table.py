"""Ranked plans as rows, a text table and CSV (what ``search`` and ``compare`` print or write)."""

from __future__ import annotations

import csv
import io
from typing import Any

from echo_plan.replay.results import StepResult
from echo_plan.search.results import CompareOutcome, SearchOutcome
from echo_plan.specs.plan import PlanSpec

RANK_COLUMNS = ["rank", "plan", "tp", "cp", "pp", "dp", "micro_batch_size", "virtual_stages", "schedule", "recompute",
                "recompute_layers", "sequence_parallel", "distributed_optimizer", "sharding", "shard_degree",
                "overlap_grad_reduce", "overlap_param_gather", "offload_optimizer",
                "step_time_s", "tokens_per_s", "mfu", "memory_peak_gib", "margin_to_next",
                "step_time_low_s", "step_time_high_s", "memory_free_gib", "goodput_tokens_per_s", "ettr"]


def cell(v: Any, spec: str) -> str:
    """A table cell: ``v`` formatted, or "-" when there is none."""
    return "-" if v is None else format(v, spec)


def plan_label(plan: dict[str, Any]) -> str:
    try:
        return PlanSpec.build(plan).short()
    except Exception:  # a stored plan from an older version: show its fields
        return " ".join(f"{k}={v}" for k, v in plan.items())


def ranked_rows(ranked: tuple[StepResult, ...], top: int | None = None) -> list[dict[str, Any]]:
    """One row per plan, fastest first; ``margin_to_next`` is how much slower the next plan is."""
    rows = []
    shown = ranked if top is None else ranked[:top]
    for i, r in enumerate(shown):
        nxt = ranked[i + 1] if i + 1 < len(ranked) else None
        margin = (nxt.step_time_s / r.step_time_s - 1.0) if nxt is not None and r.step_time_s > 0 else None
        row = {"rank": i + 1, "plan": plan_label(r.plan)}
        row.update({k: r.plan.get(k) for k in RANK_COLUMNS[2:RANK_COLUMNS.index("step_time_s")]})
        row["cp"] = row["cp"] or 1  # plans stored before context parallelism
        rng = r.step_time_range_s
        free = min((m.free_bytes for m in r.memory), default=None)
        row.update(step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s, mfu=r.mfu,
                   memory_peak_gib=r.memory_peak_gib, margin_to_next=margin,
                   step_time_low_s=rng[0] if rng else None, step_time_high_s=rng[1] if rng else None,
                   memory_free_gib=free / 2**30 if free is not None else None,
                   goodput_tokens_per_s=r.goodput_tokens_per_s,
                   ettr=r.goodput["effective_training_time_ratio"] if r.goodput else None)
        rows.append(row)
    return rows


def format_ranked(outcome: SearchOutcome, top: int) -> list[str]:
    rows = ranked_rows(outcome.ranked, top)
    if not rows:
        return ["no simulated plan fits in memory"]
    width = max(len(r["plan"]) for r in rows)
    head = (f"{'#':>3}  {'plan':<{width}}  {'step s':>8}  {'80% range s':>13}  {'tokens/s':>10}  {'MFU':>6}  "
            f"{'mem GiB':>8}  {'free':>5}  {'to next':>8}  {'goodput':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        margin = f"{r['margin_to_next']:+.2%}" if r["margin_to_next"] is not None else "-"
        rng = (f"{r['step_time_low_s']:.2f}-{r['step_time_high_s']:.2f}" if r["step_time_low_s"] is not None
               else "-")
        free = f"{r['memory_free_gib']:.1f}" if r["memory_free_gib"] is not None else "-"
        lines.append(f"{r['rank']:>3}  {r['plan']:<{width}}  {r['step_time_s']:8.3f}  {rng:>13}  "
                     f"{r['tokens_per_s']:10,.0f}  {r['mfu']:6.1%}  {r['memory_peak_gib']:8.1f}  {free:>5}  {margin:>8}  "
                     + (f"{r['goodput_tokens_per_s']:10,.0f}" if r["goodput_tokens_per_s"] else f"{'-':>10}"))
    basis = outcome.ranked[0].range_basis if outcome.ranked else ""
    headroom = outcome.memory_headroom_gib
    lines.append(f"range: {basis}" if basis else "range: none recorded")
    if headroom is not None:
        lines.append(f"memory: every plan shown keeps at least {headroom:.1f} GiB free per GPU (--memory-headroom)")
    good = outcome.ranked[0].goodput if outcome.ranked else None
    if good:
        lines.append(f"goodput: tokens/s x effective training time ratio {good['effective_training_time_ratio']:.1%} "
                     "under interruptions (cost/goodput.py; the same for every plan of one cluster size)")
    stack = outcome.stack.get("name") if outcome.stack else None
    if stack:
        lines.append(f"software stack: {stack}")
    return lines


def ranked_csv(outcome: SearchOutcome, top: int | None = None) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RANK_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in ranked_rows(outcome.ranked, top):
        writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


COMPARE_COLUMNS = ["num_gpus", "plan", "step_time_s", "tokens_per_s", "mfu", "memory_peak_gib",
                   "scaling_efficiency", "train_days", "gpu_hours", "cost",
                   "train_days_low", "train_days_high", "cost_low", "cost_high",
                   "goodput_tokens_per_s", "ettr", "train_days_with_failures", "cost_with_failures"]


def compare_rows(c: CompareOutcome) -> list[dict[str, Any]]:
    rows = []
    for row in c.rows:
        b = row.outcome.best
        # the step-time range scales time and cost to train alike (cost/ranges.py)
        lo = hi = None
        if b is not None and b.step_time_range_s and row.train_time_s is not None and b.step_time_s > 0:
            lo, hi = (x / b.step_time_s for x in b.step_time_range_s)
        rows.append({
            "train_days_low": row.train_time_s * lo / 86400.0 if lo else None,
            "train_days_high": row.train_time_s * hi / 86400.0 if hi else None,
            "cost_low": row.cost * lo if lo and row.cost is not None else None,
            "cost_high": row.cost * hi if hi and row.cost is not None else None,
            "num_gpus": row.num_gpus, "plan": plan_label(b.plan) if b else None,
            "step_time_s": b.step_time_s if b else None, "tokens_per_s": b.tokens_per_s if b else None,
            "mfu": b.mfu if b else None, "memory_peak_gib": b.memory_peak_gib if b else None,
            "scaling_efficiency": row.scaling_efficiency,
            "train_days": row.train_time_s / 86400.0 if row.train_time_s is not None else None,
            "gpu_hours": row.gpu_hours, "cost": row.cost,
            "goodput_tokens_per_s": row.goodput_tokens_per_s, "ettr": row.ettr,
            "train_days_with_failures": row.train_time_failures_s / 86400.0 if row.train_time_failures_s else None,
            "cost_with_failures": (row.train_time_failures_s / 3600.0 * row.num_gpus * c.price_per_gpu_hour
                                   if row.train_time_failures_s and c.price_per_gpu_hour is not None else None),
        })
    return rows


def format_compare(c: CompareOutcome) -> list[str]:
    rows = compare_rows(c)
    width = max([len(r["plan"] or "no plan fits") for r in rows] + [4])

    f = cell
    head = (f"{'GPUs':>5}  {'best plan':<{width}}  {'step s':>8}  {'tokens/s':>10}  {'MFU':>6}  {'scaling':>7}  "
            f"{'days (80% range)':>20}  {'GPU-hours':>10}  {'goodput':>10}  {'ETTR':>6}  {'days w/ fail':>12}"
            + ("  cost (80% range)  cost w/ fail" if c.price_per_gpu_hour is not None else ""))
    lines = [head, "-" * len(head)]
    for r in rows:
        days = f(r["train_days"], ".1f")
        if r["train_days_low"] is not None:
            days += f" ({r['train_days_low']:.1f}-{r['train_days_high']:.1f})"
        line = (f"{r['num_gpus']:>5}  {r['plan'] or 'no plan fits':<{width}}  {f(r['step_time_s'], '8.3f')}  "
                f"{f(r['tokens_per_s'], '10,.0f')}  {f(r['mfu'], '6.1%')}  {f(r['scaling_efficiency'], '7.1%')}  "
                f"{days:>20}  {f(r['gpu_hours'], '10,.0f')}  {f(r['goodput_tokens_per_s'], '10,.0f')}  "
                f"{f(r['ettr'], '6.1%')}  {f(r['train_days_with_failures'], '12.1f')}")
        if c.price_per_gpu_hour is not None:
            line += f"  {f(r['cost'], ',.0f')}"
            if r["cost_low"] is not None:
                line += f" ({r['cost_low']:,.0f}-{r['cost_high']:,.0f})"
            line += f"  {f(r['cost_with_failures'], ',.0f')}"
        lines.append(line)
    bases = {row.outcome.best.range_basis for row in c.rows if row.outcome.best is not None and row.outcome.best.range_basis}
    for basis in sorted(bases):
        lines.append(f"range: {basis}")
    return lines
