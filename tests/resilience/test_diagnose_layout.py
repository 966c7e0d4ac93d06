"""diagnose with the job's layout (--tp/--cp/--pp/--dp): groups named by kind, every rank expected."""

from __future__ import annotations

import pytest

from echo_plan.errors import EchoPlanError
from echo_plan.resilience.diagnose.analyze import diagnose_paths
from echo_plan.resilience.diagnose.emit import RecordFormat, emit_job, prepare_job
from echo_plan.resilience.diagnose.layout import Layout
from echo_plan.specs.faults import parse_fault
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-diagnose", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)
CLUSTER = load_cluster("h800", gpus=32)
PLAN = PlanSpec(tp=2, pp=2, dp=8, global_batch_size=32)


def test_groups_are_named_by_the_dimensions_their_members_differ_in():
    lay = Layout(tp=2, cp=2, dp=4, pp=2)  # rank = t + 2 (c + 2 (d + 4 p))
    assert lay.world == 32 and lay.coords(0) == (0, 0, 0, 0) and lay.coords(31) == (1, 1, 3, 1)
    assert lay.label((0, 1)) == "tp"
    assert lay.label((0, 2)) == "cp"
    assert lay.label((0, 4, 8, 12)) == "dp"
    assert lay.label((0, 2, 4, 6, 8, 10, 12, 14)) == "cp+dp"  # a CP job's gradient group
    assert lay.label((0, 4)) == "part of dp"  # an expert-parallel group inside the data-parallel one
    assert lay.label((5, 21)) == "pp"


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    out = tmp_path_factory.mktemp("hung") / "r"
    emit_job(prepare_job(MODEL, CLUSTER, PLAN), (parse_fault("gpu-hang:rank=13"),), out=str(out),
             fmt=RecordFormat.JSONL, steps=2, noise=0.03, seed=1, buffer=2000)
    return str(out)


def test_the_layout_names_the_hung_collectives_group_and_keeps_the_verdict(hung):
    plain = diagnose_paths([hung], 8).as_json()
    named = diagnose_paths([hung], 8, (2, None, 2, None)).as_json()
    assert named["syndrome"] == plain["syndrome"] == "non_communication_hang"
    assert named["suspects"][0]["rank"] == plain["suspects"][0]["rank"] == 13
    kinds = [h["group"].rsplit("(", 1)[-1].rstrip(")") for h in named["evidence"]["hung_collectives"]]
    assert kinds and all(k in ("tp", "dp", "pp", "part of dp") for k in kinds)


def test_a_layout_larger_than_the_records_reports_the_ranks_that_wrote_nothing(hung):
    d = diagnose_paths([hung], 8, (2, None, 2, 16))  # 64 GPUs: ranks 32-63 lost their dumps
    assert d.missing_ranks == tuple(range(32, 64))
    assert any("32 of 64 ranks have no records" in n for n in d.notes)


def test_records_outside_the_layout_and_bad_degrees_are_one_line_errors(hung, capsys):
    with pytest.raises(EchoPlanError, match="outside the layout's 16 GPUs"):
        diagnose_paths([hung], 8, (2, None, 2, 4))
    from echo_plan.cli import main

    assert main(["diagnose", hung, "--tp", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tp" in err and len(err.splitlines()) == 1
