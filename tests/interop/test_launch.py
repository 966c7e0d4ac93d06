"""Launch configs (issue 33): every plan of a search exports and imports back to itself, or is refused
with one line; imports refuse what they cannot model; the framework formats' own details."""

from __future__ import annotations

from pathlib import Path

import pytest

from echo_plan.interop.launch import (
    CannotExpress, CannotImport, LaunchFormat, canonical_plan, export_launch, import_launch,
)
from echo_plan.interop.launch.megatron_lm import import_argument_dump, parse_argument_dump
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.software import AttentionLibrary

from tests.interop.launch_searches import SEARCHES, STACK, _search_plans  # shared with the benchmark

_TE_FP8 = {"fp8_kernels": "transformer-engine", "fp8_attention_output_e5m6": False}  # what Megatron-Core runs


@pytest.mark.parametrize("name", sorted(SEARCHES))
@pytest.mark.parametrize("fmt", list(LaunchFormat))
def test_every_plan_of_a_search_round_trips_or_is_refused_in_one_line(name, fmt):
    model, cluster, plans = _search_plans(*SEARCHES[name])
    assert plans
    exported = 0
    for plan in plans:
        try:
            out = export_launch(fmt, model, plan, STACK, cluster)
        except CannotExpress as exc:
            assert "\n" not in str(exc) and exc.knob in str(exc)
            continue
        exported += 1
        job = import_launch(out.text, f"job{fmt.suffix}", STACK)
        assert job.plan == canonical_plan(plan, model), plan.short()
        assert job.model.model_dump(exclude={"source"}) == model.model_dump(exclude={"source"})
        assert job.gpus == cluster.num_gpus
        assert job.stack.model_dump() == STACK.for_plan(plan).model_dump() or fmt is LaunchFormat.TORCHTITAN
    if fmt is not LaunchFormat.TORCHTITAN:  # torchtitan needs FSDP for these layouts (issue 34)
        assert exported > 0


@pytest.mark.parametrize("fmt", [LaunchFormat.MEGATRON_LM, LaunchFormat.MEGATRON_BRIDGE])
def test_deepseek_stack_and_uneven_split_round_trip(fmt):
    model = load_model("deepseek-v3")
    stack = load_stack("deepseek-v3").replace(moe_act_input_fp8=False, moe_dispatch_fp8=False, **_TE_FP8)
    plan = PlanSpec(pp=16, dp=128, ep=64, global_batch_size=15360, distributed_optimizer=True, recompute="selective",
                    layer_split=(3,) + (4,) * 14 + (2,), dtype="fp8")
    cluster = load_cluster("h800", gpus=2048)
    job = import_launch(export_launch(fmt, model, plan, stack, cluster).text, f"x{fmt.suffix}", load_stack(None))
    assert job.plan == canonical_plan(plan, model)
    for field in ("moe_dispatcher", "moe_comm_sms", "fp8_recipe", "recompute_modules", "optimizer_state_bytes"):
        assert getattr(job.stack, field) == getattr(stack, field), field
    # DeepSeek's FlashAttention-3 goes out as Transformer Engine's flash backend (FlashAttention-3 where its
    # Hopper package is installed) and is read back as that backend's FlashAttention-2
    assert stack.attention_library is AttentionLibrary.FLASH_ATTN_3
    assert job.stack.attention_library is AttentionLibrary.FLASH_ATTN_2


@pytest.mark.parametrize("keep", ["moe_act_input_fp8", "moe_dispatch_fp8", "fp8_kernels", "fp8_attention_output_e5m6"])
def test_deepseeks_fp8_caching_dispatch_and_kernels_are_refused_by_megatron(keep):
    model = load_model("deepseek-v3")
    ours = {"moe_act_input_fp8": False, "moe_dispatch_fp8": False, **_TE_FP8}
    stack = load_stack("deepseek-v3").replace(**{k: v for k, v in ours.items() if k != keep})
    plan = PlanSpec(pp=16, dp=128, ep=64, global_batch_size=15360, distributed_optimizer=True, dtype="fp8")
    with pytest.raises(CannotExpress, match=keep):
        export_launch(LaunchFormat.MEGATRON_LM, model, plan, stack, load_cluster("h800", gpus=2048))


@pytest.mark.parametrize("fields, knob", [
    (dict(pp=4, dp=2, schedule="zb-v", global_batch_size=16), "schedule"),
    (dict(pp=4, dp=2, schedule="dualpipe", global_batch_size=16), "schedule"),
    (dict(dp=8, dp_comm="topk", density=0.1, global_batch_size=16), "dp_comm"),
])
def test_schedules_and_exchanges_megatron_lacks_are_refused(fields, knob):
    model, cluster = load_model("gpt-13b"), load_cluster("h800", gpus=8 * fields.get("pp", 1))
    with pytest.raises(CannotExpress, match=knob):
        export_launch(LaunchFormat.MEGATRON_LM, model, PlanSpec(**fields), STACK, cluster)


