"""diagnose (C4D): each syndrome from emitted records, determinism, missing ranks, and hand-made
delay matrices (a slow link is one cell, a slow NIC a row and a column)."""

from __future__ import annotations

import json

import pytest

from echo_plan.resilience.diagnose.analyze import diagnose_paths
from echo_plan.resilience.diagnose.emit import RecordFormat, emit_job, prepare_job
from echo_plan.specs.faults import nic_ranks, parse_fault
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-diagnose", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)
CLUSTER = load_cluster("h800", gpus=32)  # 4 servers of 8 GPUs, 8 NICs each
PLAN = PlanSpec(tp=2, pp=2, dp=8, global_batch_size=32)  # TP pairs, DP over two servers, 2 stages


@pytest.fixture(scope="module")
def job():
    return prepare_job(MODEL, CLUSTER, PLAN)


def emit(job, tmp_path, faults=(), fmt=RecordFormat.JSONL, seed=1, noise=0.03, name="r"):
    out = tmp_path / name
    emit_job(job, tuple(parse_fault(f) for f in faults), out=str(out), fmt=fmt, steps=2, noise=noise, seed=seed,
             buffer=2000)
    return out


CASES = [  # fault, format, syndrome, component, what the top suspect must name
    ("straggler:rank=5,compute=1.4", RecordFormat.JSONL, "non_communication_slow", "gpu", ("rank", 5)),
    ("node:node=2,compute=1.5", RecordFormat.CSV, "non_communication_slow", "gpu", ("node", 2)),
    ("link:node=1,nic=3,bw=0.4", RecordFormat.JSONL, "communication_slow", "nic", ("rank", 11)),
    ("link:node=1,nic=3,bw=0.4", RecordFormat.FLIGHT_RECORDER, "communication_slow", "nic", ("rank", 11)),
    ("nvlink:node=3,bw=0.4", RecordFormat.FLIGHT_RECORDER, "communication_slow", "nvlink", ("node", 3)),
    ("gpu-hang:rank=13", RecordFormat.FLIGHT_RECORDER, "non_communication_hang", "gpu", ("rank", 13)),
    ("gpu-hang:rank=20", RecordFormat.CSV, "non_communication_hang", "gpu", ("rank", 20)),
]


@pytest.mark.parametrize("fault,fmt,syndrome,component,where", CASES, ids=[f"{c[0]}-{c[1].value}" for c in CASES])
def test_each_syndrome_names_its_fault(job, tmp_path, fault, fmt, syndrome, component, where):
    d = diagnose_paths([str(emit(job, tmp_path, [fault], fmt))], CLUSTER.gpus_per_node).as_json()
    top = d["suspects"][0]
    assert (d["syndrome"], top["component"]) == (syndrome, component), d["verdict"]
    assert top[where[0]] == where[1], d["verdict"]
    assert 0 < top["confidence"] <= 1


def test_a_hung_nic_is_a_communication_hang_at_that_nic(job, tmp_path):
    d = diagnose_paths([str(emit(job, tmp_path, ["nic-hang:node=1,nic=0"]))], 8).as_json()
    assert d["syndrome"] == "communication_hang"
    ranks = set(nic_ranks(1, 0, CLUSTER))
    assert d["suspects"][0]["rank"] in ranks or d["suspects"][0].get("peer") in ranks
    assert d["evidence"]["hung_collectives"]


@pytest.mark.parametrize("fmt", list(RecordFormat))
def test_healthy_jobs_name_no_fault(job, tmp_path, fmt):
    for seed in (1, 2):
        d = diagnose_paths([str(emit(job, tmp_path, (), fmt, seed=seed, name=f"h{seed}"))], 8)
        assert d.syndrome.value == "healthy" and not d.suspects, d.verdict


def test_records_are_deterministic_per_seed(job, tmp_path):
    a = emit(job, tmp_path, ["straggler:rank=3,compute=1.2"], seed=7, name="a")
    b = emit(job, tmp_path, ["straggler:rank=3,compute=1.2"], seed=7, name="b")
    c = emit(job, tmp_path, ["straggler:rank=3,compute=1.2"], seed=8, name="c")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) == PLAN.world_size
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in files)


def test_missing_ranks_are_named_and_the_rest_diagnosed(job, tmp_path):
    out = emit(job, tmp_path, ["straggler:rank=5,compute=1.4"])
    for r in (0, 17, 30):
        (out / f"rank_{r}.jsonl").unlink()
    d = diagnose_paths([str(out)], 8)
    assert d.missing_ranks == (0, 17, 30)
    assert d.suspects[0].rank == 5 and d.syndrome.value == "non_communication_slow"
    assert any("missing" in n or "no records" in n for n in d.notes)


def _ring_records(tmp_path, slow_cells: dict, ranks=8, gpn=1, instances=30):
    """Hand-made JSONL: one ring all-reduce group per instance, with per-connection busy times."""
    members = list(range(ranks))
    lines = {r: [] for r in members}
    t = 0.0
    for i in range(1, instances + 1):
        start, dur = t + 0.01, 0.002
        for k, r in enumerate(members):
            nxt, prv = members[(k + 1) % ranks], members[k - 1]
            busy = lambda a, b: 0.001 * (1 + 0.01 * ((a * 7 + b * 3 + i) % 5)) * slow_cells.get((a, b), 1.0)
            lines[r].append({"rank": r, "node": r // gpn, "group": "dp", "group_ranks": members, "seq": i,
                             "op": "all_reduce", "nbytes": 1 << 20, "enqueue_s": start - 1e-6, "start_s": start,
                             "end_s": start + dur, "state": "completed",
                             "conns": [{"peer": nxt, "dir": "send", "busy_s": busy(r, nxt), "done": 1},
                                       {"peer": prv, "dir": "recv", "busy_s": busy(prv, r), "done": 1}]})
        t = start + dur
    for r, recs in lines.items():
        (tmp_path / f"rank_{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
    return tmp_path


def test_one_slow_cell_is_a_link(tmp_path):
    d = diagnose_paths([str(_ring_records(tmp_path, {(3, 4): 2.0}))])
    top = d.suspects[0]
    assert d.syndrome.value == "communication_slow"
    assert (top.component.value, top.rank, top.peer) == ("link", 3, 4)
    assert d.evidence["delay_matrix"]["cells"][0]["src"] == 3


def test_a_slow_row_and_column_is_the_nic(tmp_path):
    d = diagnose_paths([str(_ring_records(tmp_path, {(3, 4): 2.0, (2, 3): 2.0}))])
    top = d.suspects[0]
    assert (d.syndrome.value, top.component.value, top.rank) == ("communication_slow", "nic", 3)
