"""FSDP plans as torchtitan job configs: exported with their sharding, pipeline split, float8 and compile settings,
read back as the same plan, parsed by torchtitan's own config parser where it is installed; what torchtitan
cannot run as simulated is refused with the knob."""

from __future__ import annotations

import pytest

from echo_plan.interop.launch import CannotExpress, export_launch, import_launch
from echo_plan.interop.launch.job import LaunchFormat, canonical_plan
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.plan import balanced_split

TT = load_stack("torchtitan")
FSDP_PLANS = [
    ("llama3-8b", 8, dict(dp=8, micro_batch_size=2, global_batch_size=16, sharding="parameters", recompute="full")),
    ("llama3-8b", 64, dict(dp=64, micro_batch_size=1, global_batch_size=128, sharding="parameters", shard_degree=8)),
    ("llama3-8b", 8, dict(dp=4, cp=2, global_batch_size=4, sharding="parameters", recompute="full", dtype="fp8")),
    ("llama3-70b", 256, dict(tp=8, dp=32, micro_batch_size=16, global_batch_size=512, sequence_parallel=True,
                             sharding="parameters", recompute="full", reshard_after_forward=False)),
    ("llama3-405b", 512, dict(tp=8, pp=8, dp=8, global_batch_size=256, sequence_parallel=True, sharding="parameters",
                              recompute="full", dtype="fp8", layer_split=balanced_split(126, 8))),
    ("llama3-405b", 512, dict(tp=8, pp=8, dp=8, global_batch_size=256, sequence_parallel=True, sharding="parameters",
                              recompute="full", virtual_stages=2, layer_split=balanced_split(126, 16))),
    # torchtitan's selective checkpointing: its per-op policy, and every n-th layer (8 of 32: every 4th; 20 of each
    # pipeline stage's 40: every 2nd)
    ("llama3-8b", 8, dict(dp=8, global_batch_size=8, sharding="parameters", recompute="selective")),
    ("llama3-8b", 8, dict(dp=8, global_batch_size=8, sharding="parameters", recompute_layers=8)),
    ("llama3-70b", 64, dict(tp=8, pp=2, dp=4, global_batch_size=32, sequence_parallel=True, sharding="parameters",
                            recompute_layers=20)),
]


@pytest.mark.parametrize("name, gpus, fields", FSDP_PLANS)
def test_fsdp_plans_round_trip(name, gpus, fields):
    model, cluster = load_model(name), load_cluster("h100-gt", gpus=gpus)
    plan = PlanSpec(**fields)
    out = export_launch(LaunchFormat.TORCHTITAN, model, plan, TT, cluster)
    job = import_launch(out.text, "job.toml", load_stack())
    assert canonical_plan(job.plan, model) == canonical_plan(plan, model), job.plan.short()
    assert job.stack.name == "torchtitan" and job.gpus == gpus


def test_the_stack_settings_travel_with_the_plan():
    model, cluster = load_model("llama3-70b"), load_cluster("h100-gt", gpus=256)
    plan = PlanSpec(tp=8, dp=32, global_batch_size=256, sequence_parallel=True, sharding="parameters", dtype="fp8")
    stack = TT.replace(tp_comm_overlap=True, fp8_param_gather=True)
    out = export_launch(LaunchFormat.TORCHTITAN, model, plan, stack, cluster)
    assert "enable_async_tensor_parallel = true" in out.text and "enable_fsdp_float8_all_gather = true" in out.text
    job = import_launch(out.text, "job.toml", load_stack())
    assert job.stack.tp_comm_overlap and job.stack.fp8_param_gather and job.plan.dtype.value == "fp8"
    eager = export_launch(LaunchFormat.TORCHTITAN, model, plan, TT.replace(torch_compile=False), cluster)
    assert "[compile]\nenable = false" in eager.text
    assert not import_launch(eager.text, "job.toml", load_stack()).stack.fused_elementwise


@pytest.mark.parametrize("fields, knob", [
    (dict(dp=8, global_batch_size=8, distributed_optimizer=True, sharding="optimizer"), "sharding"),
    (dict(dp=8, global_batch_size=8, sharding="parameters", recompute_layers=5), "recompute_layers"),  # 32 layers
    (dict(dp=8, global_batch_size=8, sharding="parameters", recompute="selective", recompute_layers=4),
     "recompute_layers"),
    (dict(dp=4, cp=2, global_batch_size=4, sharding="parameters", shard_degree=1), "shard_degree"),
    (dict(tp=2, dp=4, global_batch_size=4, sharding="parameters"), "sequence_parallel"),
])
def test_what_torchtitan_cannot_run_is_refused_with_the_knob(fields, knob):
    model, cluster = load_model("llama3-8b"), load_cluster("h100-gt", gpus=8)
    with pytest.raises(CannotExpress, match=knob) as exc:
        export_launch(LaunchFormat.TORCHTITAN, model, PlanSpec(**fields), TT, cluster)
    assert "\n" not in str(exc.value)


