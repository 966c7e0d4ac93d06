"""torchtitan's job config (TOML) read back into model, plan and stack (``import launch``, ``--from-launch``): what
torchtitan 0.2 runs from the file, its defaults filling what the file leaves out, and what it cannot simulate refused
with the key (the export and the shared tables: ``torchtitan.py``)."""

from __future__ import annotations

import re
import tomllib
from typing import Any

from echo_plan.interop.launch.job import CannotImport, LaunchJob, virtual_split
from echo_plan.interop.launch.torchtitan import (AUTOCAST_NOTE, FLAVOURS, FLOAT8, REDUCE_DTYPES, ROTATE_METHODS,
                                                 SCHEDULES)
from echo_plan.specs import ModelSpec, PlanSpec, SoftwareSpec, load_model, load_stack
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import every_nth_layer
from echo_plan.specs.software import Fp8Recipe, OptimizerSharding
from echo_plan.specs.software_kinds import CrossEntropy, RecomputePolicy


def _imported_checkpointing(doc: dict, model: ModelSpec, fields: dict[str, Any], stack: SoftwareSpec,
                            source: str) -> dict[str, Any]:
    """The plan's recompute fields from [activation_checkpoint] (torchtitan's defaults: selective, every 2nd
    layer): none and full as they are, the per-op policy as recompute selective on a stack whose selective
    recompute is that policy, every n-th layer as recompute_layers (each chunk's layers / n, which must divide)."""
    ac = doc.get("activation_checkpoint", {})
    mode, option = str(ac.get("mode", "selective")), str(ac.get("selective_ac_option", "2"))
    if mode in ("none", "full"):
        return {"recompute": mode}
    if mode != "selective":
        raise CannotImport(source, "activation_checkpoint.mode", mode, "none, full or selective (torchtitan's "
                                                                      "memory-budget mode is not modelled)")
    if option == "op":
        if stack.recompute_policy is not RecomputePolicy.OPS:
            raise CannotImport(source, "activation_checkpoint.selective_ac_option", option, f"the per-op policy "
                               f"needs a stack whose selective recompute is it (recompute_policy ops; {stack.name} "
                               f"has {stack.recompute_policy.value})")
        return {"recompute": "selective"}
    if not option.isdigit() or int(option) < 1:
        raise CannotImport(source, "activation_checkpoint.selective_ac_option", option, "op, or a positive "
                                                                                        "integer n: every n-th layer")
    n = int(option)
    sizes = virtual_split(PlanSpec.build(fields, context=source), model)
    count = every_nth_layer(sizes, n)
    if count is None:
        raise CannotImport(source, "activation_checkpoint.selective_ac_option", option, "a divisor of every "
                           f"pipeline chunk's layers, the same in each (these chunks have "
                           f"{', '.join(map(str, sorted(set(sizes))))}: a plan recomputes one count of each)")
    return {"recompute": "full"} if n == 1 else {"recompute": "none", "recompute_layers": count}


def _degree(par: dict, knob: str, source: str, default: int = 1) -> int:
    try:
        value = int(par.get(knob, default))
    except (TypeError, ValueError):
        raise CannotImport(source, f"parallelism.{knob}", par.get(knob), "an integer") from None
    if value < 1 and not (knob == "data_parallel_shard_degree" and value == -1):
        raise CannotImport(source, f"parallelism.{knob}", value, "a positive integer (-1: the GPUs left over)")
    return value


