"""The ECMP balls-into-bins model: properties that must hold (cost/ecmp.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from echo_plan.cost.ecmp import (
    BinSet, expected_max_load, expected_max_load_mc, flow_GBps, max_load_cdf, max_load_distribution,
    sample_max_loads, slowdown,
)


def _brute_expected_max(flows: int, bins: int) -> float:
    """Every one of bins^flows placements, equally likely."""
    import itertools

    total = 0
    for placement in itertools.product(range(bins), repeat=flows):
        total += max(np.bincount(placement, minlength=bins))
    return total / bins ** flows


@pytest.mark.parametrize("flows,bins", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 4), (6, 2)])
def test_exact_matches_enumeration(flows, bins):
    assert expected_max_load(flows, bins) == pytest.approx(_brute_expected_max(flows, bins), rel=1e-9)


@pytest.mark.parametrize("flows,bins", [(8, 32), (32, 32), (100, 32), (300, 64), (64, 8)])
def test_monte_carlo_agrees_with_exact(flows, bins):
    exact = expected_max_load(flows, bins)
    draws = sample_max_loads(flows, bins, 4000, seed=7)
    stderr = draws.std() / math.sqrt(draws.size)
    assert abs(draws.mean() - exact) < 4 * stderr + 1e-9
    # and the collective-level statistic agrees whichever way it is computed
    sets = [BinSet(bins, ((0.25, flows),), copies=3)]
    ex, mc = slowdown(sets, exact=True), slowdown(sets, exact=False, samples=4000, seed=3)
    assert (ex.method, mc.method) == ("exact", "monte-carlo")
    assert mc.expected == pytest.approx(ex.expected, rel=0.02)


def test_monte_carlo_is_deterministic_per_seed():
    assert expected_max_load_mc(50, 16, 500, seed=1) == expected_max_load_mc(50, 16, 500, seed=1)
    sets = [BinSet(8, ((0.5, 10), (0.2, 7)))]
    assert slowdown(sets, seed=5) == slowdown(sets, seed=5)


@pytest.mark.parametrize("connections,bins", [(1, 2), (2, 2), (4, 8), (16, 32), (32, 32), (40, 16)])
def test_more_flows_per_connection_never_raise_the_expected_maximum_load(connections, bins):
    """Each connection split into k flows of 1/k of its demand: E[fullest link] in connection
    units never rises with k (convexity of the maximum; the mean of k draws)."""
    loads = [expected_max_load(connections * k, bins) / k for k in (1, 2, 3, 4, 6, 8, 16)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(loads, loads[1:]))
    slow = [slowdown([BinSet(bins, ((1.0 / k, connections * k),))]).expected for k in (1, 2, 4, 8)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(slow, slow[1:]))


@pytest.mark.parametrize("seed", range(6))
def test_planned_never_slower_than_ecmp(seed):
    rng = np.random.default_rng(seed)
    sets = [BinSet(int(rng.integers(1, 40)),
                   tuple((float(rng.choice([0.1, 0.25, 0.5, 1.0])), int(rng.integers(1, 60)))
                         for _ in range(int(rng.integers(1, 3)))), copies=int(rng.integers(1, 4)))
            for _ in range(int(rng.integers(1, 4)))]
    s = slowdown(sets, seed=seed, samples=500)
    assert 1.0 <= s.planned <= s.expected <= s.worst + 1e-9
    assert s.planned <= s.p99 <= s.worst + 1e-9


def test_planned_is_the_pigeonhole_bound():
    assert slowdown([BinSet(32, ((1.0, 32),))]).planned == 1.0
    assert slowdown([BinSet(32, ((1.0, 33),))]).planned == 2.0
    assert slowdown([BinSet(32, ((0.5, 64),))]).planned == 1.0


@pytest.mark.parametrize("flows,bins", [(16, 32), (40, 8), (5, 3)])
def test_a_failed_uplink_never_lowers_the_load(flows, bins):
    healthy = sample_max_loads(flows, bins, 2000, seed=2)
    for failed in range(1, bins):
        # the same draws: only the failed links' flows move, so no surviving link gets lighter
        hurt = sample_max_loads(flows, bins, 2000, seed=2, failed=failed)
        assert expected_max_load(flows, bins - failed) >= expected_max_load(flows, bins - failed + 1) - 1e-9
    half = sample_max_loads(flows, bins, 2000, seed=2, failed=bins // 2) if bins > 1 else healthy
    assert half.mean() >= healthy.mean() and hurt.mean() >= healthy.mean()
    one = slowdown([BinSet(bins, ((1.0, flows),))])
    less = slowdown([BinSet(bins, ((1.0, flows),), failed=1)])
    assert less.expected >= one.expected and less.planned >= one.planned


def test_distribution_is_a_distribution():
    ms, cdf = max_load_distribution(200, 32)
    assert cdf[-1] == 1.0 and (np.diff(cdf) >= -1e-15).all() and ms[0] == math.ceil(200 / 32)
    assert max_load_cdf(10, 4, 2) == 0.0 and max_load_cdf(10, 4, 10) == 1.0


def test_flow_bandwidth_is_a_fair_share_only_when_the_link_is_full():
    assert flow_GBps(50.0, 25.0, 40.0) == 25.0
    assert flow_GBps(50.0, 25.0, 100.0) == pytest.approx(12.5)
