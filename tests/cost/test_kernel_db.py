"""The measured kernel database: file format, GPU matching, fallback and coverage."""

from __future__ import annotations

import json

import pytest

from echo_plan.cost.compute import AnalyticalComputeModel
from echo_plan.cost.kernel_db import (
    FORMAT,
    DatabaseComputeModel,
    GPUIdentity,
    KernelDatabase,
    compute_model_for,
    gpu_family,
    gpu_matches,
    kernel_key,
)
from echo_plan.errors import FileFormatError
from echo_plan.specs import DType, load_cluster
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta

H800 = load_cluster("h800")
A100 = load_cluster("dgx-a100")


def _op(name, kind, shapes, out):
    ins = tuple(TensorMeta(s, "bfloat16") for s in shapes)
    return OpRecord(0, name, kind, Phase.FORWARD, Stream.COMPUTE, ins, (TensorMeta(out, "bfloat16"),),
                    2.0 * shapes[0][0] * shapes[0][1] * shapes[1][1] if kind is OpKind.GEMM else 0.0,
                    1000, 1000, ())


MM = _op("aten.mm.default", OpKind.GEMM, [(256, 512), (512, 1024)], (256, 1024))
MM_OTHER = _op("aten.mm.default", OpKind.GEMM, [(256, 512), (512, 2048)], (256, 2048))
VIEW = _op("aten.view.default", OpKind.VIEW, [(256, 1024)], (1024, 256))


def _db_json(gpu="NVIDIA H100 80GB HBM3", sm=132, arch=90, mem=79.1, median=123.0):
    return {
        "format": FORMAT,
        "gpu": {"name": gpu, "sm_count": sm, "sm_arch": arch, "memory_GiB": mem},
        "provenance": {"driver": "550.54", "cuda": "12.4", "torch": "2.13.0", "date": "2025-01-01", "host": "h"},
        "entries": [{"op": "aten.mm.default", "inputs": [[[256, 512], "bfloat16"], [[512, 1024], "bfloat16"]],
                     "outputs": [[[256, 1024], "bfloat16"]], "median_us": median, "count": 20,
                     "p10_us": median * 0.9, "p90_us": median * 1.1}],
        "skipped": [],
    }


def test_roundtrip_and_lookup(tmp_path):
    path = tmp_path / "H100.json"
    path.write_text(json.dumps(_db_json()))
    db = KernelDatabase.load(path)
    assert len(db) == 1 and db.lookup(MM).median_us == 123.0 and db.lookup(MM_OTHER) is None
    again = KernelDatabase.from_json(json.loads(json.dumps(db.to_json())))
    assert again.entries == db.entries and again.gpu == db.gpu


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("gpu"),
    lambda d: d.update(format="something-else"),
    lambda d: d["entries"][0].pop("median_us"),
    lambda d: d["entries"][0].update(median_us="fast"),
    lambda d: d["entries"][0].update(count=0),
    lambda d: d["entries"][0].update(inputs=[[1, 2, 3]]),
])
def test_corrupt_database_raises_file_format_error(tmp_path, mutate):
    data = _db_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FileFormatError):
        KernelDatabase.load(path)


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n "format": \n}')
    with pytest.raises(FileFormatError) as err:
        KernelDatabase.load(path)
    assert err.value.line == 3


