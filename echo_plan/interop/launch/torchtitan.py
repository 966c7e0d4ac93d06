"""torchtitan's job config (TOML, read by torchtitan 0.2 with ``--job.config_file``), written from a plan (the import,
``torchtitan_import.py``, reads it back with the tables here).

torchtitan builds its models from named flavours (:data:`FLAVOURS`), so only those shapes export.
Its data parallelism beside tensor, pipeline or context parallelism is FSDP2, and its mixed precision
comes with FSDP (without it, a TP or PP job trains in fp32, a pure data-parallel one under autocast).
A plan with ``--sharding parameters`` exports as FSDP2 (HSDP with a shard degree: torchtitan's mesh is
dp_replicate x dp_shard x cp, FSDP sharding over dp_shard x cp), with its pipeline split as explicit
module lists, float8 (tensorwise) as torchao's converter, torch.compile and async TP from the stack;
a pure data-parallel plan exports as DDP. What torchtitan cannot run as simulated (optimizer-only
sharding, Megatron's module recompute, layer counts its every-n-th-layer checkpointing cannot make) is refused
with the knob, on export and on import alike.
"""

from __future__ import annotations

from echo_plan.interop.launch.job import (
    ALLOC_CONF_NEW, EXPANDABLE, CannotExpress, LaunchExport, LaunchFormat, preset_of_shape, virtual_split,
)
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import DpComm, Recompute, Schedule
from echo_plan.specs.software import AttentionLibrary, CudaAllocator, Fp8Recipe
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
