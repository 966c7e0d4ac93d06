"""Exported launch configs checked by the frameworks' own classes, where they install (the
``frameworks`` extra, installed by the README's test command): Megatron-Core's config dataclasses
(what Megatron-LM's arguments and Megatron-Bridge's ``model``/``ddp``/``optimizer`` sections
become), and torchtitan's own job-config parser. Megatron-Bridge itself imports Transformer Engine
(CUDA) and is not installed; its own sections were checked by hand against its 0.3.1 source
(docs/launch.md)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from echo_plan.interop.launch import CannotExpress, LaunchFormat, export_launch
from echo_plan.interop.launch.mcore import to_mcore
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from tests.interop.launch_searches import SEARCHES, STACK, _search_plans

# model-section keys that Megatron-LM's GPT builder / Bridge's GPTModelProvider read, not TransformerConfig
PROVIDER_ONLY = {"seq_length", "max_position_embeddings", "vocab_size", "share_embeddings_and_output_weights",
                 "position_embedding_type", "rotary_percent", "activation"}


# settings whose Megatron-Core check is that Transformer Engine's kernels are installed (a GPU environment),
# not a rule of the config: left at their defaults here
NEEDS_TE = {"moe_permute_fusion"}
OPTIMIZER_NEEDS_TE = {"use_precision_aware_optimizer", "exp_avg_dtype", "exp_avg_sq_dtype"}


def _sample(every: int = 7):
    for name in sorted(SEARCHES):
        model, cluster, plans = _search_plans(*SEARCHES[name])
        for plan in plans[::every]:
            yield name, model, cluster, plan, STACK
    deepseek = PlanSpec(pp=16, dp=128, ep=64, global_batch_size=15360, distributed_optimizer=True,
                        recompute="selective", layer_split=(3,) + (4,) * 14 + (2,), dtype="fp8")
    yield ("deepseek-v3", load_model("deepseek-v3"), load_cluster("h800", gpus=2048), deepseek,
           load_stack("deepseek-v3").replace(moe_act_input_fp8=False, fp8_kernels="transformer-engine",
                                             fp8_attention_output_e5m6=False))


def test_megatron_core_config_classes_accept_every_exported_plan(monkeypatch):
    assert _mcore_accepts(_sample(), monkeypatch) > 20


def _blackwell_sample():
    """Llama 3 70B as Megatron-Bridge's GB200 recipes run it, in MXFP8 and NVFP4 (with and without NVFP4
    parameters), and the 405B's split with empty end chunks."""
    model, cluster = load_model("llama3-70b"), load_cluster("gb200-nvl72", gpus=64)
    for dtype, stack in (("fp8", STACK.replace(fp8_recipe="mxfp8", fp8_param_gather=True)),
                         ("fp4", STACK.replace(fp4_param_gather=True)), ("fp4", STACK.replace(tp_comm_overlap=False))):
        plan = PlanSpec(tp=2, pp=4, dp=8, virtual_stages=5, global_batch_size=256, sequence_parallel=True,
                        distributed_optimizer=True, dtype=dtype)
        yield f"llama3-70b {dtype}", model, cluster, plan, stack
    big = load_model("llama3-405b")
    plan = PlanSpec(tp=4, pp=16, dp=4, virtual_stages=8, global_batch_size=1536, sequence_parallel=True,
                    distributed_optimizer=True, dtype="fp4", layer_split=(0,) + (1,) * 126 + (0,))
    yield "llama3-405b fp4", big, load_cluster("gb200-nvl72", gpus=256), plan, STACK


def test_megatron_core_config_classes_accept_blackwell_precisions(monkeypatch):
    assert _mcore_accepts(_blackwell_sample(), monkeypatch) == 4


