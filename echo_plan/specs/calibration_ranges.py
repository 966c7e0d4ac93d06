"""The ``ranges`` section of a cluster's calibration: held-out prediction errors per software stack, from which every
prediction's 80% range comes (``cost/ranges.py``), and the statistics of such a group of residuals.

Split from ``specs/calibration.py``, which checks every section of a calibration and calls ``RangeTable.from_mapping``
for this one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from echo_plan.errors import SpecError

NOMINAL_COVERAGE = 0.80
# JUDGEMENT: with no validation rows for the GPU generation, a log-error spread of 0.15 (about
# +-19% at 80%): the size of the errors this project saw against unseen published runs before it
# was calibrated (10-30% optimistic, issue 11), centred on the prediction.
JUDGEMENT_SD = 0.15
# Student-t 0.90 quantiles (two-sided 80%) by degrees of freedom; standard tables (e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.2). Between entries the next smaller df is used.
T90 = ((1, 3.078), (2, 1.886), (3, 1.638), (4, 1.533), (5, 1.476), (6, 1.440), (7, 1.415), (8, 1.397),
       (9, 1.383), (10, 1.372), (12, 1.356), (15, 1.341), (20, 1.325), (25, 1.316), (30, 1.310), (40, 1.303),
       (60, 1.296), (120, 1.289))
Z90 = 1.2816
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

    @property
    def rms(self) -> float:
        """Root mean square about zero: the spread of the errors, their common bias included."""
        return math.sqrt(sum(r * r for r in self.residuals) / self.n) if self.n else JUDGEMENT_SD

    def log_interval(self, widen: float = 1.0, centred: bool = True) -> tuple[float, float]:
        """(low, high) of log(measured / predicted) at the nominal coverage.

        ``centred``: where the residuals say the truth lies (their mean) +- t x sd, for rows like these.
        Not centred: on the prediction, +- t x rms with n degrees of freedom (no mean is estimated), for
        rows of another suite: a suite's bias does not carry to the next one (leave-one-suite-out,
        ``RangeMethod``), so it counts as spread, not as a shift."""
        if self.n < 2:
            return -JUDGEMENT_SD * Z90 * widen, JUDGEMENT_SD * Z90 * widen
        if not centred:
            hw = t90(self.n) * self.rms * math.sqrt(1.0 + 1.0 / self.n) * widen
            return -hw, hw
        hw = t90(self.n - 1) * self.sd * math.sqrt(1.0 + 1.0 / self.n) * widen
        return -self.mean - hw, -self.mean + hw

    def as_json(self) -> dict[str, Any]:
        return {"residuals": [round(r, 6) for r in self.residuals], "rows": list(self.rows), "source": self.source}


class RangeMethod(str, Enum):
    """Which rows a range's residuals are errors of, and so which kind of error it describes."""

    # every row of a suite predicted with a calibration made without that suite: the error a user meets
    # on runs unlike the calibration (the shipped presets' ranges, ``calibrate/loso.py``)
    LEAVE_ONE_SUITE_OUT = "leave-one-suite-out"
    # rows of the calibration's own suite that were held out of its fit: smaller, siblings shaped the fit
    # (``calibrate steps`` on a team's own runs)
    HELD_OUT_ROWS = "held-out rows"

    @property
    def words(self) -> str:
        return ("leave-one-suite-out: each suite predicted by a calibration made without it"
                if self is RangeMethod.LEAVE_ONE_SUITE_OUT else "rows held out of the calibration's own fit")

    # The interval of a leave-one-suite-out table is centred on the prediction (ResidualGroup.log_interval).


RANGE_KEYS = ("nominal_coverage", "method", "by_stack", "moe_by_stack", "source", "gpus", "transfer")


