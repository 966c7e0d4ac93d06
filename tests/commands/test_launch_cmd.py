"""``export launch``, ``import launch``, ``simulate/search --from-launch`` and ``calibrate steps --from-log``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from echo_plan.cli import main

DATA = Path(__file__).parents[1] / "interop" / "launch_data"
PLAN = ["--model", "llama3-8b", "--cluster", "h800", "--gpus", "16", "--tp", "2", "--pp", "2", "--gbs", "32",
        "--sequence-parallel", "--distributed-optimizer", "--recompute", "selective"]


@pytest.fixture()
def cache(tmp_path_factory):
    return ["--cache-dir", str(tmp_path_factory.getbasetemp() / "launch-traces")]


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_the_exported_job_simulates_as_the_plan_it_came_from(capsys, tmp_path, cache):
    script = tmp_path / "job.sh"
    assert main(["export", "launch", "--format", "megatron-lm", "-o", str(script)] + PLAN) == 0
    assert "pretrain_gpt.py" in script.read_text()
    capsys.readouterr()
    assert main(["simulate", "--json"] + PLAN + cache) == 0
    direct = _json(capsys)
    assert main(["simulate", "--json", "--from-launch", str(script), "--cluster", "h800"] + cache) == 0
    via = _json(capsys)
    assert via["plan"] == direct["plan"] and via["step_time_s"] == direct["step_time_s"]
    assert main(["import", "launch", str(script), "--json"] + cache) == 0
    imported = _json(capsys)
    assert imported["step_time_s"] == direct["step_time_s"] and imported["gpus"] == 16


def test_from_launch_refuses_plan_flags_and_unreadable_files(capsys, tmp_path):
    script = tmp_path / "job.sh"
    assert main(["export", "launch", "--format", "megatron-lm", "-o", str(script)] + PLAN) == 0
    capsys.readouterr()
    assert main(["simulate", "--from-launch", str(script), "--tp", "4"]) == 2
    assert "--tp" in capsys.readouterr().err
    binary = tmp_path / "job.toml"
    binary.write_bytes(b"\x00\xff\x10garbage")
    for bad in (str(binary), str(tmp_path / "missing.sh"), str(tmp_path)):
        assert main(["import", "launch", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
    listed = tmp_path / "job.yaml"
    listed.write_text("- 1\n- 2\n")
    assert main(["import", "launch", str(listed)]) == 2
    assert "model: section" in capsys.readouterr().err


def test_export_refuses_in_one_line_and_never_writes(capsys, tmp_path):
    out = tmp_path / "job.toml"
    assert main(["export", "launch", "--format", "torchtitan", "-o", str(out)] + PLAN) == 2
    assert not out.exists()
    err = capsys.readouterr().err
    assert "torchtitan cannot run this plan as simulated" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "launch", "--format", "slurm"] + PLAN) == 2
    assert "megatron-lm, megatron-bridge, torchtitan" in capsys.readouterr().err


def test_export_from_a_saved_search_takes_its_ranked_plan(capsys, tmp_path, cache):
    db = tmp_path / "s.db"
    args = ["search", "--model", "gpt-13b", "--cluster", "h800", "--gpus", "16", "--gbs", "64", "--trials", "8",
            "--storage", f"sqlite:///{db}", "--processes", "1", "--json", "--no-progress"] + cache
    assert main(args) == 0
    saved = tmp_path / "result.json"
    saved.write_text(capsys.readouterr().out)
    ranked = json.loads(saved.read_text())["ranked"]
    exported = 0
    for rank, result in enumerate(ranked, start=1):
        code = main(["export", "launch", "--format", "megatron-lm", "--from", str(saved), "--rank", str(rank),
                     "--json"])
        out = capsys.readouterr()
        if code == 2:  # a schedule Megatron lacks (zb-h1, zb-v, dualpipe): said in one line
            assert result["plan"]["schedule"] in ("zb-h1", "zb-v", "dualpipe"), out.err
            assert "schedule" in out.err and len(out.err.strip().splitlines()) == 1
            continue
        plan, text = result["plan"], json.loads(out.out)["text"]
        assert f"--tensor-model-parallel-size {plan['tp']}" in text
        assert f"--micro-batch-size {plan['micro_batch_size']}" in text
        exported += 1
    assert exported >= 1
    assert main(["export", "launch", "--format", "megatron-bridge", "--from", str(saved)]) == 2
    assert "no Megatron-Bridge recipe" in capsys.readouterr().err  # gpt-13b has none
    assert main(["export", "launch", "--format", "megatron-lm", "--from", str(saved), "--rank", "999"]) == 2
    assert "--rank" in capsys.readouterr().err
    assert main(["export", "launch", "--format", "megatron-lm", "--from", str(saved), "--tp", "2"]) == 2
    assert "--tp" in capsys.readouterr().err


def test_search_from_launch_compares_the_job_with_the_best_plan(capsys, tmp_path, cache):
    script = tmp_path / "job.sh"
    assert main(["export", "launch", "--format", "megatron-lm", "-o", str(script)] + PLAN) == 0
    capsys.readouterr()
    assert main(["search", "--from-launch", str(script), "--trials", "6", "--processes", "1", "--no-progress",
                 "--storage", f"sqlite:///{tmp_path / 's.db'}"] + cache) == 0
    out = capsys.readouterr().out
    assert "your job" in out and "tp2 pp2 dp4" in out
    assert main(["search", "--from-launch", str(script), "--gbs", "64"]) == 2
    assert "--gbs" in capsys.readouterr().err


def test_search_from_a_launch_file_without_its_gpus_takes_them_from_gpus(capsys, tmp_path, cache):
    """A torchtitan TOML has no GPU count of its own without a torchrun line: search --from-launch takes --gpus for
    it, as simulate --from-launch and import launch do, and the error that asks for them says so."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\n'
                   'global_batch_size = 16\nseq_len = 2048\n[parallelism]\ndata_parallel_shard_degree = -1\n'
                   '[activation_checkpoint]\nmode = "full"\n')
    assert main(["search", "--from-launch", str(job)]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["search", "--from-launch", str(job), "--gpus", "8", "--trials", "4", "--processes", "1",
                 "--no-progress", "--storage", f"sqlite:///{tmp_path / 's.db'}"] + cache) == 0
    assert "your job" in capsys.readouterr().out