def test_selective_recompute_by_modules_is_not_torchtitans_per_op_policy():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-gt", gpus=8)
    plan = PlanSpec(dp=8, global_batch_size=8, sharding="parameters", recompute="selective")
    with pytest.raises(CannotExpress, match="recompute selective: torchtitan's selective checkpointing saves by op"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, TT.replace(recompute_policy="modules"), cluster)


@pytest.mark.parametrize("section, expected", [
    ("", dict(recompute_layers=16)),  # torchtitan's default: selective, every 2nd layer
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "4"', dict(recompute_layers=8)),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "1"', dict(recompute="full")),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"', dict(recompute="selective")),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "3"', "a divisor of every pipeline chunk"),
    ('[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "0"', "a positive integer"),
    ('[activation_checkpoint]\nmode = "memory_budget"', "memory-budget mode is not modelled"),
])
def test_torchtitan_checkpointing_is_read_as_the_plan_simulates_it(section, expected):
    from echo_plan.interop.launch import CannotImport

    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nglobal_batch_size = 8\n'
            '[parallelism]\ndata_parallel_shard_degree = 8\n' + section + "\n")
    if isinstance(expected, str):
        with pytest.raises(CannotImport, match=expected) as exc:
            import_launch(text, "job.toml", load_stack(), gpus=8)
        assert "\n" not in str(exc.value)
        return
    plan = import_launch(text, "job.toml", load_stack(), gpus=8).plan
    assert {k: getattr(plan, k) if k != "recompute" else plan.recompute.value for k in expected} == expected
    assert plan.recompute.value != "full" or plan.recompute_layers == 0


@pytest.mark.parametrize("name, gpus, fields", FSDP_PLANS)
def test_torchtitan_parses_the_exported_fsdp_toml(tmp_path, name, gpus, fields):
    pytest.importorskip("torchtitan.config", reason="torchtitan is not installed (pip install -e '.[frameworks]')")
    from torchtitan.config import ConfigManager

    model, cluster, plan = load_model(name), load_cluster("h100-gt", gpus=gpus), PlanSpec(**fields)
    path = tmp_path / "job.toml"
    path.write_text(export_launch(LaunchFormat.TORCHTITAN, model, plan, TT, cluster).text)
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    par = cfg.parallelism
    assert par.data_parallel_shard_degree * par.context_parallel_degree * par.data_parallel_replicate_degree \
        == plan.grad_dp
    assert (par.tensor_parallel_degree, par.pipeline_parallel_degree) == (plan.tp, plan.pp)
    ac = cfg.activation_checkpoint  # the layers torchtitan's every-n-th-layer checkpointing wraps: the plan's
    if plan.recompute_layers:
        assert ac.mode == "selective" and all(size // int(ac.selective_ac_option) == plan.recompute_layers
                                              for size in plan.virtual_layers(model.num_layers))
    else:
        assert (ac.mode, ac.selective_ac_option if ac.mode == "selective" else "op") == \
            ({"none": "none", "full": "full", "selective": "selective"}[plan.recompute.value], "op")
    if plan.pp > 1:
        parts = par.module_fqns_per_model_part
        assert len(parts) == plan.pp * plan.virtual_stages
        assert [sum(m.startswith("layers.") for m in p) for p in parts] == list(plan.virtual_layers(model.num_layers))