def test_torchtitan_refuses_what_needs_fsdp_and_runs_pure_data_parallel():
    model, cluster = load_model("llama3-8b"), load_cluster("h800", gpus=8)
    with pytest.raises(CannotExpress, match="--sharding parameters"):
        export_launch(LaunchFormat.TORCHTITAN, model, PlanSpec(tp=2, dp=4, sequence_parallel=True,
                                                               global_batch_size=8), STACK, cluster)
    with pytest.raises(CannotExpress, match="flavours"):
        export_launch(LaunchFormat.TORCHTITAN, load_model("gpt-13b"), PlanSpec(dp=8, global_batch_size=8), STACK, cluster)
    out = export_launch(LaunchFormat.TORCHTITAN, model, PlanSpec(dp=8, global_batch_size=64), STACK, cluster)
    assert 'flavor = "8B"' in out.text and "data_parallel_replicate_degree = 8" in out.text


def test_megatron_block_recompute_reads_as_recompute_layers():
    job = import_launch(LM + "--recompute-granularity full --recompute-method block --recompute-num-layers 2", "cmd",
                        STACK)
    assert job.plan.recompute_layers == 2 and job.plan.recompute.value == "none"


LM = ("torchrun --nnodes 1 --nproc-per-node 8 pretrain_gpt.py --num-layers 4 --hidden-size 1024 "
      "--num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --vocab-size 32000 --bf16 "
      "--micro-batch-size 1 --global-batch-size 16 --tensor-model-parallel-size 2 --sequence-parallel ")


@pytest.mark.parametrize("extra, setting", [
    ("--foo-bar 3", "--foo-bar"),
    ("--moe-shared-expert-overlap", "--moe-shared-expert-overlap"),  # changes the step: not read past
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", "recompute_num_layers"),
])
def test_import_refuses_a_setting_it_cannot_model_naming_it(extra, setting):
    with pytest.raises(CannotImport) as exc:
        import_launch(LM + extra, "job.sh", STACK)
    assert setting in str(exc.value) and "nothing simulated" in str(exc.value) and "\n" not in str(exc.value)


def test_import_reads_past_data_and_logging_flags_and_uses_megatron_defaults():
    job = import_launch(LM + "--data-path 0.5 /d/a 0.5 /d/b --lr 1e-4 --log-interval 10 --save /ckpt", "job.sh", STACK)
    assert (job.plan.tp, job.plan.dp, job.plan.global_batch_size) == (2, 4, 16)
    assert job.model.norm.value == "layernorm" and job.model.activation.value == "gelu"  # Megatron-LM's defaults
    assert job.stack.hidden_dropout == 0.1  # Megatron-LM's default dropout, not the preset's


def test_import_needs_precision_and_gpus():
    with pytest.raises(CannotImport, match="fp32"):
        import_launch(LM.replace("--bf16 ", ""), "job.sh", STACK)
    with pytest.raises(CannotImport, match="--gpus"):
        import_launch(LM.replace("torchrun --nnodes 1 --nproc-per-node 8 ", "python "), "job.sh", STACK)
    job = import_launch(LM.replace("torchrun --nnodes 1 --nproc-per-node 8 ", "python "), "job.sh", STACK, gpus=16)
    assert job.plan.dp == 8


def test_a_megatron_log_argument_dump_is_a_launch_config():
    dump_lines = ["------------------------ arguments ------------------------"]
    args = {"num_layers": 4, "hidden_size": 1024, "ffn_hidden_size": 4096, "num_attention_heads": 16,
            "num_query_groups": 16, "seq_length": 2048, "max_position_embeddings": 2048, "vocab_size": 32000,
            "bf16": True, "fp16": False, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
            "context_parallel_size": 1, "micro_batch_size": 1, "global_batch_size": 16, "sequence_parallel": True,
            "swiglu": True, "normalization": "RMSNorm", "untie_embeddings_and_output_weights": True,
            "add_bias_linear": False, "use_distributed_optimizer": True, "overlap_grad_reduce": True,
            "recompute_granularity": None, "world_size": 8, "hidden_dropout": 0.0, "attention_dropout": 0.0,
            "accumulate_allreduce_grads_in_fp32": True, "data_path": ["/d/a"]}
    dump_lines += [f"  {k} {'.' * (40 - len(k))} {v}" for k, v in args.items()]
    dump_lines.append("-------------------- end of arguments ---------------------")
    dump = parse_argument_dump("\n".join(["some banner"] + dump_lines + ["training ..."]))
    job = import_argument_dump(dump, "run.log", STACK)
    assert job.gpus == 8 and job.plan.dp == 4 and job.plan.distributed_optimizer
    assert job.model.activation.value == "swiglu" and not job.model.tied_embeddings and not job.model.has_bias