def test_calibrate_steps_from_logs_writes_a_cluster_that_loads(capsys, tmp_path, cache):
    out = tmp_path / "mine.yaml"
    args = ["calibrate", "steps", "--cluster", "h800", "-o", str(out), "--hold-out-every", "0", "--json",
            "--from-log", str(DATA / "megatron_lm_step.log"), "--launch", str(DATA / "llama3_8b_tp2.sh"),
            "--from-log", str(DATA / "nemo_step.log"), "--launch", str(DATA / "llama3_8b_pp2.sh")] + cache
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [r["measured_step_s"] for r in summary["rows"]] == pytest.approx([7.8059, 7.82])
    data = yaml.safe_load(out.read_text())
    assert "compute" in data["calibration"]
    assert main(["calibrate", "steps", "--cluster", "h800", "-o", str(tmp_path / "x.yaml"),
                 "--from-log", str(DATA / "nemo_step.log")]) == 2  # no launch config, no argument dump
    assert "--launch" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()
    assert main(["calibrate", "steps", "--cluster", "h800", "-o", str(tmp_path / "x.yaml"),
                 "--from-log", str(DATA / "nemo_step.log"), "--launch", "a.sh", "--launch", "b.sh"]) == 2
    assert "one per --from-log" in capsys.readouterr().err


def test_a_megatron_log_with_its_argument_dump_calibrates_without_a_launch_file(capsys, tmp_path, cache):
    script = (DATA / "llama3_8b_tp2.sh").read_text()
    from echo_plan.interop.launch import import_launch
    from echo_plan.specs import load_stack

    job = import_launch(script, "job.sh", load_stack(None))
    args = {"num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
            "num_query_groups": 8, "group_query_attention": True, "seq_length": 8192, "max_position_embeddings": 8192,
            "vocab_size": 128256, "swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope",
            "untie_embeddings_and_output_weights": True, "add_bias_linear": False, "bf16": True, "fp16": False,
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
            "sequence_parallel": True, "micro_batch_size": 1, "global_batch_size": 64, "world_size": 8,
            "hidden_dropout": 0.0, "attention_dropout": 0.0, "attention_backend": "AttnBackend.fused",
            "use_distributed_optimizer": False, "overlap_grad_reduce": True, "tp_comm_overlap": True,
            "accumulate_allreduce_grads_in_fp32": True, "recompute_granularity": None}
    dump = ["------------------------ arguments ------------------------"]
    dump += [f"  {k} {'.' * (44 - len(k))} {v}" for k, v in sorted(args.items())]
    dump += ["-------------------- end of arguments ---------------------"]
    log = tmp_path / "train.log"
    log.write_text("\n".join(dump) + "\n" + (DATA / "megatron_lm_step.log").read_text())
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "steps", "--cluster", "h800", "-o", str(out), "--hold-out-every", "0", "--json",
                 "--from-log", str(log)] + cache) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["measured_step_s"] == pytest.approx(7.8059) and job.plan.short() in row["label"]


CSV = """# echo-plan: cluster=h800 stack=megatron-core
model,num_layers,hidden_size,ffn_hidden_size,num_attention_heads,num_kv_heads,vocab_size,seq_length,activation,norm,position,tied_embeddings,dropout,gpus,tp,pp,vpp,cp,mbs,gbs,precision,recompute,sequence_parallel,distributed_optimizer,overlap_grad_sync,overlap_param_sync,grad_sync_dtype,step_time_s
llama3-8b,32,4096,14336,32,8,128256,8192,swiglu,rmsnorm,rope,false,0.0,8,2,1,1,1,1,64,bf16,none,true,false,true,false,fp32,7.8059
llama3-8b,32,4096,14336,32,8,128256,8192,swiglu,rmsnorm,rope,false,0.0,8,1,2,1,1,1,64,bf16,selective,false,false,true,false,fp32,7.82
"""


def test_logs_fit_exactly_as_the_same_runs_written_as_a_csv(capsys, tmp_path, cache):
    csv = tmp_path / "runs.csv"
    csv.write_text(CSV)
    common = ["--cluster", "h800", "--hold-out-every", "0", "--json"] + cache
    assert main(["calibrate", "steps", str(csv), "-o", str(tmp_path / "a.yaml")] + common) == 0
    from_csv = json.loads(capsys.readouterr().out)
    assert main(["calibrate", "steps", "-o", str(tmp_path / "b.yaml"),
                 "--from-log", str(DATA / "megatron_lm_step.log"), "--launch", str(DATA / "llama3_8b_tp2.sh"),
                 "--from-log", str(DATA / "nemo_step.log"), "--launch", str(DATA / "llama3_8b_pp2.sh")] + common) == 0
    from_logs = json.loads(capsys.readouterr().out)
    assert from_logs["figures"] == pytest.approx(from_csv["figures"], rel=1e-9)
    assert [r["predicted_step_s"] for r in from_logs["rows"]] == pytest.approx(
        [r["predicted_step_s"] for r in from_csv["rows"]], rel=1e-9)