@pytest.mark.parametrize("fmt", list(LaunchFormat))
def test_a_plan_simulated_with_the_triton_flash_attention_is_not_exported_as_another_kernel(fmt):
    """llm-foundry's Triton FlashAttention runs at 0.58 of FlashAttention-2's rate here: no launch format runs it,
    so writing the plan as torchtitan's or Megatron's would launch another step than the one predicted."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-a100", gpus=64)
    plan = PlanSpec(dp=64, global_batch_size=512, sharding="parameters")
    with pytest.raises(CannotExpress, match="attention_library flash-attn-triton"):
        export_launch(fmt, model, plan, load_stack("llm-foundry"), cluster)
    export_launch(LaunchFormat.TORCHTITAN, model, plan, TT, cluster)  # the same plan on torchtitan's stack is written


def test_flash_attention_3_is_megatrons_flash_backend_and_not_torchtitans():
    """FlashAttention-3 (DeepSeek's kernels) is Transformer Engine's flash backend where its Hopper package is
    installed; torchtitan's SDPA has no such backend, so a plan simulated with it is not written as torchtitan's."""
    model, cluster = load_model("llama3-8b"), load_cluster("h800", gpus=64)
    plan = PlanSpec(dp=64, global_batch_size=512, sharding="parameters")
    with pytest.raises(CannotExpress, match="attention_library flash-attn-3.*not the FlashAttention-3"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, TT.replace(attention_library="flash-attn-3"), cluster)
    dense = PlanSpec(dp=64, global_batch_size=512, distributed_optimizer=True)
    text = export_launch(LaunchFormat.MEGATRON_LM, model, dense, load_stack("megatron-core").replace(
        attention_library="flash-attn-3"), cluster).text
    assert "--attention-backend flash" in text and "NVTE_FLASH_ATTN=1" in text


def test_a_plan_simulated_with_automodels_fused_kernels_is_not_exported_as_torchtitan():
    """AutoModel's stack runs Transformer Engine's RMSNorm and fused elementwise kernels without compiling: torchtitan
    would run its eager modules, another step than the one predicted."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100", gpus=64)
    plan = PlanSpec(cp=2, dp=32, global_batch_size=128, sharding="parameters", recompute="full")
    with pytest.raises(CannotExpress, match="fused_norm true"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, load_stack("automodel"), cluster)
    with pytest.raises(CannotExpress, match="fused_elementwise true"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, load_stack("automodel").replace(fused_norm=False), cluster)
    export_launch(LaunchFormat.TORCHTITAN, model, plan, TT, cluster)  # torchtitan's own stack is written


def test_a_plan_simulated_with_another_fsdp_runtime_or_loss_is_not_exported_as_torchtitan():
    """torchtitan runs FSDP2 (its copy kernels) and the loss its compile setting gives: a plan simulated with FSDP1's
    runtime or with OLMo-core's loss on an fp32 copy of the logits would launch another step than the one predicted."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8)
    plan = PlanSpec(dp=8, global_batch_size=16, sharding="parameters")
    with pytest.raises(CannotExpress, match="fsdp_copy_kernels"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, TT.replace(fsdp_copy_kernels=False), cluster)
    with pytest.raises(CannotExpress, match="cross_entropy torch: torchtitan's loss with torch_compile true"):
        export_launch(LaunchFormat.TORCHTITAN, model, plan, load_stack("olmo-core"), cluster)
    export_launch(LaunchFormat.TORCHTITAN, model, plan, TT, cluster)
    eager = TT.replace(torch_compile=False)  # eager torchtitan: the uncompiled loss, as the stack then says
    export_launch(LaunchFormat.TORCHTITAN, model, plan, eager, cluster)


@pytest.mark.parametrize("training, expected", [
    ("", dict(reduce="fp32")),
    ('mixed_precision_reduce = "bfloat16"', dict(reduce="bf16")),  # a release or fork that takes it
    ('mixed_precision_param = "float32"', "fp32 training is not modelled"),
    ('mixed_precision_reduce = "float16"', "float32 or bfloat16"),
])
def test_torchtitan_mixed_precision_is_read_not_passed_over(training, expected):
    """A file's FSDP2 reduce dtype is the stack's gradient reduction (its memory and traffic); fp32 parameters are
    refused by name, not simulated as bf16."""
    from echo_plan.interop.launch import CannotImport

    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nglobal_batch_size = 8\n'
            + training + '\n[parallelism]\ndata_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = "full"\n')
    if isinstance(expected, str):
        with pytest.raises(CannotImport, match=expected):
            import_launch(text, "job.toml", load_stack(), gpus=8)
        return
    job = import_launch(text, "job.toml", load_stack(), gpus=8)
    assert job.stack.grad_reduce_dtype.value == expected["reduce"]
    assert f"{expected['reduce']} gradient reduction and the optimizer step after the backward" in job.notes[0]


def test_a_step_inside_the_backward_travels_both_ways():
    """optimizer.early_step_in_backward is the stack's optimizer_in_backward: read, said in the note, and written
    back; torchtitan's own parser takes the exported file."""
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\n[parallelism]\n'
            'data_parallel_shard_degree = 8\n[activation_checkpoint]\nmode = "full"\n'
            '[optimizer]\nearly_step_in_backward = true\n')
    job = import_launch(text, "job.toml", load_stack(), gpus=8)
    assert job.stack.optimizer_in_backward and "optimizer step in the backward" in job.notes[0]
    assert not import_launch(text.replace("true", "false"), "job.toml", load_stack(), gpus=8).stack.optimizer_in_backward
    model, cluster = load_model("llama3-8b"), load_cluster("h100-gt", gpus=8)
    out = export_launch(LaunchFormat.TORCHTITAN, model, job.plan, job.stack, cluster)
    assert "[optimizer]\nearly_step_in_backward = true" in out.text
    assert import_launch(out.text, "job.toml", load_stack()).stack.optimizer_in_backward
    assert "early_step" not in export_launch(LaunchFormat.TORCHTITAN, model, job.plan, TT, cluster).text


