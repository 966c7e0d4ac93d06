"""The sharding and layer-recompute flags: every mistake is one line naming the flag and what is valid."""

from __future__ import annotations

import pytest

from echo_plan.cli import main

PLAN = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--gbs", "32"]


@pytest.mark.parametrize("extra, says", [
    (["--sharding", "bogus"], "one of none, optimizer, gradients, parameters"),
    (["--sharding", "parameters", "--shard-degree", "3"], "valid: 1, 2, 4, 8, 16"),
    (["--shard-degree", "4"], "needs --sharding"),
    (["--reshard-after-forward"], "--sharding parameters only"),
    (["--sharding", "none", "--distributed-optimizer"], "give one of them"),
    (["--sharding", "parameters", "--pp", "2", "--schedule", "zb-h1"], "gpipe, 1f1b or interleaved"),
    (["--recompute-layers", "3", "--recompute", "full"], "recomputes every layer already"),
    (["--recompute-layers", "40"], "at most the 32 layers of a model chunk"),
    (["--recompute-layers", "-1"], "greater than or equal to 0"),
    (["--offload-optimizer"], "needs a sharded optimizer"),
    (["--offload-optimizer", "--sharding", "parameters", "--stack", "olmo-core"], "stack olmo-core sets "
                                                                                   "optimizer_offload none"),
    (["--offload-optimizer", "--sharding", "parameters", "--stack", "torchtitan"], "micro-batches per step=2"),
    (["--offload-optimizer", "--distributed-optimizer", "--cluster", "h100-gt"], "gives no host figures"),
    (["--offload-fraction", "0.5", "--distributed-optimizer"], "needs --offload-optimizer"),
    (["--offload-optimizer", "--distributed-optimizer", "--offload-fraction", "0"], "a share in (0, 1]"),
    (["--offload-optimizer", "--distributed-optimizer", "--offload-fraction", "nan"], "a share in (0, 1]"),
])
def test_a_bad_sharding_or_recompute_flag_is_one_line(capsys, extra, says):
    assert main(PLAN + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_simulate_says_which_sharding_runs(capsys):
    assert main(PLAN + ["--stack", "torchtitan", "--distributed-optimizer", "--shard-degree", "8", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    notes = " ".join(out["notes"])
    assert "shards the parameters" in notes and "all-reduced across 2 replicas (HSDP)" in notes


def test_simulate_offloads_the_optimizer_and_says_what_it_costs(capsys):
    import json

    assert main(PLAN + ["--distributed-optimizer", "--offload-optimizer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["offload_optimizer"] is True
    stages = out["memory_per_stage"]
    assert all(s["optimizer_bytes"] == 0 < s["host_bytes"] <= s["host_capacity_bytes"] for s in stages)
    assert any(n.startswith("optimizer offloaded to the CPU (stack megatron-core: megatron-hybrid)")
               for n in out["notes"])
