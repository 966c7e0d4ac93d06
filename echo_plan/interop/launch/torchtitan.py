"""torchtitan's job config (TOML, read by torchtitan 0.1-0.2 with ``--job.config_file``), both ways.

torchtitan builds its models from named flavours (:data:`FLAVOURS`), so only those shapes export.
Its data parallelism beside tensor, pipeline or context parallelism is FSDP2 (ZeRO-3), and its
mixed precision comes with FSDP (without it, a TP or PP job trains in fp32, a pure data-parallel
one under autocast); echo-plan does not simulate FSDP yet (issue 34), so the plans this format
runs as simulated today are pure data-parallel ones (DDP, bf16 autocast). Every other plan is
refused with the knob that needs FSDP, on export and on import alike.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from echo_plan.interop.launch.job import (
    CannotExpress, CannotImport, LaunchExport, LaunchFormat, LaunchJob, preset_of_shape,
)
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec, load_model
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import DpComm, Recompute

FMT = LaunchFormat.TORCHTITAN
# echo-plan model preset -> torchtitan (model.name, model.flavor) of the same shape (torchtitan 0.2)
FLAVOURS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B"),
            "deepseek-v3": ("deepseek_v3", "671B"), "qwen3-30b-a3b": ("qwen3", "30B-A3B"),
            "qwen3-235b-a22b": ("qwen3", "235B-A22B")}
NEEDS_FSDP = "needs torchtitan's FSDP2, which echo-plan does not simulate yet (issue 34)"
AC_MODES = {Recompute.NONE: "none", Recompute.FULL: "full"}
AUTOCAST_NOTE = ("torchtitan without FSDP keeps fp32 weights under bf16 autocast: 16 bytes per parameter for weights, "
                 "gradients and Adam states where the simulation counts 18 (bf16 weights, fp32 gradients, master "
                 "weights and moments), and it casts every weight to bf16 in each micro-batch's forward")


def _flavour(model: ModelSpec) -> tuple[str, str]:
    preset = preset_of_shape(model, among=FLAVOURS)
    if preset is not None:
        return FLAVOURS[preset]
    raise CannotExpress(FMT, "model", model.name, "torchtitan builds models from its flavours ("
                        + ", ".join(f"{n} {f}" for n, f in FLAVOURS.values()) + "); this shape is none of them")


def _refuse(plan: PlanSpec, stack: SoftwareSpec) -> None:
    others = plan.tp * plan.pp * plan.cp * plan.ep > 1
    if plan.distributed_optimizer:
        raise CannotExpress(FMT, "distributed_optimizer", True, "torchtitan shards parameters with FSDP2, not "
                                                                "optimizer states alone (ZeRO-1); " + NEEDS_FSDP)
    if others:
        knob = next(k for k in ("tp", "pp", "cp", "ep") if getattr(plan, k) > 1)
        raise CannotExpress(FMT, knob, getattr(plan, knob), "torchtitan trains in bf16 beside tensor, pipeline, "
                                                            "context or expert parallelism only under FSDP2; "
                                                            + NEEDS_FSDP)
    if plan.recompute not in AC_MODES:
        raise CannotExpress(FMT, "recompute", plan.recompute.value, "torchtitan's selective checkpointing saves "
                                                                     "by op policy, not Megatron's recompute modules")
    if plan.dtype is not DType.BF16:
        raise CannotExpress(FMT, "dtype", plan.dtype.value, "torchtitan's float8 needs FSDP2 or TP here; without "
                                                            "them it trains under bf16 autocast only")
    if plan.dp_comm is not DpComm.DENSE:
        raise CannotExpress(FMT, "dp_comm", plan.dp_comm.value, "torchtitan exchanges dense gradients only")
    if stack.grad_bytes(plan.param_dtype) != 4:
        raise CannotExpress(FMT, "grad_reduce_dtype", "bf16", "DDP in torchtitan reduces fp32 gradients")


def export_torchtitan(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, cluster: ClusterSpec) -> LaunchExport:
    name, flavour = _flavour(model)
    _refuse(plan, stack)
    lines = [f"# echo-plan: {model.name}, {plan.short()}, stack {stack.name}, {plan.world_size} GPUs",
             f"# launch: torchrun --nnodes {cluster.num_nodes} --nproc-per-node {cluster.gpus_per_node} "
             "-m torchtitan.train --job.config_file THIS_FILE.toml",
             "[job]", f'description = "echo-plan {plan.short()}"',
             "[model]", f'name = "{name}"', f'flavor = "{flavour}"',
             "[training]", f"local_batch_size = {plan.micro_batch_size}",
             f"global_batch_size = {plan.global_batch_size}", f"seq_len = {model.seq_length}",
             "[parallelism]", f"data_parallel_replicate_degree = {plan.dp}", "data_parallel_shard_degree = 1",
             "tensor_parallel_degree = 1", "pipeline_parallel_degree = 1", "context_parallel_degree = 1",
             "[activation_checkpoint]", f'mode = "{AC_MODES[plan.recompute]}"']
    return LaunchExport(FMT, "\n".join(lines) + "\n", notes=(AUTOCAST_NOTE,))


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
    for knob in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree",
                 "expert_parallel_degree"):
        if int(par.get(knob, 1)) > 1:
            raise CannotImport(source, f"parallelism.{knob}", par[knob], NEEDS_FSDP)
    shard = int(par.get("data_parallel_shard_degree", -1))
    if shard != 1:
        raise CannotImport(source, "parallelism.data_parallel_shard_degree", shard, "FSDP2 " + NEEDS_FSDP)
    if model_sec.get("converters"):
        raise CannotImport(source, "model.converters", model_sec["converters"], "float8/MX training in "
                                                                                "torchtitan needs FSDP2 or TP here")
    mode = str(doc.get("activation_checkpoint", {}).get("mode", "selective"))
    if mode not in ("none", "full"):
        raise CannotImport(source, "activation_checkpoint.mode", mode, "none or full (torchtitan's selective and "
                                                                      "memory-budget modes are not modelled)")
    launch = re.search(r"--nnodes[ =](\d+).*--nproc[-_]per[-_]node[ =](\d+)", text)
    world = gpus if gpus is not None else (int(launch.group(1)) * int(launch.group(2)) if launch else None)
    dp = int(par.get("data_parallel_replicate_degree", 1))
    if world is None:
        world = dp
    if dp != world:
        raise CannotImport(source, "parallelism.data_parallel_replicate_degree", dp,
                           f"the job's {world} GPUs are all data-parallel replicas here")
    model = load_model(presets[key]).replace(seq_length=int(train.get("seq_len", 2048)))
    local = int(train.get("local_batch_size", 8))
    gbs = int(train.get("global_batch_size", -1))
    fields: dict[str, Any] = dict(dp=dp, micro_batch_size=local, global_batch_size=gbs if gbs > 0 else local * dp,
                                  recompute=mode)
    plan = PlanSpec.build(fields, context=source)
    notes = (f"simulated with stack {base_stack.name}'s kernels; torchtitan runs PyTorch's own (issue 34 adds a "
             "torchtitan stack)", AUTOCAST_NOTE)
    return LaunchJob(model=model, plan=plan, stack=base_stack, gpus=world,
                     gpus_per_node=int(launch.group(2)) if launch else None, source=source, notes=notes)
