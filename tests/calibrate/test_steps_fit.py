"""Calibrating compute figures to step times: recovery from synthetic measurements, priors, the CLI."""

from __future__ import annotations

import json

import pytest
import yaml

from echo_plan.calibrate.steps_fit import fit_compute
from echo_plan.cli import main
from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.errors import EchoPlanError


def test_recovers_known_figures_from_a_closed_form_model():
    # step = gemm seconds / scale + memory seconds / scale + kernels x overhead, per row
    rows = [(5.0, 5.0, 20000), (2.0, 6.0, 80000), (8.0, 1.0, 5000), (1.0, 3.0, 120000), (4.0, 2.0, 30000),
            (6.0, 6.0, 60000)]
    truth = ComputeCalibration(gemm_efficiency_scale=0.8, memory_bandwidth_scale=0.9, kernel_overhead_us=5.0)

    def predict(cal):
        v = cal.values()
        return [g / v["gemm_efficiency_scale"] + m / v["memory_bandwidth_scale"] + n * v.get("kernel_overhead_us", 3) * 1e-6
                for g, m, n in rows]

    measured = predict(truth)
    fit = fit_compute(predict, measured, [str(i) for i in range(len(rows))],
                      fit=("gemm_efficiency_scale", "memory_bandwidth_scale", "kernel_overhead_us"))
    got = fit.calibration.values()
    assert got["gemm_efficiency_scale"] == pytest.approx(0.8, rel=0.01)
    assert got["memory_bandwidth_scale"] == pytest.approx(0.9, rel=0.03)
    assert got["kernel_overhead_us"] == pytest.approx(5.0, rel=0.3)  # the prior (3 us) pulls a little
    assert max(abs(r) for r in fit.fit_residuals) < 0.02


def test_a_figure_the_rows_cannot_see_stays_at_its_prior():
    fit = fit_compute(lambda cal: [2.0 / cal.gemm_efficiency_scale], [2.5], ["only"],
                      fit=("gemm_efficiency_scale", "attention_efficiency_scale"))
    assert fit.calibration.attention_efficiency_scale == pytest.approx(1.0, abs=1e-6)
    assert not fit.determined("attention_efficiency_scale") and fit.determined("gemm_efficiency_scale")
    with pytest.raises(EchoPlanError, match="cannot fit"):
        fit_compute(lambda cal: [1.0], [1.0], ["x"], fit=("clock_speed",))


def test_a_fixed_figure_is_held_while_the_others_are_fitted():
    """Rows whose GEMMs ran in FP8 join a fit at the fp8 figure fitted elsewhere (``base``): it is neither moved
    nor reset to its prior, and the fitted figures are what the rows need at it."""
    # step = bf16 GEMM seconds / gemm scale + fp8 GEMM seconds / (gemm scale x fp8 scale) + attention / its scale
    rows = [(4.0, 0.0, 1.0), (0.0, 3.0, 4.0), (2.0, 2.0, 0.5), (1.0, 0.0, 6.0)]
    truth = ComputeCalibration(gemm_efficiency_scale=0.7, fp8_gemm_efficiency_scale=1.2,
                               attention_efficiency_scale=0.6)

    def predict(cal):
        return [b / cal.gemm_efficiency_scale + f / (cal.gemm_efficiency_scale * cal.fp8_gemm_efficiency_scale)
                + a / cal.attention_efficiency_scale for b, f, a in rows]

    fit = fit_compute(predict, predict(truth), [str(i) for i in range(len(rows))],
                      fit=("gemm_efficiency_scale", "attention_efficiency_scale"),
                      base=ComputeCalibration(fp8_gemm_efficiency_scale=1.2))
    assert fit.calibration.fp8_gemm_efficiency_scale == 1.2
    assert fit.calibration.gemm_efficiency_scale == pytest.approx(0.7, rel=0.02)
    assert fit.calibration.attention_efficiency_scale == pytest.approx(0.6, rel=0.03)
    assert fit.determined("attention_efficiency_scale")


