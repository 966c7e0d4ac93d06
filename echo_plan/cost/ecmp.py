"""ECMP collisions as balls into bins, and what they cost the slowest flow (pure functions).

A leaf switch hashes every flow that leaves it onto one of its ``U`` uplinks (and the spines hash
the flows that enter a leaf onto its downlinks): ``F`` flows land like ``F`` balls thrown into
``U`` bins. A link that carries flows whose demands add up to more than its rate shares it, so
each of its flows runs at ``rate / load`` of its demand, and a ring or tree collective, paced by
its slowest flow, takes ``max(1, max load)`` times as long as on a collision-free fabric
(demands and loads are in units of one link's rate). Planned routing (C4P) puts flows on disjoint
uplinks: the least possible maximum load, ``ceil(F / U) x demand`` for equal flows.

Because a job's flows keep their hash for its lifetime, a draw is what one job sees every step;
the expectation is over jobs (launches), and the 99th percentile is what one job in a hundred
sees. The maximum over several independent bin sets (every leaf's uplinks and downlinks) is
computed exactly where every set's flows share one demand (the distribution of the fullest bin,
through the Poisson representation of the multinomial), and by a seeded Monte Carlo otherwise;
both are deterministic. A failed uplink moves only its own flows onto the surviving links, each
re-hashed uniformly (the coupling the Monte Carlo uses), so survivors' loads never fall.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

EXACT_MAX_FLOWS = 1 << 16  # per bin set; above this the Monte Carlo answers
DEFAULT_SAMPLES = 2000
MC_BUDGET = 20_000_000  # flow draws per Monte Carlo estimate; fewer samples for more flows (at least 200)
_TAIL = 1e-12  # probability mass the exact distribution may leave out above its last point


@dataclass(frozen=True, slots=True)
class BinSet:
    """Flows hashed onto one layer of links: ``flows`` are (demand, count) pairs, demands in units of
    one link's rate; ``bins`` the links, ``failed`` of them down; ``copies`` identical independent sets."""

    bins: int
    flows: tuple[tuple[float, int], ...]
    failed: int = 0
    copies: int = 1

    @property
    def live(self) -> int:
        return self.bins - self.failed

    @property
    def count(self) -> int:
        return sum(n for _, n in self.flows)

    @property
    def equal(self) -> bool:
        return len(self.flows) == 1


@dataclass(frozen=True, slots=True)
class Slowdown:
    """How much longer the slowest flow takes than its demand allows (1 = no slowdown)."""

    expected: float  # ECMP, mean over hash draws
    p99: float  # ECMP, 99th percentile
    worst: float  # ECMP, every flow of the fullest set on one link
    planned: float  # planned routing: the least possible maximum load
    method: str  # "exact", "monte-carlo" or "none" (no flow crosses a leaf)
    flows: int  # flows that cross a leaf (each is in one uplink set and one downlink set)

    def as_json(self) -> dict:
        return {"expected": self.expected, "p99": self.p99, "worst": self.worst, "planned": self.planned,
                "method": self.method, "cross_leaf_flows": self.flows}


NO_SLOWDOWN = Slowdown(1.0, 1.0, 1.0, 1.0, "none", 0)


def flow_GBps(link_GBps: float, demand_GBps: float, load_GBps: float) -> float:
    """Bandwidth of one flow on a link whose flows ask ``load_GBps`` in all: its demand, or its fair
    share of the link when the link is oversubscribed."""
    if load_GBps <= link_GBps:
        return demand_GBps
    return demand_GBps * link_GBps / load_GBps


# -- exact --------------------------------------------------------------------------------------------
def _log_poisson(lam: float, upto: int) -> np.ndarray:
    j = np.arange(upto + 1, dtype=float)
    return j * math.log(lam) - lam - np.array([math.lgamma(x + 1.0) for x in j])


def _conv_power_at(q: np.ndarray, times: int, at: int) -> float:
    """Term ``at`` of ``q`` convolved with itself ``times`` times (by FFT, no wrap-around)."""
    size = 1 << max(4, ((len(q) - 1) * times + 1 - 1).bit_length())
    spectrum = np.fft.rfft(q, size)
    return float(np.fft.irfft(spectrum ** times, size)[at])


def max_load_cdf(flows: int, bins: int, m: int) -> float:
    """P(no bin holds more than ``m`` of ``flows`` balls thrown uniformly into ``bins`` bins).

    Multinomial = independent Poisson(F/U) counts conditioned on their sum being F:
    P(max <= m) = P(X <= m)^U x P(sum of U Poissons truncated at m = F) / P(Poisson(F) = F)."""
    if flows <= 0 or m >= flows:
        return 1.0
    if m * bins < flows:
        return 0.0
    lam = flows / bins
    logp = _log_poisson(lam, m)
    top = logp.max()
    p = np.exp(logp - top)
    mass = p.sum()
    q = p / mass
    conv = _conv_power_at(q, bins, flows)
    if conv <= 1e-300:
        return 0.0
    log_denominator = flows * math.log(flows) - flows - math.lgamma(flows + 1.0)
    value = bins * (math.log(mass) + top) + math.log(conv) - log_denominator
    return min(1.0, math.exp(value))


