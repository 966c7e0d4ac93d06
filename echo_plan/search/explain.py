"""Explaining a search: why each knob value was (never) tried, what dominates the best plan's step,
and what the runner-up trades against it."""

from __future__ import annotations

from typing import Any, Iterable

from echo_plan.replay.results import Breakdown, StepResult
from echo_plan.search.prune import PrunedSpace, PruneReason, plan_key
from echo_plan.search.results import TrialRecord, TrialState
from echo_plan.search.space import Knob
from echo_plan.specs.software_kinds import OptimizerOffload

# Breakdown fields in words, for sentences.
_PART_NAMES = {
    "compute": "compute", "tp_comm_exposed": "exposed tensor-parallel communication",
    "ep_comm_exposed": "exposed expert exchange (MoE dispatch and combine)",
    "host_exposed": "GPU waiting for the host to issue kernels after the MoE dispatcher's synchronisation",
    "pp_comm_exposed": "exposed pipeline point-to-point communication",
    "dp_comm_exposed": "exposed data-parallel gradient/parameter communication",
    "bubble": "pipeline bubble", "interference": "slow-down from compute/communication interference",
    "optimizer": "optimizer step",
}


def _plan_key_of(plan: dict[str, Any]) -> tuple | None:
    try:
        return plan_key(plan)
    except KeyError:  # a plan stored without some knob (an older study)
        return None


def _value_label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def knob_stats(pruned: PrunedSpace, trials: Iterable[TrialRecord]) -> dict[str, dict[str, dict[str, int]]]:
    """knob -> value -> counts: candidates with that value, how many passed the checks, how many the
    search simulated, and how many were pruned per reason. Answers "why was tp 4 never tried"."""
    from collections import Counter

    by_reason: dict[Any, list[dict[str, Any]]] = {}
    names: dict[str, None] = {}
    for v in pruned.verdicts:  # grouped by reason, then counted per knob (a search has ~40k candidates)
        by_reason.setdefault(v.reason, []).append(v.combo)
        if len(names) < len(v.combo):
            names.update(dict.fromkeys(v.combo))
    missing = object()
    combos = [v.combo for v in pruned.verdicts]
    stats: dict[str, dict[str, dict[str, int]]] = {}
    for name in names:  # values in order of first appearance, as the candidates list them
        stats[name] = {_value_label(value): {"candidates": 0, "valid": 0, "evaluated": 0}
                       for value in dict.fromkeys(c.get(name, missing) for c in combos) if value is not missing}
    for reason, group in by_reason.items():
        for name in names:
            for value, n in Counter(c.get(name, missing) for c in group).items():
                if value is missing:
                    continue
                row = stats[name][_value_label(value)]
                row["candidates"] += n
                if reason is None:
                    row["valid"] += n
                else:
                    row[reason.value] = row.get(reason.value, 0) + n
    # a simulated plan counts under the values its candidate had in the space ("1/4" of the layers, not the 8 it
    # made); a plan no candidate made (a trial of another space) under its own values
    made = {plan_key(v.plan.model_dump(mode="json")): v.combo for v in pruned.verdicts
            if v.reason is None and v.plan is not None}
    seen: set[tuple] = set()
    for t in trials:
        if t.state is not TrialState.COMPLETE:
            continue
        key = tuple(sorted((k, str(v)) for k, v in t.plan.items()))
        if key in seen:
            continue
        seen.add(key)
        combo = made.get(_plan_key_of(t.plan), t.plan)
        for name in stats:
            value = combo.get(name, t.plan.get(name))
            row = stats[name].get(_value_label(value))
            if row is not None:
                row["evaluated"] += 1
    return stats


def format_knob_stats(stats: dict[str, dict[str, dict[str, int]]], only_varying: bool = True) -> list[str]:
    """Lines of text: one per knob value, with its counts and the reasons it was pruned."""
    lines = []
    for knob in Knob:
        values = stats.get(knob.value, {})
        if only_varying and len(values) < 2:
            continue
        lines.append(f"{knob.value}:")
        for value, row in values.items():
            reasons = {k: n for k, n in row.items() if k not in ("candidates", "valid", "evaluated")}
            why = "; ".join(f"{n} {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
            lines.append(f"  {value:>10}: {row['candidates']:6d} candidates, {row['valid']:5d} valid, "
                         f"{row['evaluated']:4d} simulated" + (f"; pruned: {why}" if why else ""))
    return lines


def dominant_part(b: Breakdown) -> tuple[str, float]:
    """(part name, share of the step) of the largest breakdown part."""
    parts = b.as_json()
    total = b.total_s or 1.0
    name = max(parts, key=lambda k: parts[k])
    return name, parts[name] / total


def explain_top(ranked: tuple[StepResult, ...]) -> list[str]:
    """What dominates the best plan's step, and what the runner-up trades (knobs and breakdown)."""
    if not ranked:
        return []
    best = ranked[0]
    name, share = dominant_part(best.breakdown)
    parts = best.breakdown.as_json()
    second = sorted(parts, key=lambda k: -parts[k])[1]
    lines = [f"The best plan's step ({best.step_time_s:.3f} s) is dominated by {_PART_NAMES[name]} "
             f"({share:.0%}); next is {_PART_NAMES[second]} ({parts[second] / (best.breakdown.total_s or 1):.0%})."]
    if len(ranked) < 2:
        return lines
    runner = ranked[1]
    def implied(plan: dict, k: str) -> bool:  # expert TP that only follows tp (its default; a dense model's)
        return k == "etp" and plan.get("etp") in (None, plan.get("tp"))

    diffs = [f"{k} {_value_label(best.plan.get(k))} -> {_value_label(runner.plan.get(k))}"
             for k in tuple(kn.value for kn in Knob) + ("dp",) if best.plan.get(k) != runner.plan.get(k)
             and not (implied(best.plan, k) and implied(runner.plan, k))]
    rparts = runner.breakdown.as_json()
    moves = sorted(((k, rparts[k] - parts[k]) for k in parts), key=lambda kv: -abs(kv[1]))
    moved = [f"{_PART_NAMES[k]} {d * 1000:+.1f} ms" for k, d in moves[:3] if abs(d) > 1e-6]
    slower = runner.step_time_s / best.step_time_s - 1 if best.step_time_s else 0.0
    mem = runner.memory_peak_gib - best.memory_peak_gib
    lines.append(f"The runner-up ({runner.step_time_s:.3f} s, {slower:+.1%}) changes "
                 f"{', '.join(diffs) or 'nothing in the plan'}: " + (", ".join(moved) or "same breakdown")
                 + f"; peak memory {mem:+.1f} GiB.")
    return lines


def offload_hint(stack: Any, cluster: Any, space: Any, pruned: PrunedSpace) -> str:
    """When plans were too big and the space kept the optimizer on the GPUs though the stack and the cluster could
    move it: say that --offload-optimizer might make one fit."""
    too_big = any(v.reason is PruneReason.OOM_ESTIMATE for v in pruned.verdicts)
    can = (getattr(stack, "optimizer_offload", None) not in (None, OptimizerOffload.NONE)
           and cluster.host is not None)
    if too_big and can and True not in space.values(Knob.OFFLOAD_OPTIMIZER):
        return "; --offload-optimizer (the optimizer in CPU memory) may make one fit (docs/fsdp.md)"
    return ""