def _imported_stack(doc: dict, base_stack: SoftwareSpec, source: str) -> tuple[SoftwareSpec, DType]:
    """The stack the file runs (the torchtitan preset unless the user's own shards parameters too) and its dtype."""
    stack = base_stack if base_stack.optimizer_sharding is OptimizerSharding.PARAMS else load_stack("torchtitan")
    compile_ = doc.get("compile", {})
    parts = [str(c) for c in compile_.get("components", ["model", "loss"])]  # torchtitan 0.2's default: both
    if not set(parts) <= {"model", "loss"} or (compile_.get("enable") and "model" not in parts):
        raise CannotImport(source, "compile.components", parts, '["model", "loss"] or ["model"] (a compiled loss '
                                                               'beside eager blocks is not modelled)')
    compiled = bool(compile_.get("enable", False)) and "model" in parts
    changes: dict[str, Any] = {"torch_compile": compiled,
                               "tp_comm_overlap": bool(doc.get("parallelism", {}).get("enable_async_tensor_parallel",
                                                                                      False))}
    if compiled:  # the loss compiled with the blocks or not: what it keeps (cost/memory.py)
        changes["cross_entropy"] = CrossEntropy.TORCH_COMPILED if "loss" in parts else CrossEntropy.TORCH
    train = doc.get("training", {})
    param = str(train.get("mixed_precision_param", "bfloat16"))
    if param != "bfloat16":
        raise CannotImport(source, "training.mixed_precision_param", param, "bfloat16 (fp32 training is not modelled)")
    reduce = str(train.get("mixed_precision_reduce", "float32"))  # FSDP2's reduce dtype (0.2.2 takes float32 only)
    if reduce not in REDUCE_DTYPES:
        raise CannotImport(source, "training.mixed_precision_reduce", reduce, " or ".join(REDUCE_DTYPES))
    changes["grad_reduce_dtype"] = REDUCE_DTYPES[reduce]
    changes["optimizer_in_backward"] = bool(doc.get("optimizer", {}).get("early_step_in_backward", False))
    rotate = str(doc.get("parallelism", {}).get("context_parallel_rotate_method", "allgather"))  # torchtitan's default
    if rotate not in ROTATE_METHODS:
        raise CannotImport(source, "parallelism.context_parallel_rotate_method", rotate, " or ".join(ROTATE_METHODS))
    changes["cp_comm"] = ROTATE_METHODS[rotate]
    converters = [str(c) for c in doc.get("model", {}).get("converters", [])]
    dtype = DType.BF16
    for conv in converters:
        if conv not in (FLOAT8, "float8"):
            raise CannotImport(source, "model.converters", conv, f"{FLOAT8} (tensorwise float8) is modelled")
        f8 = doc.get("quantize", {}).get("linear", {}).get("float8", {}) or doc.get("float8", {})
        recipe = f8.get("recipe_name") or "tensorwise"
        if recipe != "tensorwise":
            raise CannotImport(source, "quantize.linear.float8.recipe_name", recipe, "tensorwise (fp8 current "
                                                                                     "scaling) is modelled")
        changes.update(fp8_recipe=Fp8Recipe.CURRENT, fp8_param_gather=bool(f8.get("enable_fsdp_float8_all_gather")))
        dtype = DType.FP8
    return stack.replace(**changes), dtype


