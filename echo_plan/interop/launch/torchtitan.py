"""torchtitan's job config (TOML, read by torchtitan 0.2 with ``--job.config_file``), both ways.

torchtitan builds its models from named flavours (:data:`FLAVOURS`), so only those shapes export.
Its data parallelism beside tensor, pipeline or context parallelism is FSDP2, and its mixed precision
comes with FSDP (without it, a TP or PP job trains in fp32, a pure data-parallel one under autocast).
A plan with ``--sharding parameters`` exports as FSDP2 (HSDP with a shard degree: torchtitan's mesh is
dp_replicate x dp_shard x cp, FSDP sharding over dp_shard x cp), with its pipeline split as explicit
module lists, float8 (tensorwise) as torchao's converter, torch.compile and async TP from the stack;
a pure data-parallel plan exports as DDP. What torchtitan cannot run as simulated (optimizer-only
sharding, Megatron's module recompute, layer counts its every-n-th-layer checkpointing cannot make) is refused with the
knob, on export and on import alike.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from echo_plan.interop.launch.job import (
    ALLOC_CONF_NEW, EXPANDABLE, CannotExpress, CannotImport, LaunchExport, LaunchFormat, LaunchJob, preset_of_shape, virtual_split,
)
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec, load_model, load_stack
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import DpComm, Recompute, Schedule
from echo_plan.specs.software import AttentionLibrary, CudaAllocator, Fp8Recipe, OptimizerSharding
from echo_plan.specs.software_kinds import CrossEntropy, OptimizerOffload, RecomputePolicy

FMT = LaunchFormat.TORCHTITAN
# echo-plan model preset -> torchtitan (model.name, model.flavor) of the same shape (torchtitan 0.2)
FLAVOURS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B"),
            "deepseek-v3": ("deepseek_v3", "671B"), "qwen3-30b-a3b": ("qwen3", "30B-A3B"),
            "qwen3-235b-a22b": ("qwen3", "235B-A22B")}
NEEDS_FSDP = "needs torchtitan's FSDP2: simulate the plan with --sharding parameters"
NEEDS_TT = "simulate the plan with --stack torchtitan to export it"
AC_MODES = {Recompute.NONE: "none", Recompute.FULL: "full"}
REDUCE_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}  # training.mixed_precision_reduce -> grad_reduce_dtype
ROTATE_METHODS = {"allgather": "all_gather", "alltoall": "p2p"}  # context_parallel_rotate_method -> cp_comm
SCHEDULES = {Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED: "Interleaved1F1B", Schedule.GPIPE: "GPipe"}
FLOAT8 = "quantize.linear.float8"  # torchtitan 0.2's converter name for torchao's float8 linears
AUTOCAST_NOTE = ("torchtitan without FSDP keeps fp32 weights under bf16 autocast: 16 bytes per parameter for weights, "
                 "gradients and Adam states where the simulation counts 18 (bf16 weights, fp32 gradients, master "
                 "weights and moments), and it casts every weight to bf16 in each micro-batch's forward")
FSDP_NOTE = ("torchtitan's pipeline split counts the embedding and the output layer as a layer each by default; the "
             "simulated split is written as module lists (module_fqns_per_model_part), so it runs as simulated")


def _flavour(model: ModelSpec) -> tuple[str, str]:
    preset = preset_of_shape(model, among=FLAVOURS)
    if preset is not None:
        return FLAVOURS[preset]
    raise CannotExpress(FMT, "model", model.name, "torchtitan builds models from its flavours ("
                        + ", ".join(f"{n} {f}" for n, f in FLAVOURS.values()) + "); this shape is none of them")


# fused-attention libraries PyTorch's SDPA has no backend for
NOT_SDPA = {AttentionLibrary.FLASH_ATTN_TRITON: "Triton FlashAttention", AttentionLibrary.FLASH_ATTN_3: "FlashAttention-3"}


def _refuse(plan: PlanSpec, stack: SoftwareSpec) -> bool:
    """Raise CannotExpress for what torchtitan cannot run as simulated; True when the plan is FSDP2."""
    level = DataParallelSharding.of(plan, stack)
    fsdp = level.parameters
    if stack.attention_library in NOT_SDPA:
        raise CannotExpress(FMT, "attention_library", stack.attention_library.value,
                            f"torchtitan runs SDPA (FlashAttention-2 or cuDNN), not the {NOT_SDPA[stack.attention_library]}"
                            " the plan was simulated with; simulate with another stack to export")
    if plan.offload_optimizer and stack.optimizer_offload is not OptimizerOffload.FSDP2:
        raise CannotExpress(FMT, "optimizer_offload", stack.optimizer_offload.value, "torchtitan offloads with "
                            "FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer states); the plan was "
                            "simulated with another framework's offload: simulate with --stack torchtitan")
    if plan.distributed_optimizer and plan.shard_group_size % plan.cp:
        raise CannotExpress(FMT, "shard_degree", plan.shard_group_size, f"torchtitan shards over dp_shard x cp: a "
                                                                       f"multiple of cp {plan.cp}")
    if plan.distributed_optimizer and plan.shard_group_size == 1:
        raise CannotExpress(FMT, "shard_degree", 1, "shards of one rank are plain data parallelism: export the plan "
                                                    "with --sharding none")
    if plan.distributed_optimizer and not fsdp:
        raise CannotExpress(FMT, "sharding", level.level.value, "torchtitan shards parameters with FSDP2, not "
                                                                "optimizer states or gradients alone; " + NEEDS_FSDP)
    if not fsdp and plan.tp * plan.pp * plan.cp * plan.ep > 1:
        knob = next(k for k in ("tp", "pp", "cp", "ep") if getattr(plan, k) > 1)
        raise CannotExpress(FMT, knob, getattr(plan, knob), "torchtitan trains in bf16 beside tensor, pipeline, "
                                                            "context or expert parallelism only under FSDP2; " + NEEDS_FSDP)
    if plan.ep > 1 or plan.expert_tp != plan.tp:
        raise CannotExpress(FMT, "ep", plan.ep, "torchtitan's expert parallelism is not modelled here")
    if plan.tp > 1 and not plan.sequence_parallel:
        raise CannotExpress(FMT, "sequence_parallel", False, "torchtitan's tensor parallelism always shards the "
                                                             "norms over the sequence (add --sequence-parallel)")
    if plan.recompute is Recompute.SELECTIVE and stack.recompute_policy is not RecomputePolicy.OPS:
        raise CannotExpress(FMT, "recompute", plan.recompute.value, "torchtitan's selective checkpointing saves "
                                                                     "by op policy, not Megatron's recompute modules")
    if plan.recompute is Recompute.SELECTIVE and plan.recompute_layers:
        raise CannotExpress(FMT, "recompute_layers", plan.recompute_layers, "torchtitan runs one selective "
                            "checkpointing at a time: its per-op policy or every n-th layer, not both")
    if plan.pp > 1 and plan.schedule not in SCHEDULES:
        raise CannotExpress(FMT, "schedule", plan.schedule.value, "exported schedules: "
                            + ", ".join(s.value for s in SCHEDULES))
    if plan.dtype is DType.FP4:
        raise CannotExpress(FMT, "dtype", "fp4", "the exported torchtitan 0.2 job trains in bf16 or torchao's float8 "
                                                 "(its MX/NVFP4 quantisation is not exported)")
    if plan.dtype is DType.FP16 or (plan.dtype is DType.FP8 and not fsdp and plan.tp == 1):
        raise CannotExpress(FMT, "dtype", plan.dtype.value, "torchtitan trains in bf16, or float8 under FSDP2 or TP")
    if plan.dtype is DType.FP8 and stack.fp8_recipe is not Fp8Recipe.CURRENT:
        raise CannotExpress(FMT, "fp8_recipe", stack.fp8_recipe.value, "torchao's float8 linears scale per tensor "
                                                                       "from this step's amax (fp8_recipe current)")
    if plan.dp_comm is not DpComm.DENSE:
        raise CannotExpress(FMT, "dp_comm", plan.dp_comm.value, "torchtitan exchanges dense gradients only")
    if stack.grad_bytes(plan.param_dtype) != 4:
        raise CannotExpress(FMT, "grad_reduce_dtype", "bf16", "torchtitan reduces fp32 gradients")
    if fsdp and not stack.fsdp_copy_kernels:
        raise CannotExpress(FMT, "fsdp_copy_kernels", False, "torchtitan shards with FSDP2, whose copy kernels this "
                                                             "plan was simulated without; " + NEEDS_TT)
    if fsdp and (stack.fused_norm or stack.fused_elementwise != bool(stack.torch_compile)):
        # torchtitan's norms and elementwise chains are its eager modules, fused only inside compiled blocks: a plan
        # simulated with another framework's fused kernels (Transformer Engine's, AutoModel's) is another step
        field = "fused_norm" if stack.fused_norm else "fused_elementwise"
        raise CannotExpress(FMT, field, str(getattr(stack, field)).lower(), "torchtitan fuses norms and "
                            "elementwise chains only by compiling its blocks; " + NEEDS_TT)
    loss = CrossEntropy.TORCH_COMPILED if stack.torch_compile else CrossEntropy.TORCH
    if fsdp and stack.cross_entropy is not loss:  # an FSDP stack of another framework (olmo-core's fp32 logits)
        raise CannotExpress(FMT, "cross_entropy", stack.cross_entropy.value, f"torchtitan's loss with torch_compile "
                                                                             f"{str(stack.torch_compile).lower()} is "
                                                                             f"{loss.value}; " + NEEDS_TT)
    if stack.tp_comm_overlap and plan.tp > 1 and not stack.fused_elementwise:
        raise CannotExpress(FMT, "tp_comm_overlap", True, "torchtitan's async TP needs torch.compile "
                                                          "(torch_compile: true)")
    return fsdp


def _parts(model: ModelSpec, plan: PlanSpec) -> list[list[str]]:
    """The modules of each pipeline stage (virtual stages in model order), as torchtitan names them."""
    parts, first = [], 0
    split = virtual_split(plan, model)
    for vs, n in enumerate(split):
        mods = (["tok_embeddings"] if vs == 0 else []) + [f"layers.{i}" for i in range(first, first + n)]
        parts.append(mods + (["norm", "output"] if vs == len(split) - 1 else []))
        first += n
    return parts


def _checkpointing(model: ModelSpec, plan: PlanSpec) -> list[str]:
    """The [activation_checkpoint] settings: none, full, the per-op policy, or every n-th layer. torchtitan's layer
    checkpointing wraps every n-th block a rank builds (one counter over all its chunks), so the plan's
    recompute_layers K of each chunk is n = chunk / K when every chunk has the same multiple of K layers; which
    K layers of a chunk are recomputed changes neither its memory nor its step (all are held until its backward)."""
    if plan.recompute is Recompute.SELECTIVE:
        return ['mode = "selective"', 'selective_ac_option = "op"']
    if not plan.recompute_layers:
        return [f'mode = "{AC_MODES[plan.recompute]}"']
    k, sizes = plan.recompute_layers, set(virtual_split(plan, model))
    size = next(iter(sizes))
    if len(sizes) > 1 or size % k:
        raise CannotExpress(FMT, "recompute_layers", k, f"torchtitan checkpoints every n-th layer a rank builds: "
                            f"{k} of each chunk needs chunks of {k} x n layers, these have "
                            f"{', '.join(map(str, sorted(sizes)))}")
    return ['mode = "selective"', f'selective_ac_option = "{size // k}"']


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
    sizes = set(virtual_split(PlanSpec.build(fields, context=source), model))
    if len(sizes) > 1 or next(iter(sizes)) % n:
        raise CannotImport(source, "activation_checkpoint.selective_ac_option", option, "a divisor of every "
                           f"pipeline chunk's layers, the same in each (these chunks have "
                           f"{', '.join(map(str, sorted(sizes)))}: a plan recomputes one count of each)")
    size = next(iter(sizes))
    return {"recompute": "full"} if n == 1 else {"recompute": "none", "recompute_layers": size // n}


def export_torchtitan(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, cluster: ClusterSpec) -> LaunchExport:
    name, flavour = _flavour(model)
    fsdp = _refuse(plan, stack)
    shard = plan.shard_group_size // plan.cp if fsdp else 1
    replicate = plan.grad_dp // plan.shard_group_size if fsdp else plan.dp
    local = plan.micro_batch_size if plan.pp == 1 else plan.global_batch_size // plan.dp
    expandable = stack.cuda_allocator is CudaAllocator.EXPANDABLE_SEGMENTS  # as run_train.sh launches it
    lines = [f"# echo-plan: {model.name}, {plan.short()}, stack {stack.name}, {plan.world_size} GPUs",
             f"# launch: {f'{ALLOC_CONF_NEW}={EXPANDABLE} ' if expandable else ''}torchrun "
             f"--nnodes {cluster.num_nodes} --nproc-per-node {cluster.gpus_per_node} "
             "-m torchtitan.train --job.config_file THIS_FILE.toml",
             "[job]", f'description = "echo-plan {plan.short()}"',
             "[model]", f'name = "{name}"', f'flavor = "{flavour}"']
    if plan.dtype is DType.FP8:
        lines.append(f'converters = ["{FLOAT8}"]')
    lines += ["[training]", f"local_batch_size = {local}", f"global_batch_size = {plan.global_batch_size}",
              f"seq_len = {model.seq_length}"] + (["enable_cpu_offload = true"] if plan.offload_optimizer else []) + [
              "[parallelism]", f"data_parallel_replicate_degree = {replicate}",
              f"data_parallel_shard_degree = {shard}", f"tensor_parallel_degree = {plan.tp}",
              f"pipeline_parallel_degree = {plan.pp}", f"context_parallel_degree = {plan.cp}"]
    if fsdp:
        policy = ("default" if plan.reshard_after_forward is None
                  else "always" if plan.reshard_after_forward else "never")
        lines.append(f'fsdp_reshard_after_forward = "{policy}"')
    if plan.tp > 1:
        lines.append(f"enable_async_tensor_parallel = {str(stack.tp_comm_overlap).lower()}")
    if plan.cp > 1:
        method = {v: k for k, v in ROTATE_METHODS.items()}[stack.cp_comm.value]
        lines.append(f'context_parallel_rotate_method = "{method}"')
    if plan.pp > 1:
        lines += [f'pipeline_parallel_schedule = "{SCHEDULES[plan.schedule]}"',
                  f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}",
                  "module_fqns_per_model_part = [" + ", ".join(
                      "[" + ", ".join(f'"{m}"' for m in part) + "]" for part in _parts(model, plan)) + "]"]
    if stack.optimizer_in_backward:
        lines += ["[optimizer]", "early_step_in_backward = true"]
    lines += ["[activation_checkpoint]"] + _checkpointing(model, plan) + [
              "[compile]", f"enable = {str(stack.fused_elementwise).lower()}", 'components = ["model", "loss"]']
    if plan.dtype is DType.FP8:
        gather = str(bool(stack.fp8_param_gather) and fsdp).lower()
        lines += ["[quantize.linear.float8]", 'recipe_name = "tensorwise"',
                  f"enable_fsdp_float8_all_gather = {gather}", f"precompute_float8_dynamic_scale_for_fsdp = {gather}"]
    notes = (FSDP_NOTE,) if fsdp and plan.pp > 1 else () if fsdp else (AUTOCAST_NOTE,)
    env = {ALLOC_CONF_NEW: EXPANDABLE} if expandable else {}
    return LaunchExport(FMT, "\n".join(lines) + "\n", env, notes=notes)


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