def test_gpu_matching_h100_serves_h800_not_a100():
    assert gpu_family("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_family("H800-SXM5-80GB") == "H800"
    h100 = GPUIdentity("NVIDIA H100 80GB HBM3", 132, 90, 79.1)
    assert gpu_matches(h100, H800.gpu)
    assert gpu_matches(h100, load_cluster("dgx-h100").gpu)
    assert not gpu_matches(h100, A100.gpu)
    assert not gpu_matches(GPUIdentity("NVIDIA H100 PCIe", 114, 90, 79.1), H800.gpu)
    assert not gpu_matches(GPUIdentity("NVIDIA A100-SXM4-40GB", 108, 80, 39.4), A100.gpu)
    assert gpu_matches(GPUIdentity("NVIDIA A100-SXM4-80GB", 108, 80, 79.2), A100.gpu)


def test_database_model_uses_measurement_then_fallback_and_counts():
    db = KernelDatabase.from_json(_db_json())
    fallback = AnalyticalComputeModel()
    model = DatabaseComputeModel(db, fallback)
    gpu = H800.gpu
    assert model.op_time(MM, gpu, DType.BF16) == pytest.approx(123e-6)
    assert model.op_time(MM_OTHER, gpu, DType.BF16) == fallback.op_time(MM_OTHER, gpu, DType.BF16)
    assert model.op_time(VIEW, gpu, DType.BF16) == 0.0
    usage = model.usage()
    assert (usage.ops_measured, usage.ops_modelled) == (1, 1)
    assert usage.missing == ("aten.mm.default",)
    cov = model.coverage([MM, MM, MM_OTHER, VIEW], gpu, DType.BF16)
    assert cov.op_share == pytest.approx(2 / 3)
    assert 0 < cov.time_share < 1
    assert model.usage() == usage  # coverage() does not touch the running tally


def test_compute_model_for_picks_matching_database(tmp_path):
    (tmp_path / "H100.json").write_text(json.dumps(_db_json()))
    chosen = compute_model_for(H800, tmp_path)
    assert isinstance(chosen, DatabaseComputeModel)
    assert chosen.op_time(MM, H800.gpu, DType.BF16) == pytest.approx(123e-6)
    assert isinstance(compute_model_for(A100, tmp_path), AnalyticalComputeModel)
    assert isinstance(compute_model_for(H800, tmp_path / "absent"), AnalyticalComputeModel)


def test_compute_model_for_prefers_own_family(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_db_json(median=1.0)))
    (tmp_path / "b.json").write_text(json.dumps(_db_json(gpu="NVIDIA H800", median=2.0)))
    chosen = compute_model_for(H800, tmp_path)
    assert chosen.op_time(MM, H800.gpu, DType.BF16) == pytest.approx(2e-6)


def test_key_includes_outputs():
    other_out = _op("aten.mm.default", OpKind.GEMM, [(256, 512), (512, 1024)], (1024, 256))
    assert kernel_key(other_out) != kernel_key(MM)


def _attention_ops(window: int):
    """The fused-attention ops (forward, backward) of a tiny model's block with or without a window."""
    from echo_plan.specs import ModelSpec
    from echo_plan.specs.moe import LayerKind
    from echo_plan.trace.tracer import StageKind, trace_stage

    spec = ModelSpec.build(dict(name="tiny-window", num_layers=2, hidden_size=64, num_attention_heads=4,
                                num_kv_heads=2, vocab_size=128, seq_length=64, activation="swiglu", norm="rmsnorm",
                                position_embedding="rotary", sliding_window=16, sliding_window_pattern=2))
    kind = LayerKind(window=window) if window else LayerKind()
    trace = trace_stage(spec, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                        recompute="none", kind=kind)
    ops = [op for op in trace.ops if op.kind is OpKind.ATTENTION]
    assert len(ops) == 2
    return ops


def test_a_windowed_attention_launch_is_never_answered_from_the_full_launchs_entry():
    from echo_plan.trace.kernels import windowed_attention

    full, windowed = _attention_ops(0), _attention_ops(16)
    assert not any(windowed_attention(op) for op in full) and all(windowed_attention(op) for op in windowed)
    # same shapes, so the same key: a database measured on the full layer would answer the windowed one
    assert [kernel_key(op) for op in full] == [kernel_key(op) for op in windowed]
    data = _db_json()
    data["entries"] = [{"op": op.name, "inputs": [[list(t.shape), t.dtype] for t in op.inputs],
                        "outputs": [[list(t.shape), t.dtype] for t in op.outputs], "median_us": 999.0, "count": 5,
                        "p10_us": 990.0, "p90_us": 1010.0} for op in full]
    db = KernelDatabase.from_json(data)
    fallback = AnalyticalComputeModel()
    model = DatabaseComputeModel(db, fallback)
    for f, w in zip(full, windowed):
        assert db.lookup(f) is not None and db.lookup(w) is None
        assert model.op_time(f, H800.gpu, DType.BF16) == pytest.approx(999e-6)
        assert model.op_time(w, H800.gpu, DType.BF16) == fallback.op_time(w, H800.gpu, DType.BF16) < 999e-6
