"""How sure a prediction is: a range from the validation residuals of its GPU generation and stack.

For each software stack a cluster preset keeps the residuals r = log(predicted / measured) of the
validation rows that match its GPU generation (``calibration.ranges``, written when the preset is
calibrated), dense and mixture-of-experts models apart. The shipped presets' residuals are
leave-one-suite-out (``calibrate/loso.py``): each suite's rows predicted by a calibration made
without that suite, the error a user meets on runs unlike the calibration; a team's own
``calibrate steps`` keeps the rows it held out of its fit. The table says which (``method``).
A new prediction's measured value is expected in

    predicted x exp(-(mean(r) +- t x sd(r) x sqrt(1 + 1/n)))

the Student-t prediction interval at the nominal coverage (80%): residuals are few (5-12 per
group), so a t quantile rather than a normal one, and the interval is centred where the held-out
rows say the truth lies, not on the point prediction. ``echo-plan validate`` reports the coverage
this rule reaches, each suite's rows against a range made from the other suites' rows.

When none of the table's dense rows ran on the cluster's GPU (``GPUSpec.compute_key``: another power limit,
memory or generation than the runs the calibration and its ranges came from, as a GPU of the user's own or
``h200`` with ``dgx-h100``'s calibration), a dense prediction takes the table's ``transfer`` group: the
leave-one-suite-out rows of the suites that were in that position themselves (``calibrate/loso.py``), the error of
a calibration carried to another GPU (JUDGEMENT: every stack's rows in one group, too few to split; the stack is
not what moved them). When the cluster has no residuals for the stack, the range falls back, and
says so: to another stack of the same GPU generation widened by ``OTHER_STACK_WIDENING`` (the largest group of a stack
whose kernels are the stack's family, ``SoftwareSpec.kernels``, where there is one: their errors are the nearer
kind), else to ``JUDGEMENT_SD``.
Both are judgements (stated where they are defined, here and in specs/calibration.py, and in the
result's ``range_basis``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from echo_plan.errors import EchoPlanError
from echo_plan.specs.calibration_ranges import (JUDGEMENT_SD, NOMINAL_COVERAGE, T90, Z90, RangeMethod, RangeTable,
                                                ResidualGroup, t90)

__all__ = ["NOMINAL_COVERAGE", "T90", "Z90", "JUDGEMENT_SD", "OTHER_STACK_WIDENING", "RangeMethod", "RangeTable",
           "ResidualGroup", "PredictionRange", "t90", "moe_residuals", "prediction_range", "loo_coverage"]

# JUDGEMENT: a stack without rows of its own borrows another stack's residuals, 1.5x as wide.
OTHER_STACK_WIDENING = 1.5


@dataclass(frozen=True)
class PredictionRange:
    low_factor: float  # measured / predicted at the low end
    high_factor: float
    coverage: float
    basis: str

    def apply(self, predicted: float) -> tuple[float, float]:
        return predicted * self.low_factor, predicted * self.high_factor


def moe_residuals(calibration: Any) -> dict[str, ResidualGroup]:
    """The cluster's mixture-of-experts residual groups by stack (``calibration.ranges.moe_by_stack``)."""
    cal = calibration or {}
    if "ranges" not in cal:
        return {}
    return dict(RangeTable.from_mapping(cal["ranges"]).moe_groups)


def prediction_range(cluster: Any, stack: Any, moe: bool = False) -> PredictionRange:
    """The range of a step-time prediction on ``cluster`` with ``stack`` (see the module docstring); for a
    mixture-of-experts model, from the MoE rows of that stack on this GPU where the cluster has them, else
    from the dense rows, and the basis says so."""
    cal = getattr(cluster, "calibration", None) or {}
    table = RangeTable.from_mapping(cal["ranges"], cluster.name) if "ranges" in cal else None
    names = [stack.name] + ([stack.base] if getattr(stack, "base", "") and stack.base != stack.name else [])
    own = _own_stack_range(table, table.moe_groups, names, "mixture-of-experts validation rows", cluster.name) \
        if moe and table is not None else None
    if own is not None:
        return own
    dense = _dense_range(cluster, table, stack, names)
    if moe:
        return PredictionRange(dense.low_factor, dense.high_factor, dense.coverage, dense.basis
                               + "; no mixture-of-experts validation rows for this stack on this GPU, so the dense "
                               "rows' range, narrower than MoE runs warrant (docs/validation.md, moe_h100)")
    return dense


def _own_stack_range(table: RangeTable, groups: Any, names: list[str], rows: str,
                     where: str) -> PredictionRange | None:
    """The range from the first of ``names`` (the stack, then its base) that ``groups`` holds."""
    for name in names:
        g = groups.get(name)
        if g is not None:
            lo, hi = table.log_interval(g)
            return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                                   f"{NOMINAL_COVERAGE:.0%} range from {g.n} {rows} of stack {g.stack} on this GPU, "
                                   f"{table.method.words} ({g.source or where})")
    return None


def _transfer_range(cluster: Any, table: RangeTable | None) -> PredictionRange | None:
    """The range of a GPU none of the table's dense rows ran on (``table.gpus``), where the table has the errors of
    calibrations carried to another GPU (``table.transfer``); None otherwise."""
    if table is None or table.transfer is None or cluster.gpu.compute_key in table.gpus:
        return None
    g = table.transfer
    lo, hi = table.log_interval(g)
    return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                           f"no validation run on this GPU ({cluster.gpu.name}) among the rows of its calibration: "
                           f"{NOMINAL_COVERAGE:.0%} range from {g.n} rows of suites whose GPU had none either, each "
                           f"predicted by a calibration carried from another GPU, {table.method.words} ({g.source})")


def _dense_range(cluster: Any, table: RangeTable | None, stack: Any, names: list[str]) -> PredictionRange:
    carried = _transfer_range(cluster, table)
    if carried is not None:
        return carried
    if table is not None:
        own = _own_stack_range(table, table.groups, names, "validation rows", cluster.name)
        if own is not None:
            return own
        if table.groups:
            family = stack.kernels.value
            kin = [g for g in table.groups.values() if _kernels_of(g.stack) == family]
            g = max(kin or table.groups.values(), key=lambda g: (g.n, g.stack))
            lo, hi = table.log_interval(g, OTHER_STACK_WIDENING)
            kind = f", whose kernels are the same family ({family})" if kin else ""
            return PredictionRange(math.exp(lo), math.exp(hi), NOMINAL_COVERAGE,
                                   f"no validation rows for stack {stack.name} on this GPU: {g.n} rows of stack "
                                   f"{g.stack}{kind} ({table.method.value}), widened {OTHER_STACK_WIDENING:g}x "
                                   f"because they are another stack's (judgement)")
    hw = JUDGEMENT_SD * Z90
    return PredictionRange(math.exp(-hw), math.exp(hw), NOMINAL_COVERAGE,
                           f"no validation rows for this GPU ({cluster.gpu.name}): a judgement range of "
                           f"+-{math.exp(hw) - 1:.0%}")


@lru_cache(maxsize=64)  # the stack presets are package files: read once per name, not once per range
def _kernels_of(stack_name: str) -> str | None:
    """The kernel family of the stack preset ``stack_name`` (a residual group's stack), or None when it is not one
    (a team's own stack file, named in its own calibration)."""
    from echo_plan.specs.presets import load_stack, stack_names  # deferred: reads the stack presets' files

    if stack_name not in stack_names():
        return None
    try:
        return load_stack(stack_name).kernels.value
    except EchoPlanError:
        return None


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
