"""The checks a plan passes against its software stack before anything is simulated: the features it asks for
(tensor, sequence, context and pipeline parallelism, a sharded optimizer, selective recompute, its pipeline schedule) and its
precision on the GPU. Each raises SpecError naming the value and what is valid."""

from __future__ import annotations

from typing import Any

from echo_plan.errors import SpecError
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import PlanSpec, Recompute, Schedule, Sharding
from echo_plan.specs.software import (BLOCK_SCALED_MIN_SM_ARCH, AttentionKernel, Fp8Kernels, Fp8Recipe,
                                      OptimizerOffload, OptimizerSharding, RecomputePolicy, SoftwareSpec)


def check_precision(stack: SoftwareSpec, dtype: DType, gpu: Any, moe: bool = False, context: str = "plan") -> None:
    """Raise SpecError when the plan's precision recipe needs tensor cores ``gpu`` lacks (MXFP8 and NVFP4 scale
    blocks of 32 and 16 elements inside the GEMM, which Blackwell, sm100, does first), or meets a DeepSeek FP8
    setting of the stack that only its 1 x 128 tiles have (``moe``: an MoE model)."""
    dtype = DType(dtype)
    mx = dtype is DType.FP8 and stack.fp8_recipe is Fp8Recipe.MXFP8
    if mx and gpu.sm_arch < BLOCK_SCALED_MIN_SM_ARCH:
        raise SpecError("fp8_recipe", "mxfp8", f"MXFP8 needs block-scaled FP8 tensor cores (sm{BLOCK_SCALED_MIN_SM_ARCH}, "
                        f"Blackwell); GPU {gpu.name} is sm{gpu.sm_arch}: use --fp8-recipe current, delayed or blockwise "
                        "there", context)
    if moe and (mx or dtype is DType.FP4):
        what = "MXFP8" if mx else "NVFP4"
        for name in ("moe_dispatch_fp8", "moe_act_input_fp8"):  # DeepSeek's 1 x 128 FP8 tiles, not MX/NV blocks
            if getattr(stack, name):
                raise SpecError(name, True, f"DeepSeek's FP8 {'dispatch' if 'dispatch' in name else 'caching'} of "
                                f"1 x 128 tiles does not apply to {what} training; use a stack that sets it false, "
                                "or --fp8-recipe blockwise", context)
    if dtype in (DType.FP8, DType.FP4) and not (dtype is DType.FP8 and stack.fp8_recipe is Fp8Recipe.BLOCKWISE):
        what = "NVFP4" if dtype is DType.FP4 else f"the {stack.fp8_recipe.value} FP8 recipe"
        own = (("fp8_kernels", stack.fp8_kernels.value, stack.fp8_kernels is not Fp8Kernels.TRANSFORMER_ENGINE),
               ("fp8_attention_output_e5m6", True, stack.fp8_attention_output_e5m6))
        for name, value, on in own:
            if on:
                raise SpecError(name, value, f"DeepSeek's own FP8 kernels and E5M6 copy go with its 1 x 128 tiles "
                                f"(fp8_recipe: blockwise), not {what}; use a stack that sets it off, or "
                                "--fp8-recipe blockwise", context)


# offloads that move the whole optimizer or none of it, and why a share of it is not modelled
NO_SHARE = {OptimizerOffload.ZERO_OFFLOAD: "DeepSpeed's partial offload (ZeRO-3's Twin-Flow ratio) is not modelled",
            OptimizerOffload.FSDP2: "FSDP2's CPUOffloadPolicy moves the whole state"}


