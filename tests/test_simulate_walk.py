"""A plan followed through simulate goes down the floors: no call from a module into one on a higher
floor (a callback from a lower stage into simulate's closures counts too), with and without faults.
benchmarks/simulate_walk.py prints the same walk for GPT-3 175B on 1,024 H800."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import simulate_walk  # noqa: E402


@pytest.mark.parametrize("faults", [False, True])
@pytest.mark.parametrize("schedule,vpp", [("interleaved", 2), ("zb-v", 1)])
def test_a_plan_goes_down_the_floors(faults, schedule, vpp):
    plan = dict(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=32, virtual_stages=vpp, schedule=schedule,
                sequence_parallel=True, distributed_optimizer=True)
    got = simulate_walk.walk(faults, "llama2-7b", 16, plan)
    assert len(got["visited"]) > 20  # the walk saw the stages
    assert got["climbs"] == {}
    assert not [p for p in got["between"] if p[0].startswith("echo_plan.cost")]  # cost never calls replay