def _mcore_accepts(samples, monkeypatch) -> int:
    """How many of ``samples`` (name, model, cluster, plan, stack) Megatron-Core's config classes build from
    their exported sections (a plan Megatron cannot run is skipped; a section a class refuses fails)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[frameworks]')")
    import megatron.core.utils
    from packaging.version import Version

    # the config's checks of the installed Transformer Engine answered as on a GPU machine with TE 2.10
    monkeypatch.setattr(megatron.core.utils, "get_te_version", lambda: Version("2.10.0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch
        import torch.nn.functional as F  # noqa: N812
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    checked = 0
    for name, model, cluster, plan, stack in samples:
        try:
            sec = to_mcore(model, plan, stack, LaunchFormat.MEGATRON_LM)
        except CannotExpress:
            continue
        m = dict(sec["model"])
        cls = MLATransformerConfig if m.get("multi_latent_attention") else TransformerConfig
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(m) - names - PROVIDER_ONLY
        assert not unknown, (name, plan.short(), unknown)
        act = m["activation"]
        kwargs = {k: v for k, v in m.items() if k in names and k not in NEEDS_TE}
        kwargs.update(gated_linear_unit=act == "swiglu", pipeline_dtype=torch.bfloat16,
                      activation_func={"swiglu": F.silu, "gelu": F.gelu}.get(act, F.relu))
        cls(**kwargs)  # Megatron-Core's own __post_init__ checks (layer splits, MoE, recompute, fp8...)
        DistributedDataParallelConfig(**sec["ddp"])
        opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
        assert set(sec["optimizer"]) <= opt_fields, sec["optimizer"]
        # the precision-aware optimizer's check is that TE's FusedAdam is installed: its fields are checked above
        opt = {k: v for k, v in sec["optimizer"].items() if k not in OPTIMIZER_NEEDS_TE}
        OptimizerConfig(bf16=m.get("bf16", False), **opt)
        checked += 1
    return checked


def test_torchtitan_parses_the_exported_toml(tmp_path):
    pytest.importorskip("torchtitan.config", reason="torchtitan is not installed (pip install -e '.[frameworks]')")
    from torchtitan.config import ConfigManager

    model, cluster = load_model("llama3-8b"), load_cluster("h800", gpus=16)
    plan = PlanSpec(dp=16, micro_batch_size=2, global_batch_size=128, recompute="full")
    path = tmp_path / "job.toml"
    path.write_text(export_launch(LaunchFormat.TORCHTITAN, model, plan, STACK, cluster).text)
    cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "8B")
    assert cfg.parallelism.data_parallel_replicate_degree == 16 and cfg.parallelism.data_parallel_shard_degree == 1
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size) == (2, 128)
    assert cfg.training.seq_len == model.seq_length and cfg.activation_checkpoint.mode == "full"


def test_torchtitan_flavours_have_the_shapes_echo_plan_simulates():
    pytest.importorskip("torchtitan.config", reason="torchtitan is not installed (pip install -e '.[frameworks]')")
    import importlib

    import torch

    from echo_plan.interop.launch.torchtitan import FLAVOURS

    for preset in ("llama3-8b", "llama3-70b"):
        name, flavour = FLAVOURS[preset]
        module = importlib.import_module(f"torchtitan.models.{name}")
        args = module.llama3_args[flavour] if hasattr(module, "llama3_args") else module.llama3_configs[flavour]
        spec = load_model(preset)
        args.vocab_size = spec.vocab_size
        with torch.device("meta"):
            built = module.Transformer(args)
        assert sum(p.numel() for p in built.parameters()) == spec.num_params, preset


def test_megatron_bridge_applies_the_override_yaml_to_its_recipe(tmp_path):
    pytest.importorskip("megatron.bridge.training.config", reason="Megatron-Bridge imports Transformer Engine "
                                                                   "(CUDA); it installs on GPU machines only")
    from megatron.bridge.recipes.llama.llama3 import llama3_70b_pretrain_config
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    model, cluster = load_model("llama3-70b"), load_cluster("h800", gpus=64)
    plan = PlanSpec(tp=4, pp=4, cp=2, dp=2, virtual_stages=5, sequence_parallel=True, distributed_optimizer=True,
                    global_batch_size=64)
    path = tmp_path / "overrides.yaml"
    path.write_text(export_launch(LaunchFormat.MEGATRON_BRIDGE, model, plan, STACK, cluster).text)
    cfg = process_config_with_overrides(llama3_70b_pretrain_config(), config_filepath=str(path))
    assert (cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size) == (4, 4)
    assert cfg.model.virtual_pipeline_model_parallel_size == 5 and cfg.train.global_batch_size == 64