def check_stack_supports(stack: SoftwareSpec, *, sequence_parallel: bool, distributed_optimizer: bool,
                         selective_recompute: bool, context: str = "plan", cp: int = 1,
                         schedule: Schedule | None = None, pp: int = 1, tp: int = 1, recompute_layers: int = 0,
                         offload_optimizer: bool = False, offload_fraction: float = 1.0) -> None:
    """Raise SpecError when a plan asks for a feature the stack does not have."""
    no_share = NO_SHARE.get(stack.optimizer_offload)
    if offload_optimizer and offload_fraction != 1.0 and no_share:
        raise SpecError("offload_fraction", offload_fraction, f"1 on stack {stack.name}: {no_share}; stacks that "
                        "offload a share: megatron-core (megatron-hybrid)", context)
    if offload_optimizer and stack.optimizer_offload is OptimizerOffload.NONE:
        raise SpecError("offload_optimizer", True, f"stack {stack.name} sets optimizer_offload none: it cannot run "
                        "the optimizer on the CPU, or echo-plan does not model how it does; stacks that can: "
                        "megatron-core (megatron-hybrid), deepspeed-zero3 (zero-offload), torchtitan (fsdp2)", context)
    if recompute_layers and not stack.partial_recompute:
        raise SpecError("recompute_layers", recompute_layers, f"stack {stack.name} checkpoints every layer or none: use "
                        "--recompute full or none", context)
    for knob, degree, has, what in (("tp", tp, stack.tensor_parallel, "tensor"), ("cp", cp, stack.context_parallel,
                                     "context"), ("pp", pp, stack.pipeline_parallel, "pipeline")):
        if degree > 1 and not has:
            raise SpecError(knob, degree, f"stack {stack.name} has no {what} parallelism: use {knob} 1", context)
    if pp > 1 and schedule is not None and stack.pipeline_schedules and schedule not in stack.pipeline_schedules:
        raise SpecError("schedule", schedule.value, f"stack {stack.name} runs the pipeline schedules "
                        f"{', '.join(s.value for s in stack.pipeline_schedules)}", context)
    if cp > 1 and stack.attention is not AttentionKernel.FUSED:
        raise SpecError("cp", cp, f"context parallelism needs the fused attention kernel; stack {stack.name} runs "
                        f"{stack.attention.value} attention", context)
    if sequence_parallel and not stack.sequence_parallel:
        raise SpecError("sequence_parallel", True, f"stack {stack.name} has no sequence parallelism", context)
    if distributed_optimizer and stack.optimizer_sharding is OptimizerSharding.NONE:
        raise SpecError("distributed_optimizer", True, f"stack {stack.name} has no distributed optimizer", context)
    if selective_recompute and not stack.recompute_modules and stack.recompute_policy is RecomputePolicy.MODULES:
        raise SpecError("recompute", "selective", f"stack {stack.name} has no selective recomputation "
                        "(its recompute_modules is empty); use none or full", context)


def _require(rows: tuple[tuple[str, Any, bool, str], ...], why: str) -> None:
    """Raise for the first (knob, value, ok, valid values) row not ok: ``knob=value is invalid: valid, why``."""
    for knob, value, ok, valid in rows:
        if not ok:
            raise SpecError(knob, value, f"{valid}, {why}", "plan")


def check_fsdp2_offload(stack: SoftwareSpec, plan: PlanSpec) -> None:
    """FSDP2's CPUOffloadPolicy as modelled: the parameters sharded, the whole state on the host, one micro-batch a
    step and no pipeline (with more, FSDP2 accumulates each gradient on the CPU, blocking, in the backward pass:
    not modelled)."""
    if not (plan.offload_optimizer and stack.optimizer_offload is OptimizerOffload.FSDP2):
        return
    _require((
        ("sharding", getattr(plan.sharding, "value", None), plan.sharding in (None, Sharding.PARAMETERS),
         "parameters (FSDP2 offloads its sharded parameters with their optimizer states)"),
        ("pp", plan.pp, plan.pp == 1, "1: under a pipeline FSDP2 accumulates gradients on the CPU, not modelled"),
        ("micro-batches per step", plan.num_microbatches, plan.num_microbatches == 1,
         "1 (global batch = dp x micro-batch): with gradient accumulation FSDP2 adds each micro-batch's "
         "gradients on the CPU, blocking, which is not modelled")),
        f"to offload with stack {stack.name}'s FSDP2 CPUOffloadPolicy")


def check_optimizer_in_backward(stack: SoftwareSpec, plan: PlanSpec) -> None:
    """A step inside the backward (stack ``optimizer_in_backward``) as torchtitan runs it and as modelled: FSDP, one
    micro-batch a step (it steps once per backward), no pipeline or expert parallelism (torchtitan refuses both)."""
    if not stack.optimizer_in_backward:
        return
    fsdp = plan.sharding is Sharding.PARAMETERS or (  # named, or the stack's own level under --distributed-optimizer
        plan.sharding is None and plan.distributed_optimizer and stack.optimizer_sharding is OptimizerSharding.PARAMS)
    _require((
        ("sharding", getattr(plan.sharding, "value", None), fsdp, "parameters (modelled with FSDP)"),
        ("pp", plan.pp, plan.pp == 1, "1 (torchtitan refuses it under a pipeline)"),
        ("ep", plan.ep, plan.ep == 1, "1 (torchtitan refuses it with expert parallelism)"),
        ("micro-batches per step", plan.num_microbatches, plan.num_microbatches == 1,
         "1 (global batch = dp x micro-batch): it steps once per backward")),
        f"for stack {stack.name}'s optimizer step in the backward (optimizer_in_backward)")


def check_plan_supported(stack: SoftwareSpec, plan: PlanSpec) -> None:
    """:func:`check_stack_supports` for what ``plan`` asks of the stack (simulate, the search's pruning, the export)."""
    check_fsdp2_offload(stack, plan)
    check_optimizer_in_backward(stack, plan)
    check_stack_supports(stack, sequence_parallel=plan.sequence_parallel, distributed_optimizer=plan.distributed_optimizer,
                         selective_recompute=plan.recompute is Recompute.SELECTIVE, cp=plan.cp, schedule=plan.schedule,
                         pp=plan.pp, tp=plan.tp, recompute_layers=plan.recompute_layers,
                         offload_optimizer=plan.offload_optimizer, offload_fraction=plan.offload_fraction)
