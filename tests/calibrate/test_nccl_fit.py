"""The NCCL fit: recovers known parameters from logs the model made itself; CLI writes a usable
calibrated cluster; a corrupted log fails with a clear error."""

from __future__ import annotations

import json

import pytest
import yaml

from echo_plan.calibrate.nccl_fit import fit_nccl, measurement_outliers
from echo_plan.cli import main
from echo_plan.cost.collectives import NcclModel, collective_model_for
from echo_plan.cost.nccl_params import load_default_params
from echo_plan.interop.nccl_tests import parse_nccl_tests_text, render_nccl_tests
from echo_plan.specs import load_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

TRUE = {
    "base_latency_scale": [1.6, 1.5, 6.0],
    "nvlink_latency_scale": [2.5, 1.5, 1.2],
    "protocol_bw_scale": [0.7, 0.85, 1.0],
    "nvlink_bw_efficiency": 0.93,
}
SIZES = [1 << k for k in range(3, 31)]


def _synthetic_logs(params, ns=(2, 4, 8), jitter=0.0, spike_at=None):
    cluster = load_cluster("azure-nd-a100-v4")
    model = NcclModel(params)
    logs = []
    for n in ns:
        group = CommGroup(GroupKind.WORLD, n)
        rows = []
        for i, s in enumerate(SIZES):
            t = model.time(CollectiveKind.ALL_REDUCE, s, group, cluster).time_s * 1e6
            t *= 1 + jitter * (1 if i % 2 else -1)
            if spike_at is not None and s == spike_at:
                t *= 3.0  # a measurement glitch
            rows.append((s, t, t * (1 + jitter)))
        text = render_nccl_tests(CollectiveKind.ALL_REDUCE, ["node-a"] * n, rows)
        logs.append(parse_nccl_tests_text(text, source=f"all_reduce_perf_{n}gpu.log"))
    return cluster, logs


def test_fit_recovers_known_parameters():
    truth = load_default_params().with_calibration(TRUE)
    cluster, logs = _synthetic_logs(truth)
    fit = fit_nccl(logs, cluster)
    v = fit.values
    # bandwidth and the protocols' latencies that the data show are recovered closely
    assert v["nvlink_bw_efficiency"] == pytest.approx(TRUE["nvlink_bw_efficiency"], rel=0.02)
    for proto in (0, 1):
        assert v["base_latency_scale"][proto] == pytest.approx(TRUE["base_latency_scale"][proto], rel=0.05)
        assert v["nvlink_latency_scale"][proto] == pytest.approx(TRUE["nvlink_latency_scale"][proto], rel=0.05)
        assert v["protocol_bw_scale"][proto] == pytest.approx(TRUE["protocol_bw_scale"][proto], rel=0.05)
    # and every row is reproduced
    assert max(abs(r.error_pct) for r in fit.rows) < 1.0
    assert not any(n.startswith("net_") for n in fit.fitted)  # one server: the network is not fitted


def test_fit_skips_a_spike_and_extrapolates_across_gpu_counts():
    truth = load_default_params().with_calibration(TRUE)
    cluster, logs = _synthetic_logs(truth, jitter=0.02, spike_at=1 << 20)
    fit = fit_nccl(logs, cluster, fit_max_gpus=4)
    assert fit.holdout_logs == ("all_reduce_perf_8gpu.log",)
    spikes = [r for r in fit.rows if r.size_bytes == 1 << 20 and r.placement == "out-of-place"]
    assert all(r.outlier for r in spikes)
    held = [r for r in fit.rows if not r.in_fit and not r.outlier]
    assert max(abs(r.error_pct) for r in held) < 8.0


def test_measurement_outliers_flags_only_the_jump():
    times = [10.0 * 1.3**k for k in range(12)]
    times[6] *= 2.5
    flags = measurement_outliers(times)
    assert flags[6] and sum(flags) == 1


def test_cli_writes_calibrated_cluster(tmp_path, capsys):
    truth = load_default_params().with_calibration(TRUE)
    cluster, logs = _synthetic_logs(truth, ns=(2, 4))
    paths = []
    for n, log in zip((2, 4), logs):
        p = tmp_path / f"all_reduce_perf_{n}gpu.log"
        rows = [(r.size_bytes, r.time_us_oop, r.time_us_ip) for r in log.rows]
        p.write_text(render_nccl_tests(CollectiveKind.ALL_REDUCE, ["h"] * n, rows, mpi_tag=True))
        paths.append(str(p))
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", "nccl", *paths, "--cluster", "azure-nd-a100-v4", "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["calibration"]["provenance"]["fit_logs"]
    data = yaml.safe_load(out.read_text())
    assert data["calibration"]["nccl"]["params"]["nvlink_bw_efficiency"] == pytest.approx(0.93, rel=0.03)
    calibrated = load_cluster(str(out))
    t = collective_model_for(calibrated).time(CollectiveKind.ALL_REDUCE, 1 << 26, CommGroup(GroupKind.TP, 4), calibrated)
    assert t.time_s == pytest.approx(NcclModel(truth).time(CollectiveKind.ALL_REDUCE, 1 << 26,
                                                           CommGroup(GroupKind.TP, 4), cluster).time_s, rel=0.02)
    assert main(["comm", "-c", str(out), "--gpus", "4", "--size", "64MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibrated"] is True


def test_cli_corrupted_log_gives_clear_error(tmp_path, capsys):
    truth = load_default_params()
    _, logs = _synthetic_logs(truth, ns=(4,))
    rows = [(r.size_bytes, r.time_us_oop, r.time_us_ip) for r in logs[0].rows]
    text = render_nccl_tests(CollectiveKind.ALL_REDUCE, ["h"] * 4, rows)
    bad = tmp_path / "all_reduce_perf.log"
    bad.write_text(text[: len(text) // 2])  # cut mid-run
    out = tmp_path / "never.yaml"
    assert main(["calibrate", "nccl", str(bad), "--cluster", "azure-nd-a100-v4", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "all_reduce_perf.log, line" in err and ("truncated" in err or "columns" in err)
    assert not out.exists()
