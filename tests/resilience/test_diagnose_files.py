"""diagnose on bad input: malformed, truncated or foreign record files give one line naming the
file (exit 2); the CLI's --json; simulate's record options are checked."""

from __future__ import annotations

import json
import pickle

import pytest

from echo_plan.cli import main
from echo_plan.resilience.diagnose.flight_recorder import dump_bytes

GOOD = {"rank": 0, "node": 0, "group": "g", "group_ranks": [0, 1], "seq": 1, "op": "all_reduce", "nbytes": 8,
        "enqueue_s": 1.0, "start_s": 1.0, "end_s": 1.1, "state": "completed"}


def fr_entry(seq: int, t: float) -> dict:
    return {"record_id": seq, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": "nccl:all_reduce", "is_p2p": False,
            "time_created_ns": int(t * 1e9), "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
            "output_dtypes": ["Float"], "state": "completed", "time_discovered_started_ns": int(t * 1e9),
            "time_discovered_completed_ns": int((t + 0.001) * 1e9), "duration_ms": 1.0, "retired": True,
            "timeout_ms": 60000, "frames": []}


def run_cli(capsys, *args):
    code = main(["diagnose", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(capsys, *args) -> str:
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_truncated_flight_recorder_dump(tmp_path, capsys):
    data = dump_bytes({"0": ("default_pg", (0, 1))}, [fr_entry(1, 1.0)])
    (tmp_path / "nccl_trace_rank_0").write_bytes(data[: len(data) // 2])
    err = one_line_error(capsys, tmp_path)
    assert "nccl_trace_rank_0" in err and "truncated" in err


def test_a_pickle_that_names_a_class_is_refused(tmp_path, capsys):
    (tmp_path / "nccl_trace_rank_1").write_bytes(pickle.dumps({"entries": [], "pg_config": {}, "x": OSError("x")}))
    err = one_line_error(capsys, tmp_path / "nccl_trace_rank_1")
    assert "nccl_trace_rank_1" in err and "not plain data" in err


def test_a_foreign_pickle_and_a_foreign_file(tmp_path, capsys):
    (tmp_path / "nccl_trace_rank_2").write_bytes(pickle.dumps([1, 2, 3]))
    assert "not a torch flight-recorder dump" in one_line_error(capsys, tmp_path / "nccl_trace_rank_2")
    (tmp_path / "notes.txt").write_text("hello")
    assert "notes.txt" in one_line_error(capsys, tmp_path / "notes.txt")


def test_a_dump_whose_name_has_no_rank(tmp_path, capsys):
    (tmp_path / "dump").write_bytes(dump_bytes({"0": ("default_pg", (0, 1))}, [fr_entry(1, 1.0)]))
    assert "its rank" in one_line_error(capsys, tmp_path / "dump")


def test_a_bad_entry_is_named(tmp_path, capsys):
    bad = fr_entry(2, 2.0)
    del bad["time_created_ns"]
    (tmp_path / "nccl_trace_rank_0").write_bytes(dump_bytes({"0": ("default_pg", (0, 1))}, [fr_entry(1, 1.0), bad]))
    assert "entry 1" in one_line_error(capsys, tmp_path)


def test_jsonl_errors_name_the_line(tmp_path, capsys):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD)[:40] + "\n")
    err = one_line_error(capsys, p)
    assert "r.jsonl, line 2" in err
    p.write_text(json.dumps({**GOOD, "state": "exploded"}) + "\n")
    assert "state='exploded'" in one_line_error(capsys, p)
    p.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "seq"}) + "\n")
    assert "without seq" in one_line_error(capsys, p)


def test_csv_errors(tmp_path, capsys):
    p = tmp_path / "r.csv"
    p.write_text("rank,group,seq\n0,g,1\n")
    assert "header without" in one_line_error(capsys, p)
    p.write_text("rank,node,group,group_ranks,seq,op,nbytes,enqueue_s,start_s,end_s,state,conns\n"
                 "0,0,g,0 1,1,all_reduce,8,1.0,1.0,1.1,completed,\n0,0,g,0 1,2,all_re\n")
    assert "line 3" in one_line_error(capsys, p)


def test_empty_folder_and_twice_the_same_rank(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "without record files" in one_line_error(capsys, tmp_path / "empty")
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert "rank 0 also has records" in one_line_error(capsys, tmp_path / "a.jsonl", tmp_path / "b.jsonl")


def test_json_output_of_a_flight_recorder_set(tmp_path, capsys):
    for r in (0, 1):
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(
            dump_bytes({"0": ("default_pg", (0, 1))}, [fr_entry(i, i * 1.0 + r * 1e-4) for i in range(1, 9)]))
    code, out, _ = run_cli(capsys, tmp_path, "--json", "--gpus-per-node", 8)
    d = json.loads(out)
    assert code == 0 and d["syndrome"] == "healthy" and d["suspects"] == [] and d["ranks_present"] == 2


def test_missing_rank_in_a_flight_recorder_set(tmp_path, capsys):
    (tmp_path / "nccl_trace_rank_0").write_bytes(
        dump_bytes({"0": ("default_pg", (0, 1, 2))}, [fr_entry(i, float(i)) for i in range(1, 5)]))
    code, out, _ = run_cli(capsys, tmp_path, "--json")
    assert code == 0 and json.loads(out)["missing_ranks"] == [1, 2]


@pytest.mark.parametrize("args,needle", [
    (["--fault", "gpu-hang:rank=1"], "--emit-records"),
    (["--fault", "gpu-hang:rank=999", "--emit-records", "{out}"], "gpu-hang.rank"),
    (["--fault", "nic-hang:node=0,nic=99", "--emit-records", "{out}"], "nic-hang.nic"),
    (["--emit-records", "{out}", "--record-format", "xml"], "--record-format"),
    (["--emit-records", "{out}", "--record-noise", "2"], "--record-noise"),
    (["--emit-records", "{busy}"], "new or empty folder"),
])
def test_simulate_record_options_are_checked(tmp_path, capsys, args, needle):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    args = [a.format(out=tmp_path / "out", busy=tmp_path / "busy") for a in args]
    code = main(["simulate", "-m", "llama2-7b", "--gpus", "16", "--tp", "8", *args])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_simulate_emits_what_diagnose_reads(tmp_path, capsys):
    model = tmp_path / "tiny.yaml"
    model.write_text("name: tiny\nnum_layers: 2\nhidden_size: 512\nnum_attention_heads: 8\nvocab_size: 4096\n"
                     "seq_length: 256\n")
    out = tmp_path / "recs"
    code = main(["simulate", "-m", str(model), "--gpus", "16", "--tp", "2", "--pp", "2", "--gbs", "8", "--fault",
                 "gpu-hang:rank=6", "--emit-records", str(out), "--record-noise", "0.02", "--json"])
    emitted = json.loads(capsys.readouterr().out)["emitted_records"]
    assert code == 0 and emitted["files"] == 16 and emitted["format"] == "flight-recorder"
    code, out_text, _ = run_cli(capsys, out, "--cluster", "h800", "--json")
    d = json.loads(out_text)
    assert code == 0 and d["syndrome"] == "non_communication_hang"
    assert (d["suspects"][0]["rank"], d["suspects"][0]["component"]) == (6, "gpu")
    assert 6 in d["evidence"]["never_entered"]
