"""``calibrate kernels``: the measuring harness on CPU, argument rebuilding, and the no-GPU exit."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from echo_plan.calibrate.kernels import distinct_ops, measure_ops
from echo_plan.calibrate.op_args import CannotRun, _reduced_dims, build_call, outputs_match
from echo_plan.commands.calibrate_kernels import parse_int_list, register_kernels
from echo_plan.cost.compute import AnalyticalComputeModel
from echo_plan.cost.kernel_db import DatabaseComputeModel, KernelDatabase
from echo_plan.errors import SpecError
from echo_plan.specs import DType, ModelSpec, Recompute, load_cluster
from echo_plan.trace.records import OpKind, OpRecord, Phase, StageKind, Stream, TensorMeta
from echo_plan.trace.tracer import trace_stage

TINY = {"name": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
        "vocab_size": 128, "seq_length": 32, "activation": "swiglu", "norm": "rmsnorm",
        "position_embedding": "rotary", "tied_embeddings": False}


def _app() -> typer.Typer:
    app = typer.Typer()
    cal = typer.Typer()
    register_kernels(cal)
    app.add_typer(cal, name="calibrate")

    @app.callback()
    def _root() -> None:
        pass

    return app


def _tiny_ops(spec: ModelSpec, tp: int) -> list[OpRecord]:
    ops = []
    for stage in StageKind:
        ops += trace_stage(spec, stage, tp=tp, sequence_parallel=tp > 1, micro_batch_size=1,
                           dtype=DType.BF16, recompute=Recompute.SELECTIVE).ops
    return ops


def test_cli_measures_tiny_model_on_cpu_and_the_database_covers_it(tmp_path):
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(json.dumps(TINY))
    out = tmp_path / "kernels" / "cpu.json"
    result = CliRunner().invoke(_app(), [
        "calibrate", "kernels", "--model", str(model_file), "--tp", "1,2", "--sequence-parallel",
        "--recompute", "selective", "--device", "cpu", "--warmup", "1", "--iters", "3", "-o", str(out), "--json",
    ])
    assert result.exit_code == 0, result.output
    db = KernelDatabase.load(out)
    assert db.provenance["torch"] and db.provenance["device"] == "cpu" and db.provenance["tp"] == [1, 2]
    spec = ModelSpec.build(TINY)
    ops = _tiny_ops(spec, 2) + _tiny_ops(spec, 1)
    model = DatabaseComputeModel(db, AnalyticalComputeModel())
    # the tracer's fused kernels (echo_plan.*) have only CPU references: never timed, always modelled
    plain = [op for op in ops if not op.name.startswith("echo_plan.")]
    cov = model.coverage(plain, load_cluster("h800").gpu, DType.BF16)
    assert cov.ops_measured > 0
    assert cov.op_share >= 0.95, cov.missing
    assert all(name.startswith("echo_plan.") for name in model.coverage(ops, load_cluster("h800").gpu, DType.BF16).missing)
    assert all(e.median_us > 0 and e.p10_us <= e.median_us <= e.p90_us for e in db.entries.values())


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_gpu_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu.json"
    result = CliRunner().invoke(_app(), ["calibrate", "kernels", "--model", "gpt-13b", "--device", "cuda", "-o", str(out)])
    assert result.exit_code == 0
    assert "no CUDA GPU" in result.output
    assert not out.exists()


def test_distinct_ops_drop_views_and_duplicates():
    spec = ModelSpec.build(TINY)
    ops = _tiny_ops(spec, 2)
    distinct = distinct_ops(ops + ops)
    assert all(op.kind not in (OpKind.VIEW, OpKind.COLLECTIVE) for op in distinct)
    assert len(distinct) == len(distinct_ops(ops)) < len(ops)


def test_rebuilt_calls_reproduce_recorded_outputs():
    spec = ModelSpec.build(TINY)
    for op in distinct_ops(_tiny_ops(spec, 2)):
        if op.name.startswith("echo_plan.") and op.kind is not OpKind.ATTENTION:
            with pytest.raises(CannotRun, match="fused kernel"):
                build_call(op, "cpu")
            continue
        assert outputs_match(build_call(op, "cpu")(), op), op.name


def test_an_op_that_cannot_be_rebuilt_is_skipped_with_a_reason():
    bogus = OpRecord(0, "aten.no_such_op.default", OpKind.ELEMENTWISE, Phase.FORWARD, Stream.COMPUTE,
                     (TensorMeta((4,), "float32"),), (TensorMeta((4,), "float32"),), 0.0, 16, 16, ())
    wrong = OpRecord(0, "aten.mm.default", OpKind.GEMM, Phase.FORWARD, Stream.COMPUTE,
                     (TensorMeta((4, 8), "float32"), TensorMeta((8, 2), "float32")),
                     (TensorMeta((4, 3), "float32"),), 128.0, 0, 0, ())
    run = measure_ops([bogus, wrong], "cpu", warmup=0, iters=1)
    assert run.measured == () and len(run.skipped) == 2
    assert "no operator" in run.skipped[0].reason and "output shapes" in run.skipped[1].reason


def test_reduced_dims():
    assert _reduced_dims((8, 4, 16), (8, 4, 1)) == ([2], True)
    assert _reduced_dims((8, 4, 16), (8, 4)) == ([2], False)
    assert _reduced_dims((8, 4, 16), (4, 16)) == ([0], False)
    with pytest.raises(CannotRun):
        _reduced_dims((8, 4), (3,))


def test_int_lists_validated():
    assert parse_int_list("8,1, 2", "--tp") == [1, 2, 8]
    for bad in ("", "0", "a,b"):
        with pytest.raises(SpecError):
            parse_int_list(bad, "--tp")


TINY_MOE = dict(TINY, name="tiny-moe", num_layers=4, sliding_window=16, sliding_window_pattern=2, seq_length=64,
                moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 32, "first_dense_layers": 1})


def test_an_moe_model_is_measured_layer_kind_by_kind_and_expert_layout_by_layout(tmp_path):
    from echo_plan.specs.moe import ExpertLayout

    model_file = tmp_path / "tiny-moe.yaml"
    model_file.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "cpu.json"
    result = CliRunner().invoke(_app(), [
        "calibrate", "kernels", "--model", str(model_file), "--tp", "1", "--ep", "1,2", "--device", "cpu",
        "--warmup", "0", "--iters", "1", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    db = KernelDatabase.load(out)
    assert db.provenance["ep"] == [1, 2] and db.provenance["etp"] == "tp"
    spec = ModelSpec.build(TINY_MOE)
    model = DatabaseComputeModel(db, AnalyticalComputeModel())
    gpu = load_cluster("h800").gpu
    for kind in spec.distinct_kinds():
        for layout in ([ExpertLayout(1, 1), ExpertLayout(2, 1)] if kind.moe else [None]):
            ops = trace_stage(spec, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                              dtype=DType.BF16, recompute=Recompute.NONE, kind=kind, layout=layout).ops
            experts = [op for op in ops if op.name == "aten.bmm.default"]
            assert bool(experts) == kind.moe
            assert all(db.lookup(op) is not None for op in experts)  # every layout's grouped expert GEMMs
            attention = [op for op in ops if op.kind is OpKind.ATTENTION]
            # full attention is measured; windowed attention never is (SDPA has no window): modelled
            assert all((db.lookup(op) is None) == bool(kind.window) for op in attention)
            plain = [op for op in ops if not op.name.startswith("echo_plan.")]
            assert model.coverage(plain, gpu, DType.BF16).op_share >= 0.95
    skipped = json.loads(result.stdout)["skipped"]
    assert any("sliding-window" in s["reason"] for s in skipped)


@pytest.mark.parametrize("args, message", [
    (["--ep", "3"], "--ep=3 is invalid: must divide num_experts 8"),
    (["--etp", "5"], "--etp=5 is invalid: must divide expert_ffn_hidden_size 32"),
    (["--ep", "0"], "--ep='0' is invalid"),
])
def test_bad_expert_layouts_are_one_line_errors_before_anything_is_traced(tmp_path, args, message):
    model_file = tmp_path / "tiny-moe.yaml"
    model_file.write_text(json.dumps(TINY_MOE))
    out = tmp_path / "cpu.json"
    result = CliRunner().invoke(_app(), ["calibrate", "kernels", "--model", str(model_file), "--device", "cpu",
                                         "-o", str(out), *args])
    assert result.exit_code != 0 and isinstance(result.exception, SpecError)
    assert message in str(result.exception) and "tracing" not in result.output
    assert not out.exists()


def test_expert_layouts_on_a_dense_model_say_it_is_dense(tmp_path):
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(json.dumps(TINY))
    result = CliRunner().invoke(_app(), ["calibrate", "kernels", "--model", str(model_file), "--device", "cpu",
                                         "--ep", "2", "-o", str(tmp_path / "x.json")])
    assert isinstance(result.exception, SpecError) and "tiny is dense" in str(result.exception)


def _record(name: str, kind: OpKind, inputs: list, outputs: list, flops: float = 0.0) -> OpRecord:
    metas = lambda items: tuple(TensorMeta(tuple(s), d) for s, d in items)  # noqa: E731
    return OpRecord(0, name, kind, Phase.FORWARD, Stream.COMPUTE, metas(inputs), metas(outputs), flops, 0, 0, ())


def test_unmasked_attention_is_timed_unmasked_and_causal_attention_causal(monkeypatch):
    """A CP rank's unmasked launch (fewer queries than keys) must not run SDPA's top-left causal mask,
    which skips most of its work (an H100 timed such launches 1.8-3.9x faster than unmasked)."""
    import torch.nn.functional as F

    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: seen.append(k["is_causal"]) or real(*a, **k))
    q, kv = ((1, 4, 8, 16), "bfloat16"), ((1, 4, 16, 16), "bfloat16")
    for name, expect in [("echo_plan.flash_attention_noncausal.default", False),
                         ("echo_plan.flash_attention.default", True)]:
        seen.clear()
        build_call(_record(name, OpKind.ATTENTION, [q, kv, kv], [q], flops=1e12), "cpu")()  # not windowed
        assert seen and set(seen) == {expect}, name


def test_embedding_backward_spreads_its_token_ids_over_the_table():
    """All-zero ids would send every token's gradient to one row (an H100 timed that 1.2-1.4x slower)."""
    op = _record("aten.embedding_dense_backward.default", OpKind.EMBEDDING,
                 [((64, 8), "float32"), ((64,), "int64")], [((50, 8), "float32")])
    grad = build_call(op, "cpu")()
    rows_touched = int((grad.abs().sum(dim=1) > 0).sum())
    assert 20 < rows_touched <= 50