def test_bridge_yaml_refuses_unknown_sections_and_reads_its_recipe():
    model, cluster = load_model("llama3-70b"), load_cluster("h800", gpus=64)
    plan = PlanSpec(tp=4, pp=4, dp=4, virtual_stages=5, sequence_parallel=True, global_batch_size=64)
    text = export_launch(LaunchFormat.MEGATRON_BRIDGE, model, plan, STACK, cluster).text
    assert "# recipe: llama3_70b_pretrain_config" in text
    with pytest.raises(CannotImport, match="peft"):
        import_launch(text + "peft: {dim: 8}\n", "x.yaml", STACK)
    with pytest.raises(CannotExpress, match="recipe"):
        export_launch(LaunchFormat.MEGATRON_BRIDGE, load_model("gpt-13b"), PlanSpec(dp=8, global_batch_size=8), STACK,
                      load_cluster("h800", gpus=8))


def test_torchtitan_import_reads_fsdp_and_refuses_tp_without_it():
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = -1\n'
            '[activation_checkpoint]\nmode = "full"\n')
    job = import_launch(text, "job.toml", STACK, gpus=8)
    assert job.plan.sharding.value == "parameters" and job.plan.dp == 8 and job.stack.name == "torchtitan"
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[parallelism]\ndata_parallel_shard_degree = 1\n'
            'data_parallel_replicate_degree = 4\ntensor_parallel_degree = 2\n')
    with pytest.raises(CannotImport, match="FSDP2"):
        import_launch(text, "job.toml", STACK, gpus=8)


NEMO = (Path(__file__).parent / "launch_data" / "nemo_llama3_8b.yaml").read_text()


def test_a_nemo_training_yaml_imports_with_the_vocabulary_of_its_shape():
    job = import_launch(NEMO, "nemo.yaml", STACK)
    assert job.model.name == "llama3-8b" and job.gpus == 16 and job.gpus_per_node == 8
    assert (job.plan.tp, job.plan.dp, job.plan.global_batch_size) == (2, 8, 128)
    assert job.plan.recompute.value == "selective" and job.plan.sequence_parallel and job.plan.distributed_optimizer
    assert job.stack.tp_comm_overlap and "preset llama3-8b" in job.notes[0]


@pytest.mark.parametrize("old, new, setting", [
    ("rampup_batch_size: null", "rampup_batch_size: [16, 16, 1000]", "rampup_batch_size"),
    ("megatron_amp_O2: true", "megatron_amp_O2: false", "megatron_amp_O2"),
    ("precision: bf16", "precision: 32", "trainer.precision"),
    ("hidden_size: 4096", "hidden_size: 4160", "model.tokenizer"),  # no preset of that shape: vocabulary unknown
    ("name: mcore_distributed_optim", "name: lamb", "model.optim.name"),
])
def test_a_nemo_yaml_setting_that_is_not_modelled_is_refused_by_name(old, new, setting):
    assert old in NEMO
    with pytest.raises(CannotImport, match=setting.replace(".", r"\.")):
        import_launch(NEMO.replace(old, new), "nemo.yaml", STACK)


def test_the_allocator_the_memory_counts_on_is_in_the_launch_and_read_back():
    """A stack with expandable segments (the fragmentation memory.yaml measured for them) exports the
    environment that sets them; a Megatron-LM launch read back takes its allocator from its environment."""
    model, cluster = load_model("llama3-8b"), load_cluster("h800", gpus=16)
    plan = PlanSpec(tp=2, dp=8, global_batch_size=64, distributed_optimizer=True)
    expandable, default = load_stack("megatron-core"), load_stack("megatron-core").replace(cuda_allocator="default")
    out = export_launch(LaunchFormat.MEGATRON_LM, model, plan, expandable, cluster)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out.text
    assert "PYTORCH_CUDA_ALLOC_CONF" not in export_launch(LaunchFormat.MEGATRON_LM, model, plan, default, cluster).text
    assert import_launch(out.text, "job.sh", default).stack.cuda_allocator.value == "expandable_segments"
    plain = out.text.replace("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n", "")
    assert import_launch(plain, "job.sh", expandable).stack.cuda_allocator.value == "expandable_segments"  # set elsewhere
    turned_off = out.text.replace("expandable_segments:True", "expandable_segments:False,max_split_size_mb:512")
    assert import_launch(turned_off, "job.sh", expandable).stack.cuda_allocator.value == "default"
    titan = export_launch(LaunchFormat.TORCHTITAN, model, PlanSpec(dp=16, global_batch_size=64, sharding="parameters"),
                          load_stack("torchtitan"), cluster)
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True torchrun" in titan.text
