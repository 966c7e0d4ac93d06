"""``compare --dtype bf16,fp8``: the same cluster sizes searched once per training precision.

Each precision is a full ``compare`` (the space's ``dtype`` knob fixed to it), so each gets its own
best plan: FP8 frees memory for activations in one place and adds weight copies in another, and the
plan that is best in bf16 need not be best in fp8. The comparison then puts, for every size, the best
plans side by side: tokens/s, the speed-up over the first precision listed, peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from echo_plan.errors import SpecError
from echo_plan.search.results import CompareOutcome
from echo_plan.search.study import SearchConfig
from echo_plan.search.space import TRAINING_DTYPES
from echo_plan.search.table import cell, plan_label
from echo_plan.search.serialize import compare_to_json

DTYPE_COMPARE_FORMAT = "echo-plan-compare-dtype/1"


def parse_dtypes(text: str) -> list[str]:
    """``bf16,fp8`` -> ['bf16', 'fp8'] (order kept, distinct)."""
    out = list(dict.fromkeys(p.strip().lower() for p in str(text).split(",") if p.strip()))
    bad = [p for p in out if p not in TRAINING_DTYPES]
    if not out or bad:
        raise SpecError("--dtype", text, f"one or more of {', '.join(TRAINING_DTYPES)}, comma-separated (bf16,fp8)")
    return out


@dataclass(frozen=True, slots=True)
class DtypeComparison:
    """One ``compare`` outcome per precision, in the order the user listed them."""

    outcomes: tuple[tuple[str, CompareOutcome], ...]

    def rows(self) -> list[dict[str, Any]]:
        """Per cluster size and precision: the best plan, tokens/s, speed-up over the first precision."""
        out = []
        first = self.outcomes[0][1]
        for i, row in enumerate(first.rows):
            ref = row.outcome.best
            for dtype, outcome in self.outcomes:
                best = outcome.rows[i].outcome.best
                speedup = (best.tokens_per_s / ref.tokens_per_s) if best is not None and ref is not None else None
                out.append({"num_gpus": row.num_gpus, "dtype": dtype,
                            "plan": _label(best.plan) if best is not None else None,
                            "step_time_s": best.step_time_s if best else None,
                            "tokens_per_s": best.tokens_per_s if best else None,
                            "speedup": speedup, "memory_peak_gib": best.memory_peak_gib if best else None,
                            "mfu": best.mfu if best else None})
        return out

    def as_json(self) -> dict[str, Any]:
        return {"format": DTYPE_COMPARE_FORMAT, "dtypes": [d for d, _ in self.outcomes], "rows": self.rows(),
                "by_dtype": {d: compare_to_json(o) for d, o in self.outcomes}}


def _label(plan: dict[str, Any]) -> str:
    return plan_label(plan)


def run_dtype_compare(base: SearchConfig, sizes: list[int], dtypes: list[str], run: Callable[[SearchConfig], CompareOutcome]
                      ) -> DtypeComparison:
    """``run`` (a ``run_compare`` with everything but the config bound) once per precision."""
    return DtypeComparison(tuple((d, run(replace(base, space=base.space.with_values({"dtype": (d,)}))))
                                 for d in dtypes))


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def format_dtype_compare(c: DtypeComparison) -> list[str]:
    rows = c.rows()
    width = max([len(r["plan"] or "no plan fits") for r in rows] + [9])
    ref = c.outcomes[0][0]

    f = cell
    head = (f"{'GPUs':>5}  {'dtype':<5}  {'best plan':<{width}}  {'step s':>8}  {'tokens/s':>10}  "
            f"{'vs ' + ref:>8}  {'MFU':>6}  {'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['num_gpus']:>5}  {r['dtype']:<5}  {r['plan'] or 'no plan fits':<{width}}  "
                     f"{f(r['step_time_s'], '8.3f')}  {f(r['tokens_per_s'], '10,.0f')}  {_x(r['speedup']):>8}  "
                     f"{f(r['mfu'], '6.1%')}  {f(r['memory_peak_gib'], '8.1f')}")
    lines.append("MFU is against the peak of each precision's GEMMs (FP8: twice bf16's on Hopper)")
    return lines
