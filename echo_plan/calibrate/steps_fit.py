"""Fitting a cluster's compute calibration to measured step times (``echo-plan calibrate steps``).

The figures (``echo_plan.cost.calibration.ComputeCalibration``) are what the analytical kernel
model cannot know from datasheets: the GEMM and fused-attention rates a GPU sustains under a
training load, the memory bandwidth its kernels achieve, the fixed cost of one kernel. They are
found by re-simulating the fit rows, not by a formula: each iteration simulates every fit row at
the current figures and at each figure nudged (forward differences of log step time against log
figure), then takes a Gauss-Newton step on

    sum_i huber(log(predicted_i / measured_i) / MEASUREMENT_SD) + sum_k ((log x_k - log prior_k) / sd_k)^2

where the data term is divided by MEASUREMENT_SD^2. The prior term keeps a figure the rows cannot see (say, attention efficiency when no row runs
fused attention) at its prior instead of letting it wander; every prior is stated in ``PRIORS``.
The Huber loss (1.5 robust sigmas) keeps one odd row from pulling the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from echo_plan.cost.calibration import COMPUTE_FIELDS, ComputeCalibration
from echo_plan.errors import EchoPlanError


@dataclass(frozen=True, slots=True)
class Prior:
    value: float
    log_sd: float  # spread of log(value) the prior allows
    why: str


# JUDGEMENT, all of them: what the figures are believed to be before any row is seen.
PRIORS: dict[str, Prior] = {
    "gemm_efficiency_scale": Prior(1.0, 0.25, "the GEMM model is anchored on a measured best shape (MAMF); "
                                   "sustained clocks and real shapes can only be lower or near it"),
    "attention_efficiency_scale": Prior(1.0, 0.25, "the fused-attention rates are published kernel benchmarks"),
    "memory_bandwidth_scale": Prior(1.0, 0.10, "achievable HBM fractions come from STREAM-class copy benchmarks"),
    "kernel_overhead_us": Prior(3.0, 0.5, "a few microseconds per kernel (compute.yaml's launch overhead)"),
}
DEFAULT_FIT = tuple(PRIORS)
STEP = 0.05  # log step of the forward differences
HUBER_SIGMAS = 1.5
# JUDGEMENT: the noise of one measured step time, as a log-ratio (published step times of the same
# run vary by 1-3% with the step measured and the machine); it weighs the rows against the priors.
MEASUREMENT_SD = 0.03


@dataclass(frozen=True)
class StepFit:
    calibration: ComputeCalibration
    fitted: tuple[str, ...]
    fit_labels: tuple[str, ...]
    fit_residuals: tuple[float, ...]  # log(predicted / measured) of the fit rows at the result
    iterations: int
    sensitivities: dict[str, float]  # mean d log(step) / d log(figure) over the fit rows at the result

    def determined(self, name: str, threshold: float = 0.05) -> bool:
        """Whether the rows constrain a figure (else it sits at its prior)."""
        return abs(self.sensitivities.get(name, 0.0)) >= threshold


Predictor = Callable[[ComputeCalibration], Sequence[float]]  # figures -> predicted step times of the fit rows


def _calibration(names: Sequence[str], x: np.ndarray, base: ComputeCalibration) -> ComputeCalibration:
    values = base.values()
    for name, v in zip(names, np.exp(x)):
        lo, hi = COMPUTE_FIELDS[name]
        values[name] = float(min(max(v, max(lo, 1e-3)), hi))
    return ComputeCalibration(**values)


def fit_compute(predict: Predictor, measured: Sequence[float], labels: Sequence[str],
                fit: Sequence[str] = DEFAULT_FIT, base: ComputeCalibration | None = None, max_iter: int = 8,
                progress: Callable[[int, str], None] | None = None) -> StepFit:
    """Fit ``fit`` (names of ComputeCalibration figures) so that ``predict`` matches ``measured``."""
    unknown = [n for n in fit if n not in PRIORS]
    if unknown:
        raise EchoPlanError(f"cannot fit {unknown[0]!r}; figures: {', '.join(PRIORS)}")
    if not measured:
        raise EchoPlanError("no rows to fit: give at least one measured step time that can be simulated")
    base = base or ComputeCalibration()
    names = tuple(fit)
    prior = np.log([PRIORS[n].value for n in names])
    precision = np.array([1.0 / PRIORS[n].log_sd ** 2 for n in names])
    start = base.values()
    x = np.log([start.get(n, PRIORS[n].value) for n in names])
    meas = np.log(np.asarray(measured, dtype=float))

    def residuals(xv: np.ndarray) -> np.ndarray:
        pred = np.asarray(predict(_calibration(names, xv, base)), dtype=float)
        if not np.all(np.isfinite(pred)) or np.any(pred <= 0):
            raise EchoPlanError("a fit row could not be simulated at the trial figures")
        return np.log(pred) - meas

    r = residuals(x)
    it = 0
    jac = np.zeros((len(r), len(names)))
    for it in range(1, max_iter + 1):
        if progress is not None:
            progress(it, f"iteration {it}: mean |log error| {np.mean(np.abs(r)):.3f}")
        for j in range(len(names)):
            xj = x.copy()
            xj[j] += STEP
            jac[:, j] = (residuals(xj) - r) / STEP
        sigma = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), MEASUREMENT_SD)
        w = np.minimum(1.0, HUBER_SIGMAS * sigma / np.maximum(np.abs(r - np.median(r)), 1e-12)) / MEASUREMENT_SD ** 2
        a = jac.T @ (jac * w[:, None]) + np.diag(precision)
        g = jac.T @ (w * r) + precision * (x - prior)
        step = np.linalg.solve(a, -g)
        step = np.clip(step, -0.5, 0.5)
        x_new = x + step
        r_new = residuals(x_new)
        if np.sum(w * r_new ** 2) + np.sum(precision * (x_new - prior) ** 2) > \
                np.sum(w * r ** 2) + np.sum(precision * (x - prior) ** 2) + 1e-9:
            x_new = x + step / 2  # a damped step when the full one overshoots
            r_new = residuals(x_new)
        x, r = x_new, r_new
        if float(np.max(np.abs(step))) < 2e-3:
            break
    sens = {n: float(np.mean(jac[:, j])) for j, n in enumerate(names)}
    return StepFit(_calibration(names, x, base), names, tuple(labels), tuple(float(v) for v in r), it, sens)


def log_residuals(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    return [math.log(p / m) for p, m in zip(predicted, measured)]


def calibration_record(fit: StepFit, suite_name: str, source: str, held_out: Sequence[str], stack: str) -> dict[str, Any]:
    """What goes under ``calibration.compute`` in a cluster file: the figures and their provenance."""
    values = {k: round(v, 4) for k, v in fit.calibration.values().items()}
    notes = [f"{n} = {values[n]:g}: weakly constrained (step-time sensitivity {fit.sensitivities[n]:+.3f}), so "
             f"close to its prior {PRIORS[n].value:g} ({PRIORS[n].why})" for n in fit.fitted if not fit.determined(n)]
    return {
        **values,
        "source": source,
        "stack": stack,
        "fitted_on": {suite_name: list(fit.fit_labels)},
        "held_out": {suite_name: list(held_out)},
        "residuals": {label: round(r, 4) for label, r in zip(fit.fit_labels, fit.fit_residuals)},
        "notes": notes,
    }
