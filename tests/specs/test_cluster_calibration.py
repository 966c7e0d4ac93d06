"""A cluster file of one's own gets the calibration of its GPU, or says plainly that it has none (issue 35)."""

from __future__ import annotations

import pytest
import yaml

from echo_plan.errors import EchoPlanError
from echo_plan.specs import load_cluster
from echo_plan.specs.calibration import calibration_status
from echo_plan.specs.presets import clusters_dir


def _own(tmp_path, name: str, gpu_name: str | None = None, calibration=None, drop: bool = True):
    data = yaml.safe_load((clusters_dir() / "dgx-h100.yaml").read_text())
    if drop:
        data.pop("calibration")
    if calibration is not None:
        data["calibration"] = calibration
    if gpu_name:
        data["gpu"]["name"] = gpu_name
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_file_naming_a_known_gpu_inherits_its_presets_calibration(tmp_path):
    mine = load_cluster(_own(tmp_path, "mine"))
    shipped = load_cluster("dgx-h100")
    assert mine.calibration["compute"] == shipped.calibration["compute"]
    assert mine.calibration["ranges"] == shipped.calibration["ranges"]
    assert "nccl" not in mine.calibration  # the network's figures are not the GPU's
    assert "dgx-h100" in calibration_status(mine) and "inherited" in calibration_status(mine)
    assert calibration_status(shipped) == "calibrated for GPU H100-SXM5-80GB"


def test_an_unknown_gpu_is_said_to_have_no_calibration_and_from_names_one(tmp_path):
    bare = load_cluster(_own(tmp_path, "h200", "H200-SXM5-141GB"))
    assert "compute" not in (bare.calibration or {})
    assert calibration_status(bare).startswith("no calibration for GPU H200-SXM5-141GB")
    named = load_cluster(_own(tmp_path, "h200b", "H200-SXM5-141GB", {"from": "dgx-h100"}))
    assert named.calibration["compute"] == load_cluster("dgx-h100").calibration["compute"]
    assert "dgx-h100" in named.calibration["from"]
    with pytest.raises(EchoPlanError, match="dgx-h9000"):
        load_cluster(_own(tmp_path, "bad", calibration={"from": "dgx-h9000"}))
    empty = load_cluster(_own(tmp_path, "none", calibration={}))  # explicitly none: stays none
    assert calibration_status(empty).startswith("no calibration")


def test_simulate_and_the_report_say_it(tmp_path, capsys):
    from echo_plan.cli import main

    path = _own(tmp_path, "h200", "H200-SXM5-141GB")
    assert main(["simulate", "--cluster", path, "--gpus", "64", "--tp", "8", "--pp", "2", "--gbs", "64",
                 "--cache-dir", str(tmp_path / "c")]) == 0
    assert "no calibration for GPU H200-SXM5-141GB" in " ".join(capsys.readouterr().out.split())
    from echo_plan.report.inputs import calibration_summary

    assert calibration_summary(load_cluster(path).calibration).startswith("NONE for this GPU")


def test_a_fit_of_ones_own_replaces_the_inherited_label():
    """calibrate steps on a cluster that inherited its figures writes its own: no 'from' left behind."""
    from echo_plan.calibrate.steps import StepsCalibration, calibration_block
    from echo_plan.calibrate.steps_fit import StepFit
    from echo_plan.cost.calibration import ComputeCalibration

    fit = StepFit(ComputeCalibration(), (), (), (), 0, {})
    got = calibration_block(StepsCalibration(fit, (), "megatron-core"), "ours", "ours.csv",
                            {"from": "dgx-h100 (same GPU)", "ranges": {"nominal_coverage": 0.8, "by_stack": {}}})
    assert "from" not in got and "compute" in got


def test_the_h200_preset_is_the_h100_die_with_more_memory_and_says_whose_calibration_it_has():
    h200, h100 = load_cluster("h200"), load_cluster("dgx-h100")
    assert h200.gpu.peak_bf16_tflops == h100.gpu.peak_bf16_tflops and h200.gpu.hbm_GiB > 1.7 * h100.gpu.hbm_GiB
    assert h200.calibration["compute"] == h100.calibration["compute"]
    assert calibration_status(h200).startswith("calibration inherited from dgx-h100")


def test_from_follows_a_preset_that_itself_inherits(tmp_path):
    """h200 takes dgx-h100's figures; a file naming h200 gets them too, not an empty calibration."""
    mine = load_cluster(_own(tmp_path, "mine", "H200-NVL", {"from": "h200"}))
    assert mine.calibration["compute"] == load_cluster("dgx-h100").calibration["compute"]


def test_h100_is_another_name_for_dgx_h100(capsys):
    from echo_plan.cli import main

    assert load_cluster("h100") == load_cluster("dgx-h100")
    assert main(["presets"]) == 0
    assert "another name for dgx-h100" in capsys.readouterr().out


def test_a_file_of_ones_own_takes_the_host_time_of_its_presets_server_and_presets_do_not_pass_it_on(tmp_path):
    """calibration.host is the server's host (x86 DGX), not the GPU's: a file of one's own with the H100 takes
    dgx-h100's; a preset naming another for its compute figures (gb200-nvl72, h200) does not take it."""
    mine = load_cluster(_own(tmp_path, "mine"))
    assert mine.calibration["host"]["op_us"] == load_cluster("dgx-h100").calibration["host"]["op_us"] > 0
    named = load_cluster(_own(tmp_path, "named", calibration={"from": "b200"}, gpu_name="B200"))
    assert named.calibration["host"] == load_cluster("b200").calibration["host"]
    for preset in ("gb200-nvl72", "gb300-nvl72", "h200"):
        assert "host" not in (load_cluster(preset).calibration or {})


@pytest.mark.parametrize("host", [{"op_us": -1}, {"op_us": "fast"}, {"op_us": 1e9}, {"op_us": True}, {}, "x"])
def test_a_bad_host_time_is_a_clear_error(tmp_path, host):
    with pytest.raises(EchoPlanError, match="calibration.host"):
        load_cluster(_own(tmp_path, "bad", calibration={"host": host}))


def test_figures_per_kernel_family_follow_the_gpu_they_were_fitted_on(tmp_path):
    """dgx-h100's figures for PyTorch's kernels go with its compute figures to a file of one's own with the same GPU
    and to h200 (the same die), not to a preset of another GPU generation (b200: its compute figures are a prior)
    nor to one with compute figures fitted on its own runs (h100-gt)."""
    shipped = load_cluster("dgx-h100").calibration["compute_by_kernels"]
    assert load_cluster(_own(tmp_path, "mine")).calibration["compute_by_kernels"] == shipped
    assert load_cluster("h200").calibration["compute_by_kernels"] == shipped
    for preset in ("b200", "gb200-nvl72", "h100-gt"):
        assert "compute_by_kernels" not in (load_cluster(preset).calibration or {}), preset