def test_recovers_a_gemm_scale_through_the_real_simulator(tmp_path):
    """Step times simulated with a known calibration are fitted back from the uncalibrated preset."""
    from echo_plan.calibrate.steps import calibrate_rows
    from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
    from echo_plan.specs import load_cluster
    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.predict import RowSimulator
    from echo_plan.validation.rows import read_step_times

    csv = tmp_path / "runs.csv"
    head = ("model,num_layers,hidden_size,ffn_hidden_size,num_attention_heads,num_kv_heads,vocab_size,seq_length,"
            "activation,norm,position,tied_embeddings,gpus,tp,pp,vpp,mbs,gbs,precision,recompute,sequence_parallel,"
            "distributed_optimizer,step_time_s")
    shapes = [("a", 8, 2048, 8192, 16), ("b", 12, 3072, 8192, 24), ("c", 8, 4096, 11008, 32)]
    lines = [head] + [f"{n},{l},{h},{f},{a},{a},32000,2048,swiglu,rmsnorm,rope,false,16,2,2,1,1,32,bf16,none,true,true,1.0"
                      for n, l, h, f, a in shapes]
    csv.write_text("\n".join(lines) + "\n")
    rows = read_step_times(csv)
    cluster = load_cluster("dgx-h100").replace(calibration={})
    cache = TraceCache(tmp_path / "traces")
    truth = ComputeCalibration(gemm_efficiency_scale=0.75)
    sim = RowSimulator(cluster, "megatron-core", cache)
    compute = AnalyticalComputeModel(calibrated_constants(truth, load_compute_constants()))
    measured = [sim.predict(r, compute=compute).step_s for r in rows]
    rows = tuple(type(r)(r.label, m, r.unit, model=r.model, gpus=r.gpus, plan=r.plan) for r, m in zip(rows, measured))
    cal = calibrate_rows(rows, cluster, "megatron-core", set(), fit=("gemm_efficiency_scale",), cache=cache)
    assert cal.fit.calibration.gemm_efficiency_scale == pytest.approx(0.75, rel=0.02)


def test_cli_writes_a_cluster_that_loads_and_reports_held_out_rows(tmp_path, capsys):
    csv = tmp_path / "ours.csv"
    head = ("model,num_layers,hidden_size,ffn_hidden_size,num_attention_heads,num_kv_heads,vocab_size,seq_length,"
            "activation,norm,position,tied_embeddings,gpus,tp,pp,vpp,mbs,gbs,precision,recompute,sequence_parallel,"
            "distributed_optimizer,step_time_s")
    rows = [f"m{i},4,1024,4096,8,8,32000,1024,swiglu,rmsnorm,rope,false,{g},2,1,1,1,{4 * g},bf16,none,true,true,{t}"
            for i, (g, t) in enumerate([(8, 0.030), (16, 0.031), (32, 0.032), (8, 0.029), (16, 0.030), (32, 0.033)])]
    csv.write_text("# echo-plan: cluster=dgx-h100 stack=megatron-core\n" + "\n".join([head] + rows) + "\n")
    out = tmp_path / "mine.yaml"
    code = main(["calibrate", "steps", str(csv), "--cluster", "dgx-h100", "-o", str(out), "--json",
                 "--cache-dir", str(tmp_path / "c"), "--fit", "gemm_efficiency_scale"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert sum(r["held_out"] for r in summary["rows"]) == 2  # every third row
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["compute"]["fitted_on"]["ours"] and data["calibration"]["ranges"]["by_stack"]["megatron-core"]
    from echo_plan.specs import load_cluster

    assert data["calibration"].get("nccl") == load_cluster("dgx-h100").calibration.get("nccl")  # kept as it was
    assert main(["simulate", "-c", str(out), "--gpus", "16", "--tp", "2", "-m", "llama2-7b", "--json",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert "ours: 2 rows held out" in sim["range_basis"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["calibrate", "steps", str(tmp_path / "none.csv"), "-o", str(tmp_path / "x.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    csv = tmp_path / "x.csv"
    csv.write_text("model,gpus,tp,pp,mbs,gbs,step_time_s\n")
    assert main(["calibrate", "steps", str(csv), "-o", str(tmp_path / "x.yaml"), "--hold-out-every", "1"]) == 2
    assert "hold-out-every" in capsys.readouterr().err and not (tmp_path / "x.yaml").exists()
