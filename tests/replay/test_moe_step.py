"""Whole-step properties of MoE plans: imbalance, where the all-to-all runs, the breakdown."""

from __future__ import annotations

import pytest

from echo_plan.cost.collectives import collective_model_for
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind


@pytest.fixture(scope="module")
def model(small_moe) -> ModelSpec:
    return small_moe


@pytest.fixture(scope="module")
def memo() -> SimulationMemo:
    return SimulationMemo()


def step(model, plan, memo, gpus=16):
    return simulate(model, load_cluster("h800", gpus=gpus), plan, memo=memo)


@pytest.mark.parametrize("ep", [2, 8, 16])
def test_imbalance_never_speeds_a_step(model, memo, ep):
    times = [step(model, PlanSpec(dp=16, ep=ep, global_batch_size=32, expert_imbalance=f), memo).step_time_s
             for f in (1.0, 1.5, 3.0)]
    assert times == sorted(times) and times[-1] > times[0]


def test_breakdown_sums_to_the_step(model, memo):
    r = step(model, PlanSpec(tp=2, pp=2, dp=4, ep=8, etp=1, sequence_parallel=True, global_batch_size=32), memo)
    assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
    assert any(n.startswith("MoE all-to-all: ep 8 group inside one server") for n in r.notes)


def test_an_all_to_all_inside_a_server_beats_the_same_one_across_servers():
    cluster = load_cluster("h800", gpus=64)
    comm = collective_model_for(cluster)
    inside = CommGroup(GroupKind.EP, size=8, stride=1)
    across = CommGroup(GroupKind.EP, size=8, stride=8)  # one rank per server
    for nbytes in (1 << 20, 64 << 20, 512 << 20):
        assert comm.time(CollectiveKind.ALL_TO_ALL, nbytes, inside, cluster).time_s < \
            comm.time(CollectiveKind.ALL_TO_ALL, nbytes, across, cluster).time_s


def test_expert_parallel_across_servers_is_noted_with_its_peers(model, memo):
    r = step(model, PlanSpec(dp=16, ep=16, global_batch_size=32), memo)
    note = next(n for n in r.notes if n.startswith("MoE all-to-all"))
    assert "across 2 servers (7 of 15 peers over NVLink, 8 over the network)" in note
