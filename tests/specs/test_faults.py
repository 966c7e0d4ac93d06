"""Faults in the replay: properties that must hold, and one-line errors for impossible faults."""

from __future__ import annotations

import pytest

from echo_plan.cli import main
from echo_plan.errors import SpecError
from echo_plan.specs.faults import FaultKind, parse_fault, stage_effects
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-faults", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)
CLUSTER = load_cluster("h800", gpus=32)
PLANS = [
    PlanSpec(tp=2, pp=4, dp=4, global_batch_size=64, sequence_parallel=True),
    PlanSpec(tp=1, pp=2, dp=16, global_batch_size=64, distributed_optimizer=True),
    PlanSpec(tp=4, pp=2, dp=4, global_batch_size=32, virtual_stages=2, sequence_parallel=True),
]


@pytest.fixture(scope="module")
def memo():
    return SimulationMemo()


def run(plan, memo, *faults):
    return simulate(MODEL, CLUSTER, plan, memo=memo, faults=tuple(parse_fault(f) for f in faults))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.short())
@pytest.mark.parametrize("fault", ["straggler:rank=0,compute=1.3", "link:node=1,nic=0,bw=0.5",
                                   "nvlink:node=0,bw=0.5", "node:node=2,compute=1.2"])
def test_a_fault_never_speeds_a_step(memo, plan, fault):
    r = run(plan, memo, fault)
    assert r.step_time_s >= r.faults["healthy_step_time_s"] * (1 - 1e-9)
    assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.short())
def test_a_straggler_costs_about_its_stage_compute_share(memo, plan):
    f = 1.5
    healthy = run(plan, memo)
    slow = run(plan, memo, f"straggler:rank=0,compute={f}")
    stage0 = slow.faults["stages"][0]
    busy_healthy = stage0["busy_s"] / f
    # the slowed stage becomes the bottleneck: the step grows by about (f - 1) x its busy time
    predicted = max(healthy.step_time_s, healthy.step_time_s + (f - 1) * busy_healthy)
    assert slow.step_time_s == pytest.approx(predicted, rel=0.15)


def test_a_fault_off_the_critical_path_costs_less(memo):
    plan = PlanSpec(tp=1, pp=4, dp=8, global_batch_size=64)
    probe = run(plan, memo, "straggler:rank=0,compute=1.0001")  # per-stage busy times of the healthy step
    busy = [s["busy_s"] for s in probe.faults["stages"]]
    critical, slack = busy.index(max(busy)), busy.index(min(busy))
    assert critical != slack
    per_stage = plan.tp * plan.dp
    on_critical = run(plan, memo, f"straggler:rank={critical * per_stage},compute=1.05").step_time_s
    off_critical = run(plan, memo, f"straggler:rank={slack * per_stage},compute=1.05").step_time_s
    assert off_critical < on_critical


def test_unused_gpus_and_stage_mapping():
    plan = PlanSpec(tp=2, pp=4, dp=2, global_batch_size=16)  # 16 of the cluster's 32 GPUs
    effects = stage_effects((parse_fault("straggler:rank=5,compute=2"), parse_fault("node:node=3,compute=3")),
                            plan, CLUSTER)
    assert effects[1].compute_scale == 2 and all(e.compute_scale == 1 for i, e in enumerate(effects) if i != 1)


@pytest.mark.parametrize("text, says", [
    ("straggler:rank=99,compute=1.2", "a rank below 32"),
    ("link:node=9,nic=0,bw=0.5", "a server below 4"),
    ("link:node=0,nic=12,bw=0.5", "a NIC below 8"),
    ("straggler:rank=1,compute=-1", "a factor > 0"),
    ("nvlink:node=0", "nvlink takes exactly"),
    ("fast:rank=1", "one of straggler, link, nvlink, node"),
    ("straggler:rank=1,rank=2,compute=2", "rank is given twice"),
])
def test_impossible_faults_are_one_line_errors(tmp_path, capsys, text, says):
    model = tmp_path / "m.json"
    model.write_text(MODEL.model_dump_json())
    code = main(["simulate", "--model", str(model), "--cluster", "h800", "--gpus", "32", "--fault", text])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err


def test_fault_file_and_json(tmp_path, capsys):
    import json

    model = tmp_path / "m.json"
    model.write_text(MODEL.model_dump_json())
    faults = tmp_path / "faults.yaml"
    faults.write_text("- {kind: straggler, rank: 3, compute: 1.25}\n- {kind: link, node: 2, nic: 5, bw: 0.5}\n")
    code = main(["simulate", "--model", str(model), "--gpus", "32", "--pp", "2", "--fault-file", str(faults), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["step_time_s"] > out["healthy_step_time_s"]
    assert [f["kind"] for f in out["faults"]] == ["straggler", "link"]
    assert out["faults"][0]["stages"] == [0] and out["faults"][1]["stages"] == [1]
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults: 3\n")
    assert main(["simulate", "--model", str(model), "--gpus", "32", "--fault-file", str(bad)]) == 2
    assert FaultKind.LINK.value == "link"
    with pytest.raises(SpecError):
        parse_fault("straggler")
