"""The share of each tier an all-to-all reaches inside a training step (nccl.yaml), and its fit."""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace

import pytest

from echo_plan.calibrate.a2a_fit import a2a_fit, merge, with_share
from echo_plan.cost.collectives import NcclModel
from echo_plan.cost.nccl_params import load_default_params
from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.validation.rows import STEP_UNIT, TrainingRow
from echo_plan.validation.suites import fitted_rows

SHARES = (1.0, 0.8, 0.5, 0.25)
ACROSS = CommGroup(GroupKind.EP, size=16, stride=1)  # two 8-GPU servers
INSIDE = CommGroup(GroupKind.EP, size=8, stride=1)


def _models(name: str):
    base = load_default_params()
    return [NcclModel(base.with_calibration({name: s})) for s in SHARES]


@pytest.fixture(scope="module")
def cluster():
    return load_cluster("dgx-h100", gpus=16).replace(calibration={})


@pytest.fixture(scope="module")
def model(small_moe) -> ModelSpec:
    return small_moe


def test_defaults_are_nccls_own_model():
    p = load_default_params()
    assert p.all_to_all_net_efficiency == 1.0 and p.all_to_all_nvlink_efficiency == 1.0


@pytest.mark.parametrize("name,group", [("all_to_all_net_efficiency", ACROSS),
                                        ("all_to_all_nvlink_efficiency", INSIDE)])
def test_a_smaller_share_never_speeds_an_all_to_all(cluster, name, group):
    for nbytes in (64 << 10, 8 << 20, 256 << 20):
        times = [m.time(CollectiveKind.ALL_TO_ALL, nbytes, group, cluster).time_s for m in _models(name)]
        assert times == sorted(times)
    big = [m.time(CollectiveKind.ALL_TO_ALL, 256 << 20, group, cluster).time_s for m in _models(name)]
    assert big[-1] > 2 * big[0]  # the bandwidth term dominates a large exchange


def test_the_network_share_leaves_other_collectives_and_in_server_exchanges_alone(cluster):
    full, slow = _models("all_to_all_net_efficiency")[0], _models("all_to_all_net_efficiency")[-1]
    for kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        assert full.time(kind, 64 << 20, ACROSS, cluster) == slow.time(kind, 64 << 20, ACROSS, cluster)
    assert full.time(CollectiveKind.ALL_TO_ALL, 64 << 20, INSIDE, cluster) == \
        slow.time(CollectiveKind.ALL_TO_ALL, 64 << 20, INSIDE, cluster)


@pytest.mark.parametrize("value", [0, -0.5, 1.5, "fast", float("nan")])
def test_a_share_outside_0_1_is_an_error_naming_it(value):
    with pytest.raises(SpecError, match="all_to_all_net_efficiency"):
        load_default_params().with_calibration({"all_to_all_net_efficiency": value})


def test_a_slower_all_to_all_never_speeds_a_step(cluster, model):
    memo = SimulationMemo()
    across = PlanSpec(dp=16, ep=16, global_batch_size=32)  # ep 16 spans both servers
    inside = PlanSpec(dp=16, ep=8, global_batch_size=32)
    t_across = [simulate(model, with_share(cluster, s), across, memo=memo).step_time_s for s in SHARES]
    t_inside = [simulate(model, with_share(cluster, s), inside, memo=memo).step_time_s for s in SHARES]
    assert t_across == sorted(t_across) and t_across[-1] > t_across[0]
    assert t_inside == [t_inside[0]] * len(SHARES)  # no exchange crosses the network


def _row(model, measured: float) -> TrainingRow:
    return TrainingRow("small-moe 16 GPUs", measured, STEP_UNIT, model=model, gpus=16,
                       plan=MappingProxyType(dict(dp=16, ep=16, global_batch_size=32)))


def test_the_fit_recovers_the_share_a_row_was_made_with(cluster, model):
    made = simulate(model, with_share(cluster, 0.5), PlanSpec(dp=16, ep=16, global_batch_size=32)).step_time_s
    other = TrainingRow("other row", made * 1.1, STEP_UNIT, model=model, gpus=16,
                        plan=MappingProxyType(dict(dp=16, ep=8, global_batch_size=32)))
    got = a2a_fit([_row(model, made), other], ["small-moe 16 GPUs"], cluster, "megatron-core", iterations=14)
    assert got["share"] == pytest.approx(0.5, abs=0.01)
    assert got["fitted_on"] == ["small-moe 16 GPUs"] and got["held_out"] == ["other row"]
    assert abs(got["residuals"]["small-moe 16 GPUs"]) < 0.01


def test_the_fit_names_a_row_it_cannot_find(cluster, model):
    with pytest.raises(EchoPlanError, match="no modelled row labelled nowhere"):
        a2a_fit([_row(model, 1.0)], ["nowhere"], cluster, "megatron-core")


def test_fitted_rows_count_as_fitted_not_held_out():
    got = {"suite": "moe_h100", "share": 0.7, "fitted_on": ["a"], "held_out": ["b"], "residuals": {"a": 0.0}}
    nccl = merge({"params": {"net_bw_efficiency": 0.9}}, got)
    assert nccl["params"] == {"net_bw_efficiency": 0.9, "all_to_all_net_efficiency": 0.7}
    cal = {"compute": {"fitted_on": {"moe_h100": ["c"]}}, "nccl": nccl}
    assert fitted_rows(SimpleNamespace(calibration=cal), "moe_h100") == {"a", "c"}
    assert fitted_rows(SimpleNamespace(calibration=cal), "other") == set()
    load_default_params().with_calibration(nccl["params"])  # what the preset ships is a valid calibration


def test_a_refit_from_nccl_tests_keeps_the_share_fitted_on_training_steps():
    from echo_plan.calibrate.a2a_fit import keep_share

    shipped = load_cluster("dgx-h100").calibration
    record = {"params": {"net_bw_efficiency": 0.8, "all_to_all_net_efficiency": 1.0}, "provenance": {"tool": "x"}}
    kept = keep_share(record, shipped)
    assert kept["params"]["net_bw_efficiency"] == 0.8
    assert kept["params"]["all_to_all_net_efficiency"] == shipped["nccl"]["params"]["all_to_all_net_efficiency"] < 1
    assert kept["provenance"]["all_to_all_fit"]["fitted_on"] == {"moe_h100": ["deepseek-v3 bf16 512 GPUs"]}
    assert keep_share(record, load_cluster("azure-nd-a100-v4").calibration) == record  # nothing to keep
