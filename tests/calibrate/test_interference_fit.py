"""Interference calibration: the CSV format, the robust fit, the measurement protocol and the CLI."""

from __future__ import annotations

from importlib import resources

import pytest
import typer
from typer.testing import CliRunner

from echo_plan.calibrate.interference_fit import Slowed, fit_interference, parse_measurements, read_measurements
from echo_plan.calibrate.interference_cuda import measure_to_csv
from echo_plan.calibrate.interference_measure import (
    Kernel, MeasureConfig, rows_to_csv, run_protocol,
)
from echo_plan.commands.calibrate_interference import register_interference
from echo_plan.errors import FileFormatError
from echo_plan.replay.interference import load_interference
from echo_plan.replay.kinds import TaskKind

G, A, M, AR, AG = TaskKind.GEMM, TaskKind.ATTENTION, TaskKind.MEMORY, TaskKind.ALL_REDUCE, TaskKind.ALL_GATHER
HEADER = "compute_kind,comm_kind,isolated_us,overlapped_us,slowed,source\n"


def example_path():
    return resources.files("echo_plan.data").joinpath("interference_measurements.example.csv")


def test_example_file_fits_to_the_median():
    ms = read_measurements(str(example_path()))
    fit = fit_interference(ms, "example.csv")
    pairs = {(p.slowed, p.compute_kind, p.comm_kind): p for p in fit.pairs}
    ar = pairs[(Slowed.COMPUTE, G, AR)]
    assert ar.count == 2 and ar.factor == pytest.approx((1.189 + 1.40) / 2)  # median of two: their mean
    assert ar.min_ratio == pytest.approx(1.189) and ar.max_ratio == pytest.approx(1.40)
    assert pairs[(Slowed.COMPUTE, G, AG)].factor == pytest.approx(1.702)
    assert any("arXiv:2507.03114" in s for s in ar.sources)


def test_median_is_robust_and_floored():
    text = HEADER + "".join(f"memory,all_reduce,100,{v},comm,x\n" for v in (120, 121, 119, 500)) + \
        "gemm,p2p,100,97,,noise\n"
    fit = fit_interference(parse_measurements(text))
    pairs = {(p.slowed, p.compute_kind, p.comm_kind): p for p in fit.pairs}
    assert pairs[(Slowed.COMM, M, AR)].factor == pytest.approx(1.205)  # the outlier does not move it far
    p2p = pairs[(Slowed.COMPUTE, G, TaskKind.P2P)]  # empty 'slowed' = compute
    assert p2p.factor == 1.0 and p2p.median_ratio == pytest.approx(0.97)


def test_fitted_yaml_loads_over_defaults(tmp_path):
    text = HEADER + "gemm,all_reduce,100,150,compute,a\nmemory,all_gather,100,130,comm,b\n"
    fit = fit_interference(parse_measurements(text), "m.csv")
    out = tmp_path / "fitted.yaml"
    out.write_text(fit.to_yaml())
    base, m = load_interference(None), load_interference(str(out))
    assert m.compute_slowdown[(G, AR)] == pytest.approx(1.5)
    assert m.comm_slowdown[(AG, M)] == pytest.approx(1.3)
    assert m.compute_slowdown[(M, AR)] == base.compute_slowdown[(M, AR)]  # unmeasured: default kept
    assert m.share_compute == base.share_compute
    assert any("median of 1 ratios" in p for p in m.provenance)


@pytest.mark.parametrize("text, line, words", [
    ("", None, "no header"),
    ("compute_kind,comm_kind,isolated_us\n", 1, "missing column"),
    (HEADER.replace("source", "where"), 1, "unknown column"),
    (HEADER + "matmul,all_reduce,1,2,compute,x\n", 2, "compute_kind"),
    (HEADER + "gemm,allreduce,1,2,compute,x\n", 2, "comm_kind"),
    (HEADER + "gemm,all_reduce,0,2,compute,x\n", 2, "isolated_us"),
    (HEADER + "gemm,all_reduce,1,fast,compute,x\n", 2, "overlapped_us"),
    (HEADER + "# comment\ngemm,all_reduce,1,2,both,x\n", 3, "slowed"),
    (HEADER + "gemm,all_reduce,1,2,compute,x,extra\n", 2, "values"),
    (HEADER, None, "no measurement rows"),
])
def test_malformed_csv(text, line, words):
    with pytest.raises(FileFormatError) as info:
        parse_measurements(text, "m.csv")
    assert words in str(info.value) and info.value.line == line