def _split(par: dict, pp: int, layers: int, source: str) -> tuple[int, tuple[int, ...] | None]:
    """(virtual stages per rank, layers per virtual stage) from module_fqns_per_model_part, or as torchtitan 0.2 splits
    without it (``pipeline_parallel.py``): pp stages, or 2 a rank for a looped schedule, or as many as
    pipeline_parallel_layers_per_stage makes of the layers with the embedding and the output counted as
    pipeline_parallel_first/last_stage_less_layers layers (1 each), spread evenly, the remainder to the first."""
    parts = par.get("module_fqns_per_model_part")
    if parts:
        if len(parts) % pp:
            raise CannotImport(source, "parallelism.module_fqns_per_model_part", len(parts),
                               f"a multiple of pp {pp} parts")
        counts = tuple(sum(1 for m in part if re.fullmatch(r"layers\.\d+", str(m))) for part in parts)
        return len(parts) // pp, counts
    first, last = (_degree(par, f"pipeline_parallel_{k}_stage_less_layers", source, 1) for k in ("first", "last"))
    looped = par.get("pipeline_parallel_schedule", "1F1B") not in ("1F1B", "GPipe")
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    stages = pp * (2 if looped else 1) if per_stage is None else -(-(layers + first + last) //
                                                                    _degree(par, "pipeline_parallel_layers_per_stage",
                                                                            source))
    if stages % pp or (stages // pp > 1) != looped:
        raise CannotImport(source, "parallelism.pipeline_parallel_layers_per_stage", per_stage, f"a stage count that "
                           f"is {'2 or more' if looped else 'exactly 1'} a rank for this schedule ({stages} stages "
                           f"over pp {pp})")
    base, extra = divmod(layers + first + last, stages)
    counts = [base + (i < extra) for i in range(stages)]
    counts[0], counts[-1] = counts[0] - first, counts[-1] - last
    if min(counts) < 1:
        raise CannotImport(source, "parallelism.pipeline_parallel_degree", pp, f"stages that each hold a layer "
                           f"({layers} layers over {stages} stages with the embedding and output counted)")
    return stages // pp, tuple(counts)


def import_torchtitan(text: str, source: str, base_stack: SoftwareSpec, gpus: int | None = None) -> LaunchJob:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CannotImport(source, "TOML", None, f"malformed ({exc})") from None
    model_sec, train, par = doc.get("model", {}), doc.get("training", {}), doc.get("parallelism", {})
    key = (str(model_sec.get("name", "llama3")), str(model_sec.get("flavor", "debugmodel")))
    presets = {v: k for k, v in FLAVOURS.items()}
    if key not in presets:
        raise CannotImport(source, "model.flavor", " ".join(key), "flavours with an echo-plan model: "
                           + ", ".join(f"{n} {f}" for n, f in FLAVOURS.values()))
    if par.get("disable_loss_parallel") and _degree(par, "tensor_parallel_degree", source) > 1:
        raise CannotImport(source, "parallelism.disable_loss_parallel", True, "the loss gathers the whole vocabulary "
                           "on every tensor-parallel rank, which is not modelled (loss parallelism is)")
    if _degree(par, "expert_parallel_degree", source) > 1:
        raise CannotImport(source, "parallelism.expert_parallel_degree", par["expert_parallel_degree"],
                           "torchtitan's expert parallelism is not modelled here")
    tp, pp, cp = (_degree(par, k, source) for k in ("tensor_parallel_degree", "pipeline_parallel_degree",
                                                     "context_parallel_degree"))
    replicate = _degree(par, "data_parallel_replicate_degree", source)
    shard = _degree(par, "data_parallel_shard_degree", source, -1)
    launch = re.search(r"--nnodes[ =](\d+).*--nproc[-_]per[-_]node[ =](\d+)", text)
    world = gpus if gpus is not None else (int(launch.group(1)) * int(launch.group(2)) if launch else None)
    if shard == -1:
        if world is None:
            raise CannotImport(source, "parallelism.data_parallel_shard_degree", -1, "the GPUs left over: give "
                               "the job's GPUs (--gpus) or a torchrun line")
        shard = world // (replicate * tp * pp * cp)
    dp = replicate * shard
    world = world if world is not None else dp * tp * pp * cp
    if dp * tp * pp * cp != world:
        raise CannotImport(source, "parallelism", f"{replicate} x {shard} x {tp} x {pp} x {cp}",
                           f"dp_replicate x dp_shard x tp x pp x cp must be the job's {world} GPUs")
    fsdp = shard * cp > 1
    if not fsdp and tp * pp > 1:
        raise CannotImport(source, "parallelism.data_parallel_shard_degree", shard, "tensor or pipeline "
                           "parallelism without FSDP2 trains in fp32 in torchtitan, which is not modelled")
    stack, dtype = _imported_stack(doc, base_stack, source)
    model = load_model(presets[key]).replace(seq_length=int(train.get("seq_len", 2048)))
    local = int(train.get("local_batch_size", 8))
    gbs = int(train.get("global_batch_size", -1))
    gbs = gbs if gbs > 0 else local * dp
    fields: dict[str, Any] = dict(tp=tp, pp=pp, cp=cp, dp=dp, global_batch_size=gbs, dtype=dtype,
                                  sequence_parallel=tp > 1,
                                  micro_batch_size=int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1
                                  else local)
    if fsdp:
        policy = str(par.get("fsdp_reshard_after_forward", "default"))
        if policy not in ("default", "always", "never"):
            raise CannotImport(source, "parallelism.fsdp_reshard_after_forward", policy, "default, always or never")
        fields.update(sharding="parameters", shard_degree=shard * cp if replicate > 1 else None,
                      reshard_after_forward=None if policy == "default" else policy == "always",
                      offload_optimizer=bool(train.get("enable_cpu_offload", False)))
    elif train.get("enable_cpu_offload", False):
        raise CannotImport(source, "training.enable_cpu_offload", True, "with FSDP2 only (a data_parallel_shard_degree "
                                                                         "above 1): it is FSDP2's CPUOffloadPolicy")
    if pp > 1:
        sched = {v: k for k, v in SCHEDULES.items()}.get(str(par.get("pipeline_parallel_schedule", "1F1B")))
        if sched is None:
            raise CannotImport(source, "parallelism.pipeline_parallel_schedule", par["pipeline_parallel_schedule"],
                               ", ".join(SCHEDULES.values()))
        vpp, counts = _split(par, pp, model.num_layers, source)
        fields.update(schedule=sched, virtual_stages=vpp)
        if counts is not None and len(set(counts)) > 1:
            fields["layer_split"] = counts
    fields.update(_imported_checkpointing(doc, model, fields, stack, source))
    plan = PlanSpec.build(fields, context=source)
    notes = (f"simulated with stack {stack.name} (compile {stack.fused_elementwise}, async TP {stack.tp_comm_overlap}, "
             f"{stack.grad_reduce_dtype.value} gradient reduction and the optimizer step "
             f"{'in' if stack.optimizer_in_backward else 'after'} the backward as the file sets them)",) + (
        () if fsdp else (AUTOCAST_NOTE,))
    return LaunchJob(model=model, plan=plan, stack=stack, gpus=world,
                     gpus_per_node=int(launch.group(2)) if launch else None, source=source, notes=notes)