@pytest.mark.parametrize("section, expected", [
    ('[compile]\nenable = true\ncomponents = ["model", "loss"]', ("torch_compiled", True)),
    ('[compile]\nenable = true\ncomponents = ["model"]', ("torch", True)),  # the loss left eager
    ('[compile]\nenable = false', ("torch", False)),
    ('[compile]\nenable = true\ncomponents = ["loss"]', "a compiled loss beside eager blocks is not modelled"),
    ('[compile]\nenable = true\ncomponents = ["model", "optimizer"]', "compile.components"),
    ('[parallelism]\ntensor_parallel_degree = 2\ndisable_loss_parallel = true', "disable_loss_parallel"),
])
def test_what_torchtitan_compiles_and_where_its_loss_runs_are_read(section, expected):
    from echo_plan.interop.launch import CannotImport

    head = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nglobal_batch_size = 8\n'
            '[activation_checkpoint]\nmode = "full"\n')
    shard = "data_parallel_shard_degree = -1\n"  # the GPUs left over: 8, or 4 beside TP 2
    if section.startswith("[parallelism]"):
        text = head + section + "\n" + shard
    else:
        text = head + "[parallelism]\n" + shard + section + "\n"
    if isinstance(expected, str):
        with pytest.raises(CannotImport, match=expected):
            import_launch(text, "job.toml", load_stack(), gpus=8)
        return
    stack = import_launch(text, "job.toml", load_stack(), gpus=8).stack
    assert (stack.cross_entropy.value, stack.fused_elementwise) == expected


@pytest.mark.parametrize("method, cp_comm", [(None, "all_gather"), ("allgather", "all_gather"), ("alltoall", "p2p"),
                                             ("ring", None)])
def test_the_context_parallel_rotate_method_is_read_and_written(method, cp_comm):
    from echo_plan.interop.launch import CannotImport

    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\nseq_len = 32768\n'
            '[parallelism]\ndata_parallel_shard_degree = 4\ncontext_parallel_degree = 2\n'
            + (f'context_parallel_rotate_method = "{method}"\n' if method else "")
            + '[activation_checkpoint]\nmode = "full"\n')
    if cp_comm is None:
        with pytest.raises(CannotImport, match="allgather or alltoall"):
            import_launch(text, "job.toml", load_stack(), gpus=8)
        return
    job = import_launch(text, "job.toml", load_stack(), gpus=8)
    assert job.stack.cp_comm.value == cp_comm
    out = export_launch(LaunchFormat.TORCHTITAN, job.model, job.plan, job.stack, load_cluster("h100-gt", gpus=8))
    assert import_launch(out.text, "job.toml", load_stack()).stack.cp_comm.value == cp_comm


@pytest.mark.parametrize("par, vpp, split", [
    ('pipeline_parallel_degree = 2', 1, None),  # 32 layers + 2: 17 and 17, one less at each end: even
    ('pipeline_parallel_degree = 4', 1, (8, 9, 8, 7)),  # 34 over 4: 9, 9, 8, 8, the ends one less
    ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"', 2, (8, 9, 8, 7)),
    ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
     'pipeline_parallel_layers_per_stage = 3', 6, (2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 1)),  # 12 stages of 34 / 3
    ('pipeline_parallel_degree = 2\npipeline_parallel_schedule = "Interleaved1F1B"\n'
     'pipeline_parallel_layers_per_stage = 4', None, "9 stages over pp 2"),  # torchtitan refuses it too
    ('pipeline_parallel_degree = 2\npipeline_parallel_layers_per_stage = 4', None, "exactly 1 a rank"),
])
def test_a_pipeline_without_module_lists_is_split_as_torchtitan_splits_it(par, vpp, split):
    """torchtitan 0.2 without module_fqns_per_model_part: pp stages (2 a rank when looped, or as many as
    pipeline_parallel_layers_per_stage makes), the embedding and the output counted as a layer each."""
    from echo_plan.interop.launch import CannotImport

    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n[parallelism]\n'
            'data_parallel_shard_degree = -1\n' + par + '\n[activation_checkpoint]\nmode = "full"\n')
    if isinstance(split, str):
        with pytest.raises(CannotImport, match=split):
            import_launch(text, "job.toml", load_stack(), gpus=8)
        return
    plan = import_launch(text, "job.toml", load_stack(), gpus=8).plan
    assert plan.virtual_stages == vpp and plan.layer_split == split