@dataclass(frozen=True)
class RangeTable:
    nominal_coverage: float
    groups: Mapping[str, ResidualGroup]  # dense models, by stack
    method: RangeMethod = RangeMethod.HELD_OUT_ROWS
    moe_groups: Mapping[str, ResidualGroup] = field(default_factory=lambda: MappingProxyType({}))  # MoE, by stack
    # the GPUs (``GPUSpec.compute_key``) whose runs the dense groups hold; a GPU not among them gets ``transfer``
    gpus: tuple[str, ...] = ()
    # dense rows of suites whose GPU had no run in their calibration's ranges: the error of a calibration carried to
    # another GPU (calibrate/loso.py transfer_group); None: no such group (the range falls back as before)
    transfer: ResidualGroup | None = None

    @classmethod
    def from_mapping(cls, data: Any, context: str = "calibration") -> "RangeTable":
        where = "calibration.ranges"
        if not isinstance(data, Mapping):
            raise SpecError(where, data, "a mapping with nominal_coverage and by_stack", context)
        unknown = set(data) - set(RANGE_KEYS)
        if unknown:
            key = sorted(unknown)[0]
            raise SpecError(f"{where}.{key}", data[key], "unknown key; valid: " + ", ".join(RANGE_KEYS), context)
        cov = data.get("nominal_coverage", NOMINAL_COVERAGE)
        if cov != NOMINAL_COVERAGE:
            raise SpecError(f"{where}.nominal_coverage", cov, f"{NOMINAL_COVERAGE} (the coverage the t table is for)",
                            context)
        method = data.get("method", RangeMethod.HELD_OUT_ROWS.value)
        if method not in {m.value for m in RangeMethod}:
            raise SpecError(f"{where}.method", method, "one of " + ", ".join(m.value for m in RangeMethod), context)
        gpus = data.get("gpus") or ()
        if isinstance(gpus, (str, bytes)) or not isinstance(gpus, Sequence):
            raise SpecError(f"{where}.gpus", gpus, "a list of GPU compute keys", context)
        transfer = _group("transfer", data["transfer"], f"{where}.transfer", context) \
            if data.get("transfer") is not None else None
        return cls(float(cov), _groups(data, "by_stack", context), RangeMethod(method),
                   _groups(data, "moe_by_stack", context), tuple(str(g) for g in gpus), transfer)

    def log_interval(self, group: ResidualGroup, widen: float = 1.0) -> tuple[float, float]:
        """The interval of one of this table's groups, by the table's method."""
        return group.log_interval(widen, centred=self.method is not RangeMethod.LEAVE_ONE_SUITE_OUT)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nominal_coverage": self.nominal_coverage, "method": self.method.value,
                               "by_stack": {k: g.as_json() for k, g in sorted(self.groups.items())}}
        if self.moe_groups:
            out["moe_by_stack"] = {k: g.as_json() for k, g in sorted(self.moe_groups.items())}
        if self.gpus:
            out["gpus"] = list(self.gpus)
        if self.transfer is not None:
            out["transfer"] = self.transfer.as_json()
        return out


def _groups(data: Mapping[str, Any], key: str, context: str) -> Mapping[str, ResidualGroup]:
    where = f"calibration.ranges.{key}"
    by_stack = data.get(key) or {}
    if not isinstance(by_stack, Mapping):
        raise SpecError(where, by_stack, "a mapping of stack name to residuals", context)
    return MappingProxyType({str(name): _group(str(name), g, f"{where}.{name}", context)
                             for name, g in by_stack.items()})


def _group(name: str, g: Any, field_: str, context: str) -> ResidualGroup:
    if not isinstance(g, Mapping) or not isinstance(g.get("residuals"), Sequence) or not g["residuals"]:
        raise SpecError(field_, g, "a mapping with a non-empty list of residuals", context)
    try:
        res = tuple(float(r) for r in g["residuals"])
    except (TypeError, ValueError):
        raise SpecError(f"{field_}.residuals", g["residuals"], "numbers (log predicted / measured)", context) from None
    if not all(math.isfinite(r) and abs(r) < 3 for r in res):
        raise SpecError(f"{field_}.residuals", g["residuals"], "finite log-ratios between -3 and 3", context)
    return ResidualGroup(name, res, tuple(str(r) for r in g.get("rows") or ()), str(g.get("source") or ""))
