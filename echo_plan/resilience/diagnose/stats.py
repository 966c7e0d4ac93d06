"""Robust statistics over segments of a column (quantiles per key), vectorised."""

from __future__ import annotations

import numpy as np


def seg_median(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per row, the median of ``values`` over the rows that share its key (finite values)."""
    return seg_quantile(keys, values, 0.5)


def seg_quantile(keys: np.ndarray, values: np.ndarray, q: float) -> np.ndarray:
    """Per row, the ``q`` quantile (nearest ranks averaged) of ``values`` over the rows sharing its key."""
    if keys.size == 0:
        return values.astype(np.float64)
    order = np.lexsort((values, keys))
    k = keys[order]
    v = values[order].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], k.size]
    pos = (ends - starts - 1) * q
    lo = starts + np.floor(pos).astype(np.int64)
    hi = starts + np.ceil(pos).astype(np.int64)
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


def normal_low(x: np.ndarray, floor: float) -> tuple[np.ndarray, float, float]:
    """(z-scores, baseline, sigma) for figures that faults only raise (times): the baseline is the
    lower quartile and sigma the gap from the 5th percentile to it (0.97 sigma for a normal
    distribution), at least ``floor``. Unlike the median and MAD, this stays right when up to
    three quarters of the values are raised, e.g. a slow server holding half of a two-server job."""
    if x.size == 0:
        return x, 0.0, floor
    q05, q25 = np.percentile(x, [5, 25])
    sigma = max(float(q25 - q05) / 0.97, floor)
    return (x - q25) / sigma, float(q25), sigma


def hash_cols(*cols: np.ndarray) -> np.ndarray:
    """One int64 key per row from several integer columns (a 64-bit mix; collisions ~2^-40 here)."""
    h = np.zeros(cols[0].shape[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in cols:
            h = (h ^ c.astype(np.uint64)) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    return h.view(np.int64)
