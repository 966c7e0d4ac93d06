"""A small robust least-squares solver for the NCCL fit (numpy only).

Levenberg-Marquardt on residuals with a numerical Jacobian, iteratively reweighted with Huber
weights (scale from the median absolute deviation), inside box bounds; then points whose residual
lies more than ``reject_k`` robust standard deviations from the median are dropped and the fit is
repeated. The model's residuals are only piecewise smooth (the fastest algorithm/protocol wins),
which forward differences and the damping handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution x this = its standard deviation


@dataclass(frozen=True)
class SolverResult:
    x: np.ndarray
    residuals: np.ndarray  # at x, every point (kept and rejected)
    kept: np.ndarray  # bool mask of the points used in the final fit
    iterations: int
    cost: float  # robust cost over kept points


def robust_sigma(r: np.ndarray, floor: float) -> float:
    med = float(np.median(r))
    return max(MAD_TO_SIGMA * float(np.median(np.abs(r - med))), floor)


def _huber_weights(r: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    w = np.ones_like(r)
    big = a > delta
    w[big] = delta / a[big]
    return w


def _lm(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray,
        mask: np.ndarray, delta_floor: float, max_iter: int) -> tuple[np.ndarray, int, float]:
    x = np.clip(x0.astype(float), lo, hi)
    lam = 1e-2
    r = fun(x)[mask]
    delta = 1.345 * robust_sigma(r, delta_floor)
    w = _huber_weights(r, delta)
    cost = float(np.sum(w * r * r))
    it = 0
    for it in range(1, max_iter + 1):
        h = 1e-4
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            xj = x.copy()
            step = h if xj[j] + h <= hi[j] else -h
            xj[j] += step
            jac[:, j] = (fun(xj)[mask] - r) / step
        sw = np.sqrt(w)
        jw, rw = jac * sw[:, None], r * sw
        g = jw.T @ rw
        a = jw.T @ jw
        improved = False
        for _ in range(12):
            step = np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -g)
            xn = np.clip(x + step, lo, hi)
            rn = fun(xn)[mask]
            wn = _huber_weights(rn, delta)
            cn = float(np.sum(wn * rn * rn))
            if cn < cost:
                x, r, w, cost = xn, rn, wn, cn
                lam = max(lam / 3.0, 1e-7)
                improved = True
                break
            lam *= 4.0
        if not improved or np.max(np.abs(step)) < 1e-6:
            break
        delta = 1.345 * robust_sigma(r, delta_floor)
        w = _huber_weights(r, delta)
        cost = float(np.sum(w * r * r))
    return x, it, cost


def robust_fit(fun: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               reject_k: float | None = 4.0, sigma_floor: float = 0.25, max_iter: int = 60,
               rounds: int = 3, mask: np.ndarray | None = None) -> SolverResult:
    """Minimise a Huber loss of ``fun(x)`` (residuals) in the box [lo, hi].

    ``mask`` leaves points out from the start; with ``reject_k`` set, points further than that
    many robust standard deviations (at least ``sigma_floor``) from the median residual are
    dropped too and the fit repeated.
    """
    r0 = fun(np.clip(x0, lo, hi))
    allowed = np.isfinite(r0) & (mask if mask is not None else True)
    mask = allowed
    x, total_it, cost = np.asarray(x0, float), 0, float("inf")
    for _ in range(rounds):
        x, it, cost = _lm(fun, x, lo, hi, mask, 0.02, max_iter)
        total_it += it
        if reject_k is None:
            break
        r = fun(x)
        sig = robust_sigma(r[mask], sigma_floor)
        med = float(np.median(r[mask]))
        new_mask = allowed & (np.abs(r - med) <= reject_k * sig)
        if np.array_equal(new_mask, mask):
            break
        mask = new_mask
    return SolverResult(x=x, residuals=fun(x), kept=mask, iterations=total_it, cost=cost)
