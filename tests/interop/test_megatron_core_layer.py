"""``echo-plan trace --source megatron-core``: the layer through Megatron-Core's own code, cached like the
built-in trace, beside it figure by figure; what cannot be traced that way refused in one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from echo_plan.cli import main
from echo_plan.errors import SpecError
from echo_plan.interop import megatron_core_layer as mcl
from echo_plan.specs import DType, ModelSpec, Recompute, load_model, load_stack
from echo_plan.specs.moe import LayerKind
from echo_plan.trace.cache import TraceCache

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[frameworks]')")

SMALL = dict(name="small-llama", num_layers=2, hidden_size=512, num_attention_heads=8, num_kv_heads=4,
             ffn_hidden_size=1024, vocab_size=1000, seq_length=256, activation="swiglu", norm="rmsnorm",
             position_embedding="rotary", tied_embeddings=False)


def test_a_trace_is_made_once_then_read_from_the_cache(tmp_path, monkeypatch):
    model, cache, stack = ModelSpec(**SMALL), TraceCache(tmp_path), load_stack("megatron-core")
    first = mcl.trace_with_megatron_core(model, tp=2, micro_batch_size=1, recompute=Recompute.SELECTIVE, stack=stack,
                                         cache=cache)
    assert not first.from_cache and first.collectives and "megatron-core=" in first.key.software

    def no_process(*a, **k):
        raise AssertionError("a cached trace started Megatron-Core again")

    monkeypatch.setattr(subprocess, "run", no_process)
    again = mcl.trace_with_megatron_core(model, tp=2, micro_batch_size=1, recompute=Recompute.SELECTIVE, stack=stack,
                                         cache=cache)
    assert again.from_cache and again.ops == first.ops
    assert again.key.digest() != mcl.make_key(model, mcl.StageKind.BLOCK, tp=2, sequence_parallel=False,
                                              micro_batch_size=1, dtype=DType.BF16,
                                              recompute=Recompute.SELECTIVE).digest()  # never the built-in's entry


@pytest.mark.parametrize("model, options, reason", [
    ("deepseek-v3", {}, "multi-head latent attention"),
    ("llama3-8b", {"sequence_parallel": True}, "sequence parallelism"),
    ("llama3-8b", {"dtype": DType.FP8}, "fp8"),
    ("mixtral-8x7b", {"kind": LayerKind(moe=True)}, "runs for real"),
    ("mixtral-8x7b", {"kind": LayerKind(moe=True), "ep": 8}, "expert parallelism"),
])
def test_what_cannot_be_traced_through_megatron_core_is_one_line(model, options, reason):
    args = dict(tp=1, micro_batch_size=1, recompute=Recompute.NONE, stack=load_stack("megatron-core"))
    with pytest.raises(SpecError, match=reason) as err:
        mcl.trace_with_megatron_core(load_model(model), **{**args, **options})
    assert "\n" not in str(err.value)


def test_the_command_prints_both_traces_side_by_side(tmp_path, capsys):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(json.dumps(SMALL))
    assert main(["trace", "--model", str(cfg), "--tp", "2", "--source", "megatron-core", "--json",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out)
    (layer,) = out["layers"]
    rows = {r["figure"]: r for r in layer["comparison"]}
    assert rows["GEMMs"]["equal"] and rows["GEMM FLOPs"]["equal"] and rows["collectives (phase, kind, bytes)"]["equal"]
    assert layer["megatron_core"]["param_count"] == layer["echo_plan"]["param_count"] > 0
    assert out["stand_ins"] and out["megatron_core"]
    assert main(["trace", "--model", str(cfg), "--source", "megatron-core", "--stage", "embedding"]) == 2
    err = capsys.readouterr().err
    assert "--stage" in err and len(err.strip().splitlines()) == 1
