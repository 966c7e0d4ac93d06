"""Reading a record set on worker processes gives the table one process reads, and the same errors."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import pytest

from echo_plan.errors import EchoPlanError
from echo_plan.resilience.diagnose.emit import RecordFormat, emit_job, prepare_job
from echo_plan.resilience.diagnose.load import load_files, record_files
from echo_plan.specs.faults import parse_fault
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-diagnose", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)
CLUSTER = load_cluster("h800", gpus=32)
PLAN = PlanSpec(tp=2, pp=2, dp=8, global_batch_size=32)


@pytest.mark.parametrize("fmt", [RecordFormat.FLIGHT_RECORDER, RecordFormat.JSONL])
def test_shares_read_by_workers_merge_into_the_single_process_table(tmp_path, fmt):
    emit_job(prepare_job(MODEL, CLUSTER, PLAN), (parse_fault("link:node=1,nic=3,bw=0.5"),), out=str(tmp_path / "r"),
             fmt=fmt, steps=1, noise=0.03, seed=3, buffer=2000)
    files = record_files([str(tmp_path / "r")])
    one = load_files(files, 8, processes=1)
    three = load_files(files, 8, processes=3)  # uneven shares: 32 files in 11, 11, 10
    for f in fields(one):
        a, b = getattr(one, f.name), getattr(three, f.name)
        if f.name in ("group", "op"):  # ids follow each table's own numbering: compare the names
            names = "group_names" if f.name == "group" else "op_names"
            a, b = np.asarray(getattr(one, names))[a], np.asarray(getattr(three, names))[b]
        if f.name in ("group_names", "group_ranks", "op_names"):
            assert set(a) == set(b)
        elif isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert a == b, f.name


def test_a_rank_in_two_shares_is_the_same_one_line_error(tmp_path):
    emit_job(prepare_job(MODEL, CLUSTER, PLAN), (), out=str(tmp_path / "r"), fmt=RecordFormat.JSONL, steps=1,
             noise=0.0, seed=1, buffer=2000)
    files = record_files([str(tmp_path / "r")])
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(files[0].read_bytes())
    for processes in (1, 2):
        with pytest.raises(EchoPlanError, match="also has records in"):
            load_files(files + [copy], 8, processes=processes)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(EchoPlanError, match="bad.jsonl"):
        load_files(files + [bad], 8, processes=2)
