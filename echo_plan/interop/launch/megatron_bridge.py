"""Megatron-Bridge: the override set of a recipe's ``ConfigContainer``, as a YAML file, both ways.

A Bridge recipe (``llama3_70b_pretrain_config``...) builds the model from its Hugging Face config,
with the activation as a Python callable that YAML cannot hold; so a plan exports onto the recipe
of its model (:data:`RECIPES`), and the YAML overrides the shape fields (equal to the recipe's,
written so the file says what was simulated), the parallel layout, batch, recompute, precision
(``mixed_precision``), overlaps and optimizer sharding. The file's first lines name the recipe
and the launch, so an import knows the model and the GPU count.
"""

from __future__ import annotations

import re
from typing import Any

from echo_plan.files import parse_yaml
from echo_plan.interop.launch.job import (
    CannotExpress, CannotImport, LaunchExport, LaunchFormat, LaunchJob, preset_of_shape,
)
from echo_plan.interop.launch.mcore import to_mcore
from echo_plan.interop.launch.mcore_read import job_from_mcore
from echo_plan.interop.launch.megatron_lm import command_tokens, environment, launcher_gpus
from echo_plan.interop.launch.nemo import import_nemo, is_nemo
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec, load_model

FMT = LaunchFormat.MEGATRON_BRIDGE
# echo-plan model preset -> Megatron-Bridge recipe (megatron.bridge.recipes, 0.3)
RECIPES = {"gpt3-175b": "gpt3_175b_pretrain_config", "llama3-8b": "llama3_8b_pretrain_config",
           "llama3-70b": "llama3_70b_pretrain_config", "llama3-405b": "llama31_405b_pretrain_config",
           "deepseek-v3": "deepseek_v3_pretrain_config", "qwen3-30b-a3b": "qwen3_30b_a3b_pretrain_config",
           "qwen3-235b-a22b": "qwen3_235b_a22b_pretrain_config"}
PRECISION_KEYS = ("bf16", "fp16", "fp8", "fp8_recipe", "fp8_param", "fp4", "fp4_recipe", "fp4_param")
# set by the recipe (the activation is a callable), or Megatron-LM's only (GPTModelProvider has seq_length alone)
NOT_IN_YAML = ("activation", "max_position_embeddings")


def export_megatron_bridge(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec,
                           cluster: ClusterSpec) -> LaunchExport:
    base = preset_of_shape(model, among=RECIPES)
    if base is None:
        raise CannotExpress(FMT, "model", model.name, "no Megatron-Bridge recipe has this shape (its activation "
                                                      "is a Python callable no YAML override can set); recipes: "
                                                      + ", ".join(sorted(RECIPES)))
    sec = to_mcore(model, plan, stack, FMT)
    m = {k: v for k, v in sec["model"].items() if k not in PRECISION_KEYS + NOT_IN_YAML}
    mp = {"bf16": sec["model"]["bf16"], "fp16": sec["model"]["fp16"]}
    if sec["model"].get("fp8"):
        mp.update(fp8=sec["model"]["fp8"], fp8_recipe=sec["model"]["fp8_recipe"],
                  fp8_param_gather=sec["model"]["fp8_param"])
        if sec["ddp"].get("reuse_grad_buf_for_mxfp8_param_ag"):  # bf16_with_mxfp8_mixed sets it there too
            mp["reuse_grad_buf_for_mxfp8_param_ag"] = True
    if sec["model"].get("fp4"):  # bf16_with_nvfp4_mixed
        mp.update(fp4=sec["model"]["fp4"], fp4_recipe=sec["model"]["fp4_recipe"],
                  fp4_param_gather=sec["model"]["fp4_param"])
    tp_overlap = m.pop("tp_comm_overlap")
    doc = {"model": m, "train": sec["train"], "ddp": sec["ddp"], "optimizer": sec["optimizer"],
           "mixed_precision": mp, "comm_overlap": {"tp_comm_overlap": tp_overlap},
           "dataset": {"sequence_length": model.seq_length}}
    env = environment(stack, plan)
    recipe = RECIPES[base]
    head = [f"# echo-plan: {model.name}, {plan.short()}, stack {stack.name}, {plan.world_size} GPUs",
            f"# recipe: {recipe} (megatron.bridge.recipes)",
            f"# launch: torchrun --nnodes {cluster.num_nodes} --nproc-per-node {cluster.gpus_per_node} "
            f"run_recipe.py --recipe {recipe} --config-file THIS_FILE.yaml",
            "# environment: " + " ".join(f"{k}={v}" for k, v in env.items())]
    return LaunchExport(FMT, "\n".join(head) + "\n" + _yaml(doc), env)


