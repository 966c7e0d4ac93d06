"""simulate --routing: the step under ECMP and planned routing, the per-group report, uplink faults."""

from __future__ import annotations

import json

import pytest

from echo_plan.cli import main
from echo_plan.errors import SpecError
from echo_plan.specs.faults import parse_fault
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-faults", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)  # as tests/resilience/test_faults.py: the same cached traces
_BASE = load_cluster("h800", gpus=32)
# four servers under leaves of two (4-port leaves: 2 down, 2 up), so pipeline and data-parallel traffic crosses
SMALL_LEAVES = _BASE.replace(network=_BASE.network.replace(leaf_radix=4, uplinks_per_leaf=2).model_dump())
PLANS = [PlanSpec(tp=4, pp=4, dp=2, global_batch_size=16, sequence_parallel=True),  # one trace serves both
         PlanSpec(tp=4, pp=2, dp=4, global_batch_size=32, sequence_parallel=True)]


@pytest.fixture(scope="module")
def memo():
    return SimulationMemo()


def step(cluster, plan, memo, routing, flows=1, faults=(), traffic=False):
    return simulate(MODEL, cluster.with_routing(routing, flows), plan, memo=memo, traffic=traffic,
                    faults=tuple(parse_fault(f) for f in faults))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.short())
def test_planned_never_slower_than_ecmp_and_none_is_planned_on_a_non_blocking_fabric(memo, plan):
    none = step(SMALL_LEAVES, plan, memo, "none").step_time_s
    planned = step(SMALL_LEAVES, plan, memo, "planned").step_time_s
    ecmp = [step(SMALL_LEAVES, plan, memo, "ecmp", k).step_time_s for k in (1, 4, 16)]
    assert planned == pytest.approx(none, rel=1e-12)
    assert all(planned <= t * (1 + 1e-12) for t in ecmp)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(ecmp, ecmp[1:]))  # more flows never slower


def test_single_leaf_cluster_is_unaffected_by_routing(memo):
    plan = PLANS[1]
    times = {r: step(_BASE, plan, memo, r).step_time_s for r in ("none", "planned", "ecmp")}
    assert times["none"] == times["planned"] == times["ecmp"]


def test_report_names_every_group_and_its_slowdowns(memo):
    r = step(SMALL_LEAVES, PLANS[0], memo, "ecmp", traffic=True)
    groups = r.traffic["groups"]
    assert r.traffic["routing"] == "ecmp" and groups
    crossing = [g for g in groups if g["crosses_leaves"]]
    assert crossing and any(g["group_kind"] == "pp" for g in crossing)
    for g in groups:
        s = g["slowdown"]
        assert 1.0 <= s["planned"] <= s["expected"] <= s["worst"] + 1e-9
        assert g["time_planned_s"] <= g["time_ecmp_expected_s"] * (1 + 1e-12)
        if not g["crosses_leaves"]:
            assert s["expected"] == 1.0
    assert "traffic" in r.as_json() and any(n.startswith("routing ecmp") for n in r.notes)


@pytest.mark.parametrize("routing", ["ecmp", "planned"])
def test_a_failed_uplink_never_speeds_a_step(memo, routing):
    for plan in PLANS:
        r = step(SMALL_LEAVES, plan, memo, routing, faults=("uplink:leaf=1,down=1",))
        assert r.step_time_s >= r.faults["healthy_step_time_s"] * (1 - 1e-9)
        assert any(s["causes"] for s in r.faults["stages"])


def test_uplink_fault_errors(memo):
    with pytest.raises(SpecError, match="--routing ecmp"):
        step(SMALL_LEAVES, PLANS[0], memo, "none", faults=("uplink:leaf=0,down=1",))
    with pytest.raises(SpecError, match="uplink.down"):
        step(SMALL_LEAVES, PLANS[0], memo, "ecmp", faults=("uplink:leaf=0,down=2",))
    with pytest.raises(SpecError, match="uplink.leaf"):
        step(SMALL_LEAVES, PLANS[0], memo, "ecmp", faults=("uplink:leaf=2,down=1",))


def test_cli_routing_json_and_errors(capsys, tmp_path):
    args = ["simulate", "--model", "gpt-13b", "--gpus", "1024", "--tp", "8", "--pp", "8", "--cache-dir",
            str(tmp_path)]
    assert main(args + ["--routing", "hashed"]) == 2
    err = capsys.readouterr().err
    assert "--routing" in err and "ecmp" in err and "Traceback" not in err
    assert main(args + ["--flows-per-connection", "0", "--routing", "ecmp"]) == 2
    assert "--flows-per-connection" in capsys.readouterr().err


def test_cli_simulate_prints_the_traffic_table(capsys, tmp_path):
    import yaml

    model, cluster = tmp_path / "model.yaml", tmp_path / "cluster.yaml"
    model.write_text(yaml.safe_dump(MODEL.model_dump(mode="json")))
    cluster.write_text(yaml.safe_dump(SMALL_LEAVES.model_dump(mode="json")))
    args = ["simulate", "--model", str(model), "--cluster", str(cluster), "--tp", "4", "--pp", "4",
            "--gbs", "16", "--sequence-parallel", "--routing", "ecmp", "--flows-per-connection", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Cross-leaf traffic" in out and "pp send_recv" in out
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["traffic"]["flows_per_connection"] == 2
    assert main(args[:-4] + ["--json"]) == 0  # routing none: no traffic section
    assert "traffic" not in json.loads(capsys.readouterr().out)


def test_whatif_sensitivity_adds_uplink_failures_under_a_routing(memo):
    from echo_plan.specs.faults import FaultKind
    from echo_plan.resilience.sensitivity import sensitivity

    plan = PLANS[0]
    for routing, expect in (("none", False), ("ecmp", True)):
        cluster = SMALL_LEAVES.with_routing(routing)

        def run(faults, cluster=cluster):
            return simulate(MODEL, cluster, plan, memo=memo, faults=faults).step_time_s

        _, rows = sensitivity(plan, cluster, run, kinds=None,
                              severities={FaultKind.UPLINK: (1, 8), FaultKind.STRAGGLER: (1.1,)})
        uplink = [r for r in rows if r.kind is FaultKind.UPLINK]
        assert bool(uplink) is expect
        assert all(r.worst_loss >= -1e-9 for r in uplink)  # a failed uplink never speeds the step
        assert [r.severity for r in uplink] == ([1] if expect else [])  # clamped below the leaf's 2 uplinks