def test_cli_measures_the_traces_of_a_cache_folder_and_names_what_it_cannot_read(tmp_path, monkeypatch):
    cache = tmp_path / "traces"
    monkeypatch.setenv("ECHO_PLAN_CACHE_DIR", str(cache))
    from echo_plan.trace.cache import TraceCache

    spec = ModelSpec.build(TINY)
    store = TraceCache(cache)
    for stage in StageKind:
        trace_stage(spec, stage, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16,
                    recompute=Recompute.NONE, cache=store)
    (cache / "block-broken.json").write_text("not a trace\n{}")
    out = tmp_path / "db.json"
    result = CliRunner().invoke(_app(), ["calibrate", "kernels", "--traces", str(cache), "--device", "cpu",
                                         "--warmup", "1", "--iters", "2", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert "not read: block-broken.json" in result.output
    db = KernelDatabase.load(out)
    assert db.provenance["trace_files"] == 3 and db.provenance["seq_length"] == [32]
    assert len(db) > 10
    missing = CliRunner().invoke(_app(), ["calibrate", "kernels", "--traces", str(tmp_path / "nowhere"),
                                          "--device", "cpu", "-o", str(tmp_path / "x.json")])
    assert missing.exit_code != 0 and not (tmp_path / "x.json").exists()


def _measure_tiny(tmp_path, backend: str):
    model_file = tmp_path / "tiny.yaml"
    model_file.write_text(json.dumps(TINY))
    out = tmp_path / f"{backend}.json"
    result = CliRunner().invoke(_app(), ["calibrate", "kernels", "--model", str(model_file), "--tp", "1",
                                         "--device", "cpu", "--warmup", "0", "--iters", "1", "--sdpa-backend", backend,
                                         "-o", str(out), "--json"])
    return result, out


def test_a_named_sdpa_backend_times_the_attention_and_the_database_says_whose(tmp_path):
    """Whose attention kernels a database timed is part of it: PyTorch-native stacks ran FlashAttention-2, TE cuDNN's."""
    result, out = _measure_tiny(tmp_path, "math")
    assert result.exit_code == 0, result.output
    db = KernelDatabase.load(out)
    assert db.provenance["sdpa_backend"] == "math"
    assert any(key[0].startswith("echo_plan.flash_attention") for key in db.entries)


def test_attention_a_named_backend_cannot_run_is_skipped_with_that_reason(tmp_path):
    result, out = _measure_tiny(tmp_path, "cudnn")  # no cuDNN attention on a CPU
    assert result.exit_code == 0, result.output
    skipped = json.loads(result.stdout)["skipped"]
    attention = [s for s in skipped if s["op"].startswith("echo_plan.flash_attention")]
    assert attention and all("SDPA backend cudnn cannot run it on cpu" in s["reason"] for s in attention)
    db = KernelDatabase.load(out)
    assert db.provenance["sdpa_backend"] == "cudnn"
    assert not any(key[0].startswith("echo_plan.flash_attention") for key in db.entries)


def test_an_unknown_sdpa_backend_is_a_one_line_error_and_writes_nothing(tmp_path):
    result, out = _measure_tiny(tmp_path, "fa4")
    assert result.exit_code != 0 and not out.exists() and isinstance(result.exception, SpecError)
    assert "--sdpa-backend='fa4' is invalid" in str(result.exception) and "flash" in str(result.exception)
