"""``echo-plan trace``: the per-stage summary, its JSON form, the cache, and user errors."""

import json

import yaml

from echo_plan.cli import main

SMALL = {"name": "small", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "num_kv_heads": 4,
         "ffn_hidden_size": 512, "vocab_size": 1000, "seq_length": 128, "activation": "swiglu",
         "norm": "rmsnorm", "position_embedding": "rotary", "tied_embeddings": False}


def _model(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(SMALL))
    return str(path)


def _no_overlap_stack(tmp_path):
    path = tmp_path / "no-overlap.yaml"
    path.write_text("base: megatron-core\ntp_comm_overlap: false\n")
    return path


def test_json_summary_then_cache_hit(tmp_path, capsys):
    args = ["trace", "-m", _model(tmp_path), "--tp", "2", "--sequence-parallel", "--recompute", "selective",
            "--json", "--cache-dir", str(tmp_path / "cache"), "--stack", str(_no_overlap_stack(tmp_path))]
    assert main(args) == 0
    cold = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in cold["stages"]] == ["block", "embedding", "output"]
    assert not any(s["from_cache"] for s in cold["stages"]) and cold["cache"]["misses"] == 3
    block = cold["stages"][0]
    assert block["saved_bytes"] == block["saved_bytes_by_mode"]["selective"]
    assert {c["kind"] for c in block["collectives"]} == {"all_gather", "reduce_scatter"}
    assert all(c["nbytes"] == 128 * 256 * 2 and c["group_size"] == 2 for c in block["collectives"])
    assert block["flops"] > 0 and block["ops"] == sum(p["ops"] for p in block["phases"].values())
    assert main(args) == 0
    warm = json.loads(capsys.readouterr().out)
    assert all(s["from_cache"] for s in warm["stages"]) and warm["cache"]["hits"] == 3
    assert [s["key"] for s in warm["stages"]] == [s["key"] for s in cold["stages"]]


def test_table_and_op_listing(tmp_path, capsys):
    args = ["trace", "-m", _model(tmp_path), "--tp", "2", "--stage", "block", "--ops",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "[block]" in out and "[output]" not in out and "traced" in out
    assert "all_reduce" in out and "aten.mm.default" in out and "flash_attention" in out


def test_bad_tp_is_one_line_error(tmp_path, capsys):
    assert main(["trace", "-m", _model(tmp_path), "--tp", "8", "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tp=8") and "num_kv_heads" in err and "\n" not in err
    assert main(["trace", "-m", _model(tmp_path), "--mbs", "0", "--cache-dir", str(tmp_path / "c")]) == 2


def test_corrupt_cache_file_is_one_warning_line(tmp_path, capsys):
    cache = tmp_path / "cache"
    args = ["trace", "-m", _model(tmp_path), "--stage", "embedding", "--json", "--cache-dir", str(cache)]
    assert main(args) == 0
    capsys.readouterr()
    (entry,) = cache.iterdir()
    entry.write_text("{broken")
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("warning: trace cache: discarding")
    assert json.loads(captured.out)["cache"]["corrupt"] == 1
