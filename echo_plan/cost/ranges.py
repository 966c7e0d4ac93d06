"""How sure a prediction is: a range from the validation residuals of its GPU generation and stack.

For each software stack a cluster preset keeps the held-out residuals r = log(predicted /
measured) of the validation rows that match its GPU generation (``calibration.ranges``, written
when the preset is calibrated). A new prediction's measured value is expected in

    predicted x exp(-(mean(r) +- t x sd(r) x sqrt(1 + 1/n)))

the Student-t prediction interval at the nominal coverage (80%): residuals are few (5-12 per
group), so a t quantile rather than a normal one, and the interval is centred where the held-out
rows say the truth lies, not on the point prediction. ``echo-plan validate`` reports the coverage
this rule actually reached, leave-one-out, on the held-out rows.

When the cluster has no residuals for the stack, the range falls back, and says so: to another
stack of the same GPU generation widened by ``OTHER_STACK_WIDENING``, else to ``JUDGEMENT_SD``.
Both are judgements (stated where they are defined here and in the result's ``range_basis``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from echo_plan.errors import SpecError

NOMINAL_COVERAGE = 0.80
# Student-t 0.90 quantiles (two-sided 80%) by degrees of freedom; standard tables (e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.2). Between entries the next smaller df is used.
T90 = ((1, 3.078), (2, 1.886), (3, 1.638), (4, 1.533), (5, 1.476), (6, 1.440), (7, 1.415), (8, 1.397),
       (9, 1.383), (10, 1.372), (12, 1.356), (15, 1.341), (20, 1.325), (25, 1.316), (30, 1.310), (40, 1.303),
       (60, 1.296), (120, 1.289))
Z90 = 1.2816
# JUDGEMENT: with no validation rows for the GPU generation, a log-error spread of 0.15 (about
# +-19% at 80%): the size of the errors this project saw against unseen published runs before it
# was calibrated (10-30% optimistic, issue 11), centred on the prediction.
JUDGEMENT_SD = 0.15
# JUDGEMENT: a stack without rows of its own borrows another stack's residuals, 1.5x as wide.
OTHER_STACK_WIDENING = 1.5


def t90(df: int) -> float:
    """The 0.90 quantile of Student's t with ``df`` degrees of freedom (the table's next smaller df:
    slightly wide, never narrow)."""
    if df < 1:
        raise ValueError("a t quantile needs at least one degree of freedom")
    return next(q for d, q in reversed(T90) if df >= d)


@dataclass(frozen=True)
class ResidualGroup:
    """Held-out residuals log(predicted / measured) of one stack on one GPU generation."""

    stack: str
    residuals: tuple[float, ...]
    rows: tuple[str, ...] = ()
    source: str = ""

    @property
    def n(self) -> int:
        return len(self.residuals)

    @property
    def mean(self) -> float:
        return sum(self.residuals) / self.n

    @property
    def sd(self) -> float:
        if self.n < 2:
            return JUDGEMENT_SD
        m = self.mean
        return math.sqrt(sum((r - m) ** 2 for r in self.residuals) / (self.n - 1))

    def log_interval(self, widen: float = 1.0) -> tuple[float, float]:
        """(low, high) of log(measured / predicted) at the nominal coverage."""
        if self.n < 2:
            return -JUDGEMENT_SD * Z90 * widen, JUDGEMENT_SD * Z90 * widen
        hw = t90(self.n - 1) * self.sd * math.sqrt(1.0 + 1.0 / self.n) * widen
        return -self.mean - hw, -self.mean + hw

    def as_json(self) -> dict[str, Any]:
        return {"residuals": [round(r, 6) for r in self.residuals], "rows": list(self.rows), "source": self.source}


@dataclass(frozen=True)
class RangeTable:
    nominal_coverage: float
    groups: Mapping[str, ResidualGroup]

    @classmethod
    def from_mapping(cls, data: Any, context: str = "calibration") -> "RangeTable":
        where = "calibration.ranges"
        if not isinstance(data, Mapping):
            raise SpecError(where, data, "a mapping with nominal_coverage and by_stack", context)
        unknown = set(data) - {"nominal_coverage", "by_stack", "source"}
        if unknown:
            key = sorted(unknown)[0]
            raise SpecError(f"{where}.{key}", data[key], "unknown key; valid: nominal_coverage, by_stack, source", context)
        cov = data.get("nominal_coverage", NOMINAL_COVERAGE)
        if cov != NOMINAL_COVERAGE:
            raise SpecError(f"{where}.nominal_coverage", cov, f"{NOMINAL_COVERAGE} (the coverage the t table is for)",
                            context)
        groups = {}
        by_stack = data.get("by_stack") or {}
        if not isinstance(by_stack, Mapping):
            raise SpecError(f"{where}.by_stack", by_stack, "a mapping of stack name to residuals", context)
        for name, g in by_stack.items():
            field = f"{where}.by_stack.{name}"
            if not isinstance(g, Mapping) or not isinstance(g.get("residuals"), Sequence) or not g["residuals"]:
                raise SpecError(field, g, "a mapping with a non-empty list of residuals", context)
            try:
                res = tuple(float(r) for r in g["residuals"])
            except (TypeError, ValueError):
                raise SpecError(f"{field}.residuals", g["residuals"], "numbers (log predicted / measured)", context) from None
            if not all(math.isfinite(r) and abs(r) < 3 for r in res):
                raise SpecError(f"{field}.residuals", g["residuals"], "finite log-ratios between -3 and 3", context)
            groups[str(name)] = ResidualGroup(str(name), res, tuple(str(r) for r in g.get("rows") or ()),
                                              str(g.get("source") or ""))
        return cls(float(cov), MappingProxyType(groups))

    def as_json(self) -> dict[str, Any]:
        return {"nominal_coverage": self.nominal_coverage,
                "by_stack": {k: g.as_json() for k, g in sorted(self.groups.items())}}


@dataclass(frozen=True)
class PredictionRange:
    low_factor: float  # measured / predicted at the low end
    high_factor: float
    coverage: float
    basis: str

    def apply(self, predicted: float) -> tuple[float, float]:
        return predicted * self.low_factor, predicted * self.high_factor


def moe_residuals(calibration: Any) -> ResidualGroup | None:
    """The held-out residuals of the mixture-of-experts suite that fitted the cluster's all-to-all share
    (``calibrate/a2a_fit.py`` records each row's error and which held-out rows the ranges may use), as
    log(predicted / measured); None when the cluster carries no such fit."""
    fit = ((((calibration or {}).get("nccl") or {}).get("provenance") or {}).get("all_to_all_fit") or {})
    errors, rows = fit.get("residuals") or {}, [str(r) for r in fit.get("range_rows") or ()]
    res = tuple(math.log1p(float(errors[r])) for r in rows if r in errors)
    if len(res) < 2 or not fit.get("stack"):
        return None
    suite = ", ".join(fit.get("fitted_on") or {}) or "the MoE suite"
    return ResidualGroup(str(fit["stack"]), res, tuple(rows), f"{suite}: held-out bf16 MoE runs")


def prediction_range(cluster: Any, stack: Any, moe: bool = False) -> PredictionRange:
    """The range of a step-time prediction on ``cluster`` with ``stack`` (see the module docstring); for a
    mixture-of-experts model, from the held-out MoE runs of that stack on this GPU where the cluster has them
    (``moe_residuals``), else from the dense rows, and the basis says so."""
    cal = getattr(cluster, "calibration", None) or {}
    names = [stack.name] + ([stack.base] if getattr(stack, "base", "") and stack.base != stack.name else [])
    if moe:
        g = moe_residuals(cal)
        if g is not None and g.stack in names:
            lo, hi = g.log_interval()
            return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                                   f"{NOMINAL_COVERAGE:.0%} range from {g.n} held-out mixture-of-experts validation "
                                   f"rows of stack {g.stack} on this GPU ({g.source})")
    dense = _dense_range(cluster, cal, stack, names)
    if moe:
        return PredictionRange(dense.low_factor, dense.high_factor, dense.coverage, dense.basis
                               + "; no mixture-of-experts validation rows for this stack on this GPU, so the dense "
                               "rows' range, narrower than MoE runs warrant (docs/validation.md, moe_h100)")
    return dense


def _dense_range(cluster: Any, cal: Any, stack: Any, names: list[str]) -> PredictionRange:
    table = RangeTable.from_mapping(cal["ranges"], cluster.name) if "ranges" in cal else None
    if table is not None:
        for name in names:
            g = table.groups.get(name)
            if g is not None:
                lo, hi = g.log_interval()
                return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                                       f"{NOMINAL_COVERAGE:.0%} range from {g.n} held-out validation rows of stack "
                                       f"{g.stack} on this GPU ({g.source or cluster.name})")
        if table.groups:
            g = max(table.groups.values(), key=lambda g: g.n)
            lo, hi = g.log_interval(OTHER_STACK_WIDENING)
            return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                                   f"no validation rows for stack {stack.name} on this GPU: {g.n} rows of stack "
                                   f"{g.stack}, widened {OTHER_STACK_WIDENING:g}x (judgement)")
    hw = JUDGEMENT_SD * Z90
    return PredictionRange(math.exp(-hw), math.exp(hw), NOMINAL_COVERAGE,
                           f"no validation rows for this GPU ({cluster.gpu.name}): a judgement range of "
                           f"+-{math.exp(hw) - 1:.0%}")


def loo_coverage(residuals: Sequence[float]) -> float | None:
    """Share of residuals inside the interval built from all the others (leave-one-out)."""
    if len(residuals) < 3:
        return None
    inside = 0
    for i, r in enumerate(residuals):
        rest = ResidualGroup("", tuple(x for j, x in enumerate(residuals) if j != i))
        lo, hi = rest.log_interval()
        inside += lo <= -r <= hi
    return inside / len(residuals)
