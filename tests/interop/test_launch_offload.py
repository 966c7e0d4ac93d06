"""An offloaded optimizer in launch configs: written as Megatron-Core's flags and read back as the same plan,
accepted by Megatron-Core's own OptimizerConfig where it installs, refused in one line where a framework would run
something else."""

from __future__ import annotations

import dataclasses

import pytest

from echo_plan.interop.launch import CannotExpress, CannotImport, LaunchFormat, export_launch, import_launch
from echo_plan.interop.launch.mcore import to_mcore
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack

MODEL = load_model("llama3-70b")
CLUSTER = load_cluster("h800", gpus=64)
PLAN = PlanSpec(tp=4, pp=4, dp=4, global_batch_size=128, sequence_parallel=True, distributed_optimizer=True,
                offload_optimizer=True)


@pytest.mark.parametrize("fmt, name", [(LaunchFormat.MEGATRON_LM, "job.sh"),
                                       (LaunchFormat.MEGATRON_BRIDGE, "job.yaml")])
def test_an_offloaded_plan_round_trips(fmt, name):
    out = export_launch(fmt, MODEL, PLAN, load_stack(), CLUSTER)
    if fmt is LaunchFormat.MEGATRON_LM:
        for flag in ("--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0", "--overlap-cpu-optimizer-d2h-h2d",
                     "--use-precision-aware-optimizer"):
            assert flag in out.text
    job = import_launch(out.text, name, load_stack())
    assert job.plan.offload_optimizer and job.stack.optimizer_state_bytes in (None, 12.0)
    plain = export_launch(fmt, MODEL, PLAN.replace(offload_optimizer=False), load_stack(), CLUSTER)
    assert "cpu_offload" not in plain.text and "cpu-offload" not in plain.text
    assert not import_launch(plain.text, name, load_stack()).plan.offload_optimizer


def test_a_partial_offload_round_trips():
    plan = PLAN.replace(offload_fraction=0.25)
    out = export_launch(LaunchFormat.MEGATRON_LM, MODEL, plan, load_stack(), CLUSTER)
    assert "--optimizer-offload-fraction 0.25" in out.text
    job = import_launch(out.text, "job.sh", load_stack())
    assert job.plan.offload_optimizer and job.plan.offload_fraction == 0.25


@pytest.mark.parametrize("replace, says", [("--optimizer-offload-fraction 1.0", "--optimizer-offload-fraction 1.5"),
                                           ("--overlap-cpu-optimizer-d2h-h2d", "")])
def test_an_offload_echo_plan_does_not_model_is_refused_on_import(replace, says):
    text = export_launch(LaunchFormat.MEGATRON_LM, MODEL, PLAN, load_stack(), CLUSTER).text.replace(replace, says)
    with pytest.raises(CannotImport, match="optimizer_offload_fraction|overlap_cpu_optimizer_d2h_h2d"):
        import_launch(text, "job.sh", load_stack())


def test_another_frameworks_offload_is_not_exported_as_megatrons():
    zero3 = load_stack("deepspeed-zero3").replace(pipeline_parallel=True, sequence_parallel=True)
    with pytest.raises(CannotExpress, match="optimizer_offload"):
        export_launch(LaunchFormat.MEGATRON_LM, MODEL, PLAN.replace(sharding="optimizer"), zero3, CLUSTER)
    plan = PlanSpec(dp=64, global_batch_size=64, sharding="parameters", offload_optimizer=True)
    with pytest.raises(CannotExpress, match="optimizer_offload zero-offload.*CPUOffloadPolicy"):
        export_launch(LaunchFormat.TORCHTITAN, load_model("llama3-8b"), plan, load_stack("deepspeed-zero3"), CLUSTER)


def test_fsdp2_offload_round_trips_through_torchtitans_job_config(tmp_path):
    plan = PlanSpec(dp=64, global_batch_size=64, sharding="parameters", offload_optimizer=True)
    out = export_launch(LaunchFormat.TORCHTITAN, load_model("llama3-8b"), plan, load_stack("torchtitan"), CLUSTER)
    assert "enable_cpu_offload = true" in out.text
    job = import_launch(out.text, "job.toml", load_stack("torchtitan"))
    assert job.plan.offload_optimizer and job.plan.sharding.value == "parameters"
    pytest.importorskip("torchtitan.config", reason="torchtitan is not installed (pip install -e '.[frameworks]')")
    from torchtitan.config import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(out.text)
    assert ConfigManager().parse_args(["--job.config_file", str(path)]).training.enable_cpu_offload


def test_megatron_cores_optimizer_config_accepts_the_offload(monkeypatch):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[frameworks]')")
    import megatron.core.utils
    from megatron.core.optimizer import OptimizerConfig
    from packaging.version import Version

    # its checks of the installed Transformer Engine answered as on a GPU machine with TE 2.10
    monkeypatch.setattr(megatron.core.utils, "get_te_version", lambda: Version("2.10.0"))

    opt = to_mcore(MODEL, PLAN, load_stack(), LaunchFormat.MEGATRON_LM)["optimizer"]
    assert set(opt) <= {f.name for f in dataclasses.fields(OptimizerConfig)}
    # the precision-aware optimizer's check that TE's FusedAdam installs is skipped under optimizer_cpu_offload
    # (optimizer_config.py returns before it), so the whole section is built here
    config = OptimizerConfig(bf16=True, **opt)
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 1.0


def test_the_precision_aware_optimizer_with_its_default_moments_imports_as_twelve_bytes():
    plain = export_launch(LaunchFormat.MEGATRON_LM, MODEL, PLAN.replace(offload_optimizer=False), load_stack(),
                          CLUSTER).text
    job = import_launch(plain.replace("--use-distributed-optimizer", "--use-distributed-optimizer "
                                      "--use-precision-aware-optimizer"), "job.sh", load_stack())
    assert job.stack.optimizer_state_bytes in (None, 12.0) and not job.plan.offload_optimizer
    with pytest.raises(CannotImport, match="exp_avg_dtype"):
        import_launch(plain.replace("--use-distributed-optimizer", "--use-distributed-optimizer "
                                    "--use-precision-aware-optimizer --exp-avg-dtype fp16"), "job.sh", load_stack())