def _yaml(doc: dict[str, Any]) -> str:
    """Sections as blocks, one field a line; lists (recompute modules, MoE layer pattern) on one line."""
    import yaml  # deferred: the YAML writer

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=120)


def import_megatron_bridge(text: str, source: str, base_stack: SoftwareSpec, gpus: int | None = None) -> LaunchJob:
    """The job of a Bridge override YAML (this module's export, or a hand-written one with the same sections), or
    of a NeMo training YAML (``nemo.py``)."""
    doc = parse_yaml(text, source)
    if is_nemo(doc):  # NeMo 1.x / NeMo-Framework-Launcher: trainer: + model:
        return import_nemo(doc, source, base_stack, gpus)
    if not isinstance(doc, dict) or "model" not in doc:
        raise CannotImport(source, "YAML", None, "expected a Megatron-Bridge override file with a model: section")
    unknown = sorted(set(doc) - {"model", "train", "ddp", "optimizer", "mixed_precision", "comm_overlap", "dataset",
                                 "checkpoint", "logger", "tokenizer", "scheduler", "rng", "profiling", "dist"})
    if unknown:
        raise CannotImport(source, unknown[0], None, "not a ConfigContainer section echo-plan reads")
    recipe = re.search(r"^#\s*recipe:\s*(\S+)", text, re.M)
    base_model = None
    if recipe:
        by_recipe = {r: p for p, r in RECIPES.items()}
        if recipe.group(1) not in by_recipe:
            raise CannotImport(source, "recipe", recipe.group(1), "known recipes: " + ", ".join(sorted(by_recipe)))
        base_model = load_model(by_recipe[recipe.group(1)])
    launch = re.search(r"^#\s*launch:\s*(.+)$", text, re.M)
    nodes = per_node = None
    if launch:
        nodes, per_node, _ = launcher_gpus(command_tokens(launch.group(1), source)[0], source)
    world = gpus if gpus is not None else (nodes * per_node if nodes and per_node else None)
    if world is None:
        raise CannotImport(source, "GPUs", None, "the file has no '# launch: torchrun --nnodes N --nproc-per-node G' "
                                                 "line; give the job's GPU count with --gpus")
    m = dict(doc.get("model") or {})
    if base_model is None and "activation" not in m:
        m["activation"] = "swiglu" if m.get("gated_linear_unit") else "gelu"
    mp = dict(doc.get("mixed_precision") or {})
    for key in ("bf16", "fp16", "fp8", "fp8_recipe", "fp4", "fp4_recipe"):
        if key in mp:
            m[key] = mp[key]
    for key in ("fp8", "fp4"):
        if f"{key}_param_gather" in mp:
            m[f"{key}_param"] = mp[f"{key}_param_gather"]
    m.setdefault("bf16", True)  # Bridge recipes train in bf16 (bf16_mixed) unless told otherwise
    if (doc.get("comm_overlap") or {}).get("tp_comm_overlap"):
        m["tp_comm_overlap"] = True
    sec = {"model": m, "train": dict(doc.get("train") or {}), "ddp": dict(doc.get("ddp") or {}),
           "optimizer": dict(doc.get("optimizer") or {})}
    return job_from_mcore(sec, base_stack, world, source, base_model=base_model, gpus_per_node=per_node)
