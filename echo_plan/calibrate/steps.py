"""Calibrating a cluster to measured step times: fit rows, held-out rows, and the calibration block.

Used by ``echo-plan calibrate steps`` (a team's own runs) and by ``echo_plan.calibrate.presets``
(the figures shipped in ``clusters/*.yaml``, from the public measurements). The fit itself is
``steps_fit.fit_compute``; here the rows are split, simulated exactly as ``simulate`` would
(the cluster's NCCL calibration included, its old compute calibration not), and the held-out
rows' residuals become the cluster's prediction ranges for that stack.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from echo_plan.calibrate.steps_fit import DEFAULT_FIT, StepFit, calibration_record, fit_compute
from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.errors import EchoPlanError
from echo_plan.validation.rows import TrainingRow
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.validation.predict import RowSimulator
from echo_plan import __version__
from echo_plan.cost.ranges import NOMINAL_COVERAGE, RangeMethod


@dataclass(frozen=True)
class RowOutcome:
    row: TrainingRow
    predicted_step_s: float
    held_out: bool

    @property
    def error(self) -> float:
        return (self.predicted_step_s - self.row.measured_step_s) / self.row.measured_step_s


@dataclass(frozen=True)
class StepsCalibration:
    fit: StepFit
    rows: tuple[RowOutcome, ...]
    stack: str

    @property
    def held_out(self) -> tuple[RowOutcome, ...]:
        return tuple(r for r in self.rows if r.held_out)

    def held_out_residuals(self) -> list[float]:
        import math

        return [math.log(r.predicted_step_s / r.row.measured_step_s) for r in self.held_out]


def every_nth(rows: Sequence[TrainingRow], n: int) -> set[str]:
    """Labels of every n-th simulable row (the n-th, 2n-th, ...), held out from the fit; n = 0: none."""
    if n < 0 or n == 1:
        raise EchoPlanError(f"--hold-out-every {n}: 0 (fit every row) or at least 2 (one row in n held out)")
    simulable = [r for r in rows if not r.not_modelled]
    return {r.label for i, r in enumerate(simulable) if n and i % n == n - 1}


def without_compute_calibration(cluster: Any) -> Any:
    cal = dict(cluster.calibration or {})
    cal.pop("compute", None)
    cal.pop("ranges", None)
    return cluster.replace(calibration=cal)


def calibrate_rows(rows: Sequence[TrainingRow], cluster: Any, stack_name: str, held_out: set[str],
                   fit: Sequence[str] = DEFAULT_FIT, model_settings: Any = None, cache: Any = None,
                   progress: Callable[[int, str], None] | None = None,
                   fixed: ComputeCalibration | None = None) -> StepsCalibration:
    """Fit ``cluster``'s compute figures on the simulable rows not in ``held_out``; predict all. ``fixed``: the
    figures not fitted here (the low-precision GEMM scales of fp8 rows among the fit rows), else their priors."""
    base = without_compute_calibration(cluster)
    sim = RowSimulator(base, stack_name, cache, model_settings=model_settings)
    simulable = [r for r in rows if not r.not_modelled]
    fit_rows = [r for r in simulable if r.label not in held_out]
    if not fit_rows:
        raise EchoPlanError("no row left to fit: every simulable row is held out or not modelled")
    consts = load_compute_constants()

    def predict(cal: ComputeCalibration, which: Sequence[TrainingRow] = fit_rows) -> list[float]:
        compute = AnalyticalComputeModel(calibrated_constants(cal, consts))
        out = []
        for r in which:
            p = sim.predict(r, compute=compute)
            if p.step_s is None:
                raise EchoPlanError(f"row {r.label!r}: {p.problem}")
            out.append(p.step_s)
        return out

    result = fit_compute(predict, [r.measured_step_s for r in fit_rows], [r.label for r in fit_rows], fit,
                         base=fixed, progress=progress)
    steps = predict(result.calibration, simulable)
    outcomes = tuple(RowOutcome(r, s, r.label in held_out) for r, s in zip(simulable, steps))
    return StepsCalibration(result, outcomes, stack_name)


def calibration_block(cal: StepsCalibration, suite_name: str, source: str,
                      old: dict | None = None) -> dict[str, Any]:
    """``calibration:`` for a cluster file: the compute figures with their rows, and the held-out
    residuals as the prediction range of the stack (merged into ``old``, whose nccl part stays)."""
    out = dict(old or {})
    out.pop("from", None)  # the figures are this fit's now, not a preset's the cluster inherited
    held = [r.row.label for r in cal.held_out]
    record = calibration_record(cal.fit, suite_name, source, held, cal.stack)
    record["source"] = (f"{source}; fitted by echo-plan {__version__} calibrate steps "
                        f"({_dt.date.today().isoformat()})")
    out["compute"] = record
    residuals = cal.held_out_residuals()
    ranges = dict(out.get("ranges") or {"nominal_coverage": NOMINAL_COVERAGE, "by_stack": {}})
    ranges["method"] = RangeMethod.HELD_OUT_ROWS.value
    by_stack = dict(ranges.get("by_stack") or {})
    if residuals:
        by_stack[cal.stack] = {"residuals": [round(r, 5) for r in residuals], "rows": held,
                               "source": f"{suite_name}: {len(residuals)} rows held out of the compute fit"}
    ranges["by_stack"] = by_stack
    out["ranges"] = ranges
    return out