class FakeBackend:
    """Deterministic timings: compute kernels slow by 1.2 beside a collective, collectives by 1.5."""

    device = "fake GPU"

    def compute_kernels(self):
        return [Kernel(G, "gemm", lambda s: None), Kernel(M, "add", lambda s: None)]

    def comm_kernels(self):
        return [Kernel(AR, "ar", lambda s: None)]

    def alone(self, k, iters):
        return {"gemm": 1000.0, "add": 300.0, "ar": 400.0}[k.label]

    def beside(self, k, other, iters, k_us, other_us):
        return k_us * (1.5 if k.kind.is_comm else 1.2)


def test_protocol_rows_round_trip_through_the_fit():
    rows = run_protocol(FakeBackend(), iters=5)
    assert len(rows) == 4  # (gemm, add) x (ar) x (compute slowed, comm slowed)
    fit = fit_interference(parse_measurements(rows_to_csv(rows, "fake\nsecond line")))
    model = fit.model()
    assert model.compute_factor(G, [AR]) == pytest.approx(1.2)
    assert model.comm_factor(AR, [M]) == pytest.approx(1.5)
    assert all("fake GPU" in r.source for r in rows)


def test_measure_without_cuda_keeps_defaults(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "m.csv"
    outcome = measure_to_csv(out, MeasureConfig())
    assert not outcome.measured and not out.exists()
    assert "default" in outcome.message and "arXiv" in outcome.message


def cli():
    app = typer.Typer()
    calibrate = typer.Typer()
    register_interference(calibrate)
    app.add_typer(calibrate, name="calibrate")
    return app


def test_cli_fit_and_measure(tmp_path):
    runner = CliRunner()
    out = tmp_path / "f.yaml"
    r = runner.invoke(cli(), ["calibrate", "interference", "fit", str(example_path()), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "gemm" in r.output and out.exists()
    assert load_interference(str(out)).compute_slowdown[(G, AG)] == pytest.approx(1.702)
    r = runner.invoke(cli(), ["calibrate", "interference", "fit", str(example_path()), "-o", str(out), "--json"])
    assert r.exit_code == 0 and '"factor"' in r.output
    for flag in ("--output", "--out"):  # the name every command uses, and the older one
        named = tmp_path / f"{flag.strip('-')}.yaml"
        r = runner.invoke(cli(), ["calibrate", "interference", "fit", str(example_path()), flag, str(named)])
        assert r.exit_code == 0 and named.exists(), r.output
    import torch

    if not torch.cuda.is_available():
        r = runner.invoke(cli(), ["calibrate", "interference", "measure", "-o", str(tmp_path / "m.csv")])
        assert r.exit_code == 0 and "no CUDA" in r.output


def test_a_fit_on_one_gpus_stand_ins_says_they_are_upper_bounds(tmp_path):
    """The H100's stand-in measurements (data/measured/h100_sxm5): the fit writes them, and says plainly they are
    not NCCL's; a file of real collectives gets no such note."""
    measured = resources.files("echo_plan.data").joinpath("measured/h100_sxm5/interference_standin.csv")
    r = CliRunner().invoke(cli(), ["calibrate", "interference", "fit", str(measured), "-o", str(tmp_path / "s.yaml")])
    assert r.exit_code == 0, r.output
    assert "12 of the 12 pairs come from stand-ins" in r.output and "--mode nccl" in r.output
    assert load_interference(str(tmp_path / "s.yaml")).compute_slowdown[(G, AG)] == pytest.approx(1.097, abs=0.001)
    r = CliRunner().invoke(cli(), ["calibrate", "interference", "fit", str(example_path()), "-o", str(tmp_path / "e.yaml")])
    assert r.exit_code == 0 and "stand-ins" not in r.output
