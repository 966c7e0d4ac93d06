"""Robust statistics over segments of a column (median and MAD per key), vectorised."""

from __future__ import annotations

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD x this estimates a normal distribution's standard deviation


def seg_median(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the median of ``values`` over the rows that share its key (NaNs ignored only in
    that they sort last; callers pass finite values)."""
    if keys.size == 0:
        return values.astype(np.float64)
    order = np.lexsort((values, keys))
    k = keys[order]
    v = values[order].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], k.size]
    lo = starts + (ends - starts - 1) // 2
    hi = starts + (ends - starts) // 2
    med = (v[lo] + v[hi]) / 2.0
    seg = np.repeat(np.arange(starts.size), ends - starts)
    out = np.empty(keys.size, dtype=np.float64)
    out[order] = med[seg]
    return out


def seg_max(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the maximum of ``values`` over the rows sharing its key."""
    uniq, inv = np.unique(keys, return_inverse=True)
    m = np.full(uniq.size, -np.inf)
    np.maximum.at(m, inv, values)
    return m[inv]


def robust_z(x: np.ndarray, floor: float) -> tuple[np.ndarray, float, float]:
    """(z-scores, median, sigma) with sigma = 1.4826 MAD, at least ``floor``."""
    med = float(np.median(x)) if x.size else 0.0
    sigma = max(MAD_TO_SIGMA * float(np.median(np.abs(x - med))) if x.size else 0.0, floor)
    return (x - med) / sigma, med, sigma


def hash_cols(*cols: np.ndarray) -> np.ndarray:
    """One int64 key per row from several integer columns (a 64-bit mix; collisions ~2^-40 here)."""
    h = np.zeros(cols[0].shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = (h ^ c.astype(np.uint64)) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    return h.view(np.int64)
