"""The report's headline: the recommended plan in words and numbers, and why it wins."""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.replay.results import StepResult
from echo_plan.report.chart import BREAKDOWN_NAMES, fmt_count, fmt_seconds
from echo_plan.report.charts_search import capacity_gib, evaluated
from echo_plan.report.plans import knob_differences, plan_in_words, short_label
from echo_plan.search.results import CompareOutcome, CompareRow, SearchOutcome
from echo_plan.search.explain_cp import cp_choice


@dataclass(frozen=True, slots=True)
class Metric:
    label: str
    value: str
    note: str = ""


@dataclass(frozen=True, slots=True)
class Headline:
    title: str  # the plan's short label, or what went wrong
    sentence: str  # the plan in words
    metrics: tuple[Metric, ...]
    reasons: tuple[str, ...]  # why it wins
    notes: tuple[str, ...] = ()  # the simulator's notes on the plan
    reasons_title: str = "Why this one"


def plan_metrics(r: StepResult, tokens_budget: float | None, cap_gib: float | None) -> list[Metric]:
    peak = max(r.memory, key=lambda m: m.total_bytes) if r.memory else None
    mem_note = f"of {cap_gib:g} GiB" if cap_gib else "peak, worst stage"
    if peak is not None:
        mem_note += f"; {peak.free_bytes / 2**30:.1f} GiB free (at least {peak.headroom_bytes / 2**30:.1f} GiB kept)"
    rng, trng = r.step_time_range_s, r.tokens_per_s_range
    cov = f"{r.range_coverage:.0%}" if r.range_coverage else ""
    metrics = [
        Metric("step time", fmt_seconds(r.step_time_s),
               f"{cov} range {fmt_seconds(rng[0])} to {fmt_seconds(rng[1])}" if rng else ""),
        Metric("throughput", f"{fmt_count(r.tokens_per_s)} tokens/s",
               f"{fmt_count(r.tokens_per_s / r.num_gpus)} per GPU" +
               (f"; {fmt_count(trng[0])} to {fmt_count(trng[1])}" if trng else "")),
        Metric("MFU", f"{r.mfu:.1%}", f"{r.model_tflops_per_gpu:.0f} model TFLOP/s per GPU"),
        Metric("memory per GPU", f"{r.memory_peak_gib:.1f} GiB", mem_note),
    ]
    if tokens_budget and r.tokens_per_s > 0:
        seconds = tokens_budget / r.tokens_per_s
        note = f"{fmt_count(tokens_budget)} tokens, {fmt_count(seconds / 3600 * r.num_gpus)} GPU-hours"
        if trng:
            note += f"; {fmt_seconds(tokens_budget / trng[1])} to {fmt_seconds(tokens_budget / trng[0])}"
        metrics.append(Metric("time to train", fmt_seconds(seconds), note))
    return metrics


def _biggest_saving(best: StepResult, other: StepResult) -> str:
    a, b = best.breakdown.as_json(), other.breakdown.as_json()
    key = max(a, key=lambda k: b[k] - a[k])
    delta = b[key] - a[key]
    if delta <= 0:
        return ""
    return f"the biggest difference is {BREAKDOWN_NAMES[key]}: {fmt_seconds(delta)} less per step"


def _composition(r: StepResult) -> str:
    parts = r.breakdown.as_json()
    total = sum(parts.values()) or r.step_time_s
    if total <= 0:
        return ""
    compute = parts.pop("compute")
    key = max(parts, key=lambda k: parts[k])
    text = f"Its step is {compute / total:.0%} compute"
    if parts[key] > 0:
        text += f"; the largest overhead is {BREAKDOWN_NAMES[key]} ({parts[key] / total:.0%})"
    return text + "."


def search_headline(outcome: SearchOutcome) -> Headline:
    cap = capacity_gib(outcome)
    points = [r for _, r in evaluated(outcome)]
    fitting = [r for r in points if r.fits]
    best = outcome.best
    if best is None:
        reasons = [f"{len(points)} plans were simulated and {sum(outcome.pruned_counts.values())} pruned; "
                   "none fits in GPU memory."]
        if points:
            lean = min(points, key=lambda r: r.memory_peak_gib)
            over = lean.overflow
            reasons.append(f"The leanest simulated plan, {short_label(lean.plan)}, needs "
                           f"{lean.memory_peak_gib:.1f} GiB" + (f" ({over[1]:.1f} GiB too much on stage {over[0]})"
                                                                if over else "") + ".")
        reasons.append("Try more GPUs, recomputation, a distributed optimizer, or a smaller micro-batch.")
        return Headline("No plan fits", "No candidate plan fits in GPU memory.", (), tuple(reasons))
    reasons: list[str] = []
    n_fit = max(len(fitting), len(outcome.ranked))
    reasons.append(f"Fastest of {n_fit} fitting plans among {len(points)} simulated "
                   f"({sum(outcome.pruned_counts.values())} of {outcome.candidates_total} candidates pruned "
                   "before simulation).")
    if len(outcome.ranked) > 1:
        runner = outcome.ranked[1]
        gain = runner.step_time_s / best.step_time_s - 1 if best.step_time_s > 0 else 0.0
        diffs = ", ".join(f"{h} {b} instead of {a}" for h, a, b in knob_differences(best.plan, runner.plan))
        text = f"{gain:.1%} faster than the runner-up, {short_label(runner.plan)}"
        if diffs:
            text += f" ({diffs})"
        saving = _biggest_saving(best, runner)
        reasons.append(text + (f"; {saving}." if saving else "."))
    else:
        reasons.append("It is the only distinct plan that fits.")
    faster = sorted((r for r in points if not r.fits and r.step_time_s < best.step_time_s),
                    key=lambda r: r.step_time_s)
    if faster:
        f = faster[0]
        reasons.append(f"{len(faster)} simulated plan{'s' if len(faster) > 1 else ''} would be faster but "
                       f"{'do' if len(faster) > 1 else 'does'} not fit: the fastest, {short_label(f.plan)} "
                       f"({fmt_seconds(f.step_time_s)}), needs {f.memory_peak_gib:.1f} GiB.")
    comp = _composition(best)
    if comp:
        reasons.append(comp)
    experts = _expert_choice(best, [r for r in points if r.fits])
    if experts:
        reasons.append(experts)

    why_cp = cp_choice(best, [r for r in points if r.fits], int(outcome.model.get("seq_length") or 0),
                       int(outcome.cluster.get("nvlink_domain_gpus") or outcome.cluster.get("gpus_per_node") or 8),
                       outcome.pruned_counts)
    if why_cp:
        reasons.append(why_cp)
    if cap:
        room = best.memory[0].headroom_bytes / 2**30 if best.memory else 0.0
        reasons.append(f"Peak memory {best.memory_peak_gib:.1f} GiB leaves {cap - best.memory_peak_gib:.1f} GiB "
                       f"of the {cap:g} GiB free on its fullest GPU (every plan ranked keeps at least "
                       f"{room:.1f} GiB free: --memory-headroom).")
    if best.range_basis:
        reasons.append(f"How sure: {best.range_basis}.")
    return Headline(short_label(best.plan), plan_in_words(best.plan),
                    tuple(plan_metrics(best, outcome.tokens_budget, cap)), tuple(reasons), tuple(best.notes))