def max_load_distribution(flows: int, bins: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(m, P(max load <= m)) over the loads the fullest bin can have with noticeable probability,
    from ``start`` up (the first entry then also holds every smaller load)."""
    if flows <= 0:
        return np.array([0]), np.array([1.0])
    lo = max(-(-flows // bins), min(start, flows))
    ms, cdf = [], []
    m = lo
    while True:
        c = max_load_cdf(flows, bins, m)
        ms.append(m)
        cdf.append(c)
        if c >= 1.0 - _TAIL or m >= flows:
            break
        m += 1
    cdf[-1] = 1.0
    return np.array(ms), np.maximum.accumulate(np.array(cdf))


def expected_max_load(flows: int, bins: int) -> float:
    """E[balls in the fullest bin], exact."""
    ms, cdf = max_load_distribution(flows, bins)
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    return float((ms * pmf).sum())


# -- Monte Carlo --------------------------------------------------------------------------------------
def sample_bins(rng: np.random.Generator, flows: int, bins: int, failed: int, samples: int) -> np.ndarray:
    """(samples, flows) uplink indices: a uniform hash, and the flows of failed links (the last
    ``failed`` indices) re-hashed uniformly onto the survivors."""
    first = rng.integers(0, bins, size=(samples, flows))
    if failed:
        second = rng.integers(0, bins - failed, size=(samples, flows))
        first = np.where(first >= bins - failed, second, first)
    return first


def sample_max_loads(flows: int, bins: int, samples: int, seed: int = 0, failed: int = 0) -> np.ndarray:
    """The fullest bin's count in ``samples`` seeded draws."""
    rng = np.random.default_rng(seed)
    return _set_max(rng, BinSet(bins, ((1.0, flows),), failed), samples)


def expected_max_load_mc(flows: int, bins: int, samples: int = DEFAULT_SAMPLES, seed: int = 0,
                         failed: int = 0) -> float:
    return float(sample_max_loads(flows, bins, samples, seed, failed).mean())


def _set_max(rng: np.random.Generator, s: BinSet, samples: int) -> np.ndarray:
    """Largest load of one copy of ``s`` per sample."""
    weights = np.concatenate([np.full(n, d) for d, n in s.flows]) if s.flows else np.zeros(0)
    if weights.size == 0:
        return np.zeros(samples)
    idx = sample_bins(rng, weights.size, s.bins, s.failed, samples)
    flat = (idx + np.arange(samples)[:, None] * s.bins).ravel()
    loads = np.bincount(flat, weights=np.broadcast_to(weights, idx.shape).ravel(), minlength=samples * s.bins)
    return loads.reshape(samples, s.bins).max(axis=1)


# -- a collective's slowdown ----------------------------------------------------------------------------
def planned_load(s: BinSet) -> float:
    """The least possible maximum load of ``s`` when flows are placed, not hashed: equal flows
    ``ceil(F / U) x d``; unequal ones the fractional bound max(total / U, largest flow)."""
    if s.equal:
        d, n = s.flows[0]
        return -(-n // s.live) * d
    total = sum(d * n for d, n in s.flows)
    return max(total / s.live, max(d for d, _ in s.flows))


def worst_load(s: BinSet) -> float:
    return sum(d * n for d, n in s.flows) if s.live > 0 else math.inf


def slowdown(sets: Sequence[BinSet], samples: int = DEFAULT_SAMPLES, seed: int = 0,
             exact: bool | None = None) -> Slowdown:
    """The slowest flow's slowdown over independent bin sets under ECMP and planned routing.
    ``exact=None`` picks the exact distribution when every set has equal flows and is small enough."""
    sets = [s for s in sets if s.count > 0]
    if not sets:
        return NO_SLOWDOWN
    flows = sum(s.count * s.copies for s in sets) // 2  # each flow leaves one leaf and enters another
    planned = max(1.0, max(planned_load(s) for s in sets))
    worst = max(1.0, max(worst_load(s) for s in sets))
    can_exact = all(s.equal and s.count <= EXACT_MAX_FLOWS for s in sets)
    use_exact = can_exact if exact is None else (exact and can_exact)
    if use_exact:
        expected, p99 = _exact_stats(sets)
        method = "exact"
    else:
        samples = max(200, min(samples, MC_BUDGET // max(1, 2 * flows)))  # draws stay within the budget
        rng = np.random.default_rng(seed)
        worst_draw = np.ones(samples)
        for s in sets:
            for _ in range(s.copies):
                worst_draw = np.maximum(worst_draw, _set_max(rng, s, samples))
        expected, p99, method = float(worst_draw.mean()), float(np.quantile(worst_draw, 0.99)), "monte-carlo"
    return Slowdown(max(expected, planned), max(p99, planned), worst, planned, method, flows)


def _exact_stats(sets: Sequence[BinSet]) -> tuple[float, float]:
    """(E[S], 99th percentile of S) for S = max(1, max over sets of d x fullest bin), sets independent."""
    dists = []
    for s in sets:
        d, n = s.flows[0]
        ms, cdf = max_load_distribution(n, s.live, start=int(1.0 / d))  # loads up to 1/d cost nothing
        dists.append((d, ms, cdf, s.copies))
    values = sorted({1.0} | {float(d * m) for d, ms, _, _ in dists for m in ms if d * m > 1.0})
    prev, expected, p99 = 0.0, 0.0, None
    for v in values:
        p = 1.0
        for d, ms, cdf, copies in dists:
            k = int(np.searchsorted(ms, v / d * (1 + 1e-12), side="right")) - 1
            p *= (cdf[k] if k >= 0 else 0.0) ** copies
        expected += v * max(0.0, p - prev)
        if p99 is None and p >= 0.99:
            p99 = v
        prev = max(prev, p)
    return float(expected), float(p99 if p99 is not None else values[-1])
