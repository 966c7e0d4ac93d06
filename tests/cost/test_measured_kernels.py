"""The compute model against kernels measured on an H100 SXM5 (``data/measured/h100_sxm5``).

The database was measured by ``echo-plan calibrate kernels --traces`` on a lent H100 (2026-11-27), from
the traces of the H100 validate suites. Each GEMM is rebuilt here from its key (shapes and dtypes) and
timed by the calibrated analytical model of the H800 preset (the H100 die; the database serves it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import echo_plan
from echo_plan.cost.kernel_db import KernelDatabase, compute_model_for, find_database
from echo_plan.specs import DType, load_cluster
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta

MEASURED = Path(echo_plan.__file__).parent / "data" / "measured" / "h100_sxm5" / "H100-80GB-HBM3.json"
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _gemm(key, bf16_only: bool) -> OpRecord | None:
    name, inputs, outputs = key
    if name not in ("aten.mm.default", "aten._scaled_mm.default") or (bf16_only and name != "aten.mm.default"):
        return None
    (a_shape, a_dt), (b_shape, b_dt) = inputs[:2]
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != b_shape[0]:
        return None
    m, k, n = a_shape[0], a_shape[1], b_shape[1]
    metas = lambda items: tuple(TensorMeta(tuple(s), d) for s, d in items)  # noqa: E731
    read = sum(_numel(s) * _BYTES.get(d, 4) for s, d in inputs)
    written = sum(_numel(s) * _BYTES.get(d, 4) for s, d in outputs)
    return OpRecord(index=0, name=name, kind=OpKind.GEMM, phase=Phase.FORWARD, stream=Stream.COMPUTE,
                    inputs=metas(inputs), outputs=metas(outputs), flops=2.0 * m * n * k, bytes_read=read,
                    bytes_written=written, deps=())


@pytest.fixture(scope="module")
def measured():
    return KernelDatabase.load(MEASURED)


def _pairs(db, tmp_path_factory, bf16_only: bool, min_us: float = 200.0):
    cluster = load_cluster("h800")
    model = compute_model_for(cluster, tmp_path_factory.mktemp("no-kernels"))  # the analytical model alone
    out = []
    for key, entry in db.entries.items():
        op = _gemm(key, bf16_only)
        if op is None or entry.median_us < min_us or entry.p90_us > 1.25 * entry.p10_us:
            continue  # small, or a noisy measurement (its 10th and 90th percentiles over 25% apart)
        dtype = DType.FP8 if "_scaled_mm" in op.name else DType.BF16
        out.append((model.op_time(op, cluster.gpu, dtype) * 1e6, entry.median_us))
    return out


def test_the_measured_database_serves_the_h800_preset(measured, tmp_path):
    """Copied into a kernels folder, it answers for the H800 preset (the H100 die), not for Blackwell."""
    assert len(measured) > 1000
    (tmp_path / MEASURED.name).write_bytes(MEASURED.read_bytes())
    assert find_database(load_cluster("h800").gpu, tmp_path) is not None
    assert find_database(load_cluster("dgx-h100").gpu, tmp_path) is not None
    assert find_database(load_cluster("gb200-nvl72").gpu, tmp_path) is None


@pytest.mark.parametrize("bf16_only", [True, False], ids=["bf16", "bf16+fp8"])
def test_no_large_gemm_is_timed_much_faster_than_it_ran_alone(measured, tmp_path_factory, bf16_only):
    """A GEMM inside a training step runs no faster than on an idle GPU at full clocks: the calibrated
    model may be slower than the isolated kernel (it carries what whole steps measured), never much faster."""
    pairs = _pairs(measured, tmp_path_factory, bf16_only)
    assert len(pairs) > (200 if bf16_only else 250)
    ratios = sorted(p / m for p, m in pairs)
    assert ratios[0] > 0.85, ratios[:5]
    weighted = sum(p for p, _ in pairs) / sum(m for _, m in pairs)
    assert 0.97 < weighted < 1.3, weighted


def test_a_kernels_folder_named_by_the_environment_serves_simulate_and_names_the_study(tmp_path, monkeypatch, capsys):
    """ECHO_PLAN_KERNELS_DIR: the databases of an installed package's user; a search study's name includes the
    serving database, so adding one starts a new study instead of reading times computed without it."""
    import json as _json

    from echo_plan.cli import main
    from echo_plan.cost.kernel_db import DatabaseComputeModel, database_digest

    h800 = load_cluster("h800")
    args = ["simulate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--json"]
    monkeypatch.delenv("ECHO_PLAN_KERNELS_DIR", raising=False)
    assert main(args) == 0
    plain = _json.loads(capsys.readouterr().out)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("ECHO_PLAN_KERNELS_DIR", str(empty))
    assert database_digest(h800.gpu) == ""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / MEASURED.name).write_bytes(MEASURED.read_bytes())
    monkeypatch.setenv("ECHO_PLAN_KERNELS_DIR", str(tmp_path / "kernels"))
    assert isinstance(compute_model_for(h800), DatabaseComputeModel)
    assert len(database_digest(h800.gpu)) == 16
    assert main(args) == 0
    measured = _json.loads(capsys.readouterr().out)
    assert measured["step_time_s"] != plain["step_time_s"]
    said = [n for n in measured["notes"] if n.startswith("compute: ")]
    assert len(said) == 1 and "H100-80GB-HBM3.json" in said[0] and "%" in said[0]
    assert not [n for n in plain["notes"] if n.startswith("compute: ")]
    monkeypatch.setenv("ECHO_PLAN_KERNELS_DIR", str(MEASURED))  # a file, not a folder
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "ECHO_PLAN_KERNELS_DIR" in err and "\n" not in err