def _expert_choice(best: StepResult, fitting: list[StepResult]) -> str:
    """Why this expert-parallel degree: where its all-to-all runs, and the best fitting plan of each other ep."""
    a2a = next((n for n in best.notes if n.startswith("MoE all-to-all:")), None)
    if a2a is None:
        return ""
    ep = int(best.plan.get("ep", 1))
    text = f"Expert parallelism {ep}: {a2a.removeprefix('MoE all-to-all: ')}."
    others: dict[int, StepResult] = {}
    for r in fitting:
        other = int(r.plan.get("ep", 1))
        if other != ep and (other not in others or r.step_time_s < others[other].step_time_s):
            others[other] = r
    if others:
        text += " The fastest fitting plan with another ep: " + "; ".join(
            f"ep {e} ({short_label(r.plan)}) {r.step_time_s / best.step_time_s - 1:+.1%}"
            for e, r in sorted(others.items())) + "."
    return text


def _row_summary(row: CompareRow, best: StepResult) -> str:
    bits = [f"{row.num_gpus} GPUs ({short_label(best.plan)})", f"{fmt_count(best.tokens_per_s)} tokens/s"]
    if row.train_time_s is not None:
        bits.append(f"{fmt_seconds(row.train_time_s)} to train")
    if row.cost is not None:
        bits.append(f"cost {fmt_count(row.cost)}")
    elif row.gpu_hours is not None:
        bits.append(f"{fmt_count(row.gpu_hours)} GPU-hours")
    return ", ".join(bits)


def economical_row(rows: list[tuple[CompareRow, StepResult]]) -> tuple[CompareRow, StepResult]:
    """The size that trains for least money: cost, else GPU-hours, else throughput per GPU."""
    if all(r.cost is not None for r, _ in rows):
        return min(rows, key=lambda rb: (rb[0].cost, rb[0].num_gpus))
    if all(r.gpu_hours is not None for r, _ in rows):
        return min(rows, key=lambda rb: (rb[0].gpu_hours, rb[0].num_gpus))
    return max(rows, key=lambda rb: (rb[1].tokens_per_s / rb[0].num_gpus, -rb[0].num_gpus))


def compare_headline(outcome: CompareOutcome) -> Headline:
    rows = sorted(((r, r.outcome.best) for r in outcome.rows if r.outcome.best is not None),
                  key=lambda rb: rb[0].num_gpus)
    sizes = ", ".join(str(r.num_gpus) for r in sorted(outcome.rows, key=lambda r: r.num_gpus))
    if not rows:
        return Headline("No plan fits at any size", f"Compared {sizes} GPUs; no plan fits in GPU memory at any.",
                        (), ("Try larger sizes, recomputation or a distributed optimizer.",))
    fastest, fb = max(rows, key=lambda rb: (rb[1].tokens_per_s, -rb[0].num_gpus))
    cheap, cb = economical_row(rows)
    reasons = [f"Fastest: {_row_summary(fastest, fb)}."]
    if cheap is not fastest:
        reasons.append(f"Most economical: {_row_summary(cheap, cb)}.")
        speed = fb.tokens_per_s / cb.tokens_per_s - 1
        extra = fastest.num_gpus / cheap.num_gpus
        eff = (f" at {fastest.scaling_efficiency:.0%} scaling efficiency"
               if fastest.scaling_efficiency is not None else "")
        reasons.append(f"Going from {cheap.num_gpus} to {fastest.num_gpus} GPUs ({extra:.3g}x) buys "
                       f"{speed:.0%} more throughput{eff}.")
    else:
        reasons.append("It is also the most economical size compared.")
    no_fit = [r.num_gpus for r in outcome.rows if r.outcome.best is None]
    if no_fit:
        reasons.append(f"No plan fits on {', '.join(map(str, sorted(no_fit)))} GPUs.")
    cap = capacity_gib(fastest.outcome)
    return Headline(f"{fastest.num_gpus} GPUs: {short_label(fb.plan)}",
                    f"Compared {sizes} GPUs. At {fastest.num_gpus} GPUs the best plan is: " + plan_in_words(fb.plan),
                    tuple(plan_metrics(fb, outcome.tokens_budget, cap)), tuple(reasons), tuple(fb.notes))
