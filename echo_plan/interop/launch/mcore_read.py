"""Megatron-Core config fields back into a plan and a stack (the reverse of ``mcore.to_mcore``).

The stack starts from a preset (``--stack``, default megatron-core) and takes every setting the
config states; what a config cannot state (Megatron-Core's version behaviour, such as where MoE
router probabilities are applied) stays the preset's, and the job's notes say so.
"""

from __future__ import annotations

from typing import Any, Mapping

from echo_plan.errors import EchoPlanError
from echo_plan.interop.launch.job import CannotImport, LaunchJob, canonical_plan
from echo_plan.interop.launch.mcore import FP4_FORMAT, FP4_RECIPE, FP8_RECIPES, RECOMPUTE_NAMES, as_bool, as_int, model_from_mcore, parse_layout
from echo_plan.specs import ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.specs.plan_checks import validate_experts
from echo_plan.specs.software import AttentionKernel, AttentionLibrary

ATTENTION = {"fused": (AttentionKernel.FUSED, AttentionLibrary.CUDNN),
             "flash": (AttentionKernel.FUSED, AttentionLibrary.FLASH_ATTN_2),
             "unfused": (AttentionKernel.UNFUSED, AttentionLibrary.CUDNN),
             "local": (AttentionKernel.UNFUSED, AttentionLibrary.CUDNN)}


def _stack(sec: Mapping[str, Mapping[str, Any]], base: SoftwareSpec, source: str) -> SoftwareSpec:
    m, ddp, opt = sec["model"], sec.get("ddp", {}), sec.get("optimizer", {})
    changes: dict[str, Any] = {}
    backend = m.get("attention_backend")
    if isinstance(backend, str) and backend.startswith("AttnBackend."):  # Megatron-LM's argument dump prints the enum
        backend = backend.split(".", 1)[1]
    if backend not in (None, "auto"):
        if str(backend) not in ATTENTION:
            raise CannotImport(source, "attention_backend", backend, "one of " + ", ".join(ATTENTION) + " or auto")
        changes["attention"], changes["attention_library"] = ATTENTION[str(backend)]
    for key in ("hidden_dropout", "attention_dropout"):
        if m.get(key) is not None:
            changes[key] = float(m[key])
    for key, field in (("gradient_accumulation_fusion", "gradient_accumulation_fusion"),
                       ("bias_dropout_fusion", "fused_elementwise"), ("overlap_p2p_comm", "overlap_p2p"),
                       ("moe_grouped_gemm", "moe_grouped_gemm"), ("moe_permute_fusion", "moe_permute_fusion"),
                       ("overlap_moe_expert_parallel_comm", "moe_a2a_overlap")):
        if m.get(key) is not None:
            changes[field] = as_bool(m[key])
    if as_bool(m.get("tp_comm_overlap", False)):
        changes["tp_comm_overlap"] = True
    dispatcher = m.get("moe_token_dispatcher_type")
    if dispatcher is not None:
        deepep = as_bool(m.get("moe_enable_deepep", False)) or m.get("moe_flex_dispatcher_backend") == "deepep"
        if dispatcher == "flex" and deepep:
            changes["moe_dispatcher"] = "deepep"
            if m.get("moe_deepep_num_sms") is not None:
                changes["moe_comm_sms"] = as_int(m, "moe_deepep_num_sms", source)
        elif dispatcher in ("alltoall", "allgather"):
            changes["moe_dispatcher"] = dispatcher
        else:
            raise CannotImport(source, "moe_token_dispatcher_type", dispatcher,
                               "alltoall, allgather, or flex with the deepep backend")
    if m.get("recompute_granularity") == "selective":
        modules = m.get("recompute_modules") or ["core_attn"]
        unknown = [x for x in modules if x not in RECOMPUTE_NAMES]
        if unknown:
            raise CannotImport(source, "recompute_modules", unknown[0], "echo-plan traces the recompute of "
                                                                        + ", ".join(sorted(RECOMPUTE_NAMES)))
        changes["recompute_modules"] = tuple(modules)
    if m.get("fp8") and m.get("fp4"):
        raise CannotImport(source, "fp4", m["fp4"], "FP4 and FP8 are exclusive (Megatron-LM: --fp4-format and "
                                                    "--fp8-format cannot be used together)")
    if m.get("fp8"):
        by_recipe = {recipe: ours for ours, (_, recipe) in FP8_RECIPES.items()}
        recipe = str(m.get("fp8_recipe") or "delayed")
        if recipe not in by_recipe:
            raise CannotImport(source, "fp8_recipe", recipe, "delayed, tensorwise, blockwise or mxfp8")
        changes["fp8_recipe"] = by_recipe[recipe]
        changes["fp8_param_gather"] = as_bool(m.get("fp8_param", False))
    if m.get("fp4"):
        if str(m.get("fp4_recipe") or FP4_RECIPE) != FP4_RECIPE or str(m["fp4"]) != FP4_FORMAT:
            raise CannotImport(source, "fp4_recipe", m.get("fp4_recipe"), f"{FP4_RECIPE} with fp4 {FP4_FORMAT} "
                                                                          "(Transformer Engine's NVFP4BlockScaling)")
        changes["fp4_param_gather"] = as_bool(m.get("fp4_param", False))
    if m.get("cp_comm_type") is not None:
        if m["cp_comm_type"] not in ("p2p", "all_gather"):
            raise CannotImport(source, "cp_comm_type", m["cp_comm_type"], "p2p or all_gather (a2a and a2a+p2p are "
                                                                          "not modelled)")
        changes["cp_comm"] = m["cp_comm_type"]
    if "grad_reduce_in_fp32" in ddp:
        changes["grad_reduce_dtype"] = "fp32" if as_bool(ddp["grad_reduce_in_fp32"]) else (
            "fp16" if as_bool(m.get("fp16", False)) else "bf16")
    if as_bool(ddp.get("use_distributed_optimizer", False)) and base.optimizer_sharding.value == "none":
        changes["optimizer_sharding"] = "states"
    if as_bool(opt.get("use_precision_aware_optimizer", False)):
        dtypes = {str(opt.get("exp_avg_dtype", "fp32")), str(opt.get("exp_avg_sq_dtype", "fp32"))}
        offloaded = as_bool(opt.get("optimizer_cpu_offload", False))  # the CPU AdamW keeps fp32 moments
        if dtypes in ({"bf16"}, {"torch.bfloat16"}) and not offloaded:
            changes["optimizer_state_bytes"] = 8.0
        elif dtypes not in ({"fp32"}, {"torch.float32"}):
            raise CannotImport(source, "exp_avg_dtype", sorted(dtypes), "bf16 moments (8 bytes per parameter) or "
                                                                        "the default fp32 ones")
    return base.replace(**changes) if changes else base


def _plan(sec: Mapping[str, Mapping[str, Any]], model: ModelSpec, gpus: int, source: str) -> PlanSpec:
    m, train, ddp = sec["model"], sec.get("train", {}), sec.get("ddp", {})
    tp = as_int(m, "tensor_model_parallel_size", source, 1)
    pp = as_int(m, "pipeline_model_parallel_size", source, 1)
    cp = as_int(m, "context_parallel_size", source, 1)
    if gpus % (tp * pp * cp):
        raise CannotImport(source, "GPUs", gpus, f"not a multiple of tp x pp x cp = {tp} x {pp} x {cp}")
    fields: dict[str, Any] = dict(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp),
                                  micro_batch_size=as_int(train, "micro_batch_size", source, 1),
                                  sequence_parallel=as_bool(m.get("sequence_parallel", False)))
    fields["global_batch_size"] = as_int(train, "global_batch_size", source, fields["micro_batch_size"] * fields["dp"])
    vpp = as_int(m, "virtual_pipeline_model_parallel_size", source, 1)
    layout = m.get("pipeline_model_parallel_layout")
    if layout:
        split, mtp = parse_layout(str(layout), source)
        if len(split) % pp:
            raise CannotImport(source, "pipeline_model_parallel_layout", layout, f"{len(split)} stages for pp {pp}: "
                                                                                 "a multiple of pp")
        if mtp != model.mtp_layers:
            raise CannotImport(source, "pipeline_model_parallel_layout", layout, f"{mtp} MTP modules (m) for the "
                                                                                 f"model's {model.mtp_layers}")
        vpp = len(split) // pp
        fields["layer_split"] = split
    for key, index in (("num_layers_in_first_pipeline_stage", 0), ("num_layers_in_last_pipeline_stage", -1)):
        if m.get(key) is not None and not layout:
            if vpp > 1:
                raise CannotImport(source, key, m[key], "with virtual stages, give the split as "
                                                        "pipeline_model_parallel_layout")
            fields.setdefault("layer_split", [None] * pp)
            fields["layer_split"][index] = int(m[key])
    if isinstance(fields.get("layer_split"), list):
        split = fields["layer_split"]
        known = sum(x for x in split if x is not None)
        middle = [i for i, x in enumerate(split) if x is None]
        rest = model.num_layers - known
        if middle and rest % len(middle):
            raise CannotImport(source, "num_layers_in_first_pipeline_stage", split[0],
                               f"the other {rest} layers do not divide over the {len(middle)} middle stages")
        fields["layer_split"] = tuple(rest // len(middle) if x is None else x for x in split)
    fields["virtual_stages"] = vpp
    if vpp > 1:
        fields["schedule"] = "interleaved"
    granularity = m.get("recompute_granularity")
    if granularity == "full":
        method, n = m.get("recompute_method", "uniform"), as_int(m, "recompute_num_layers", source, 1)
        if method == "block":  # the first n layers of each model chunk recomputed whole
            fields["recompute_layers"] = n
        elif method != "uniform" or n != 1:
            raise CannotImport(source, "recompute_num_layers", m.get("recompute_num_layers"),
                               "full recompute per layer (recompute_method uniform, 1 layer) or of the first n "
                               "layers of each chunk (recompute_method block)")
        else:
            fields["recompute"] = "full"
    elif granularity == "selective":
        fields["recompute"] = "selective"
    elif granularity not in (None, "none"):
        raise CannotImport(source, "recompute_granularity", granularity, "full or selective")
    fields["dtype"] = "fp8" if m.get("fp8") else "fp4" if m.get("fp4") else (
        "fp16" if as_bool(m.get("fp16", False)) else "bf16")
    dist = as_bool(ddp.get("use_distributed_optimizer", sec.get("optimizer", {}).get("use_distributed_optimizer", False)))
    fields.update(distributed_optimizer=dist, overlap_grad_reduce=as_bool(ddp.get("overlap_grad_reduce", False)),
                  overlap_param_gather=dist and as_bool(ddp.get("overlap_param_gather", False)))
    fraction = _offload(sec.get("optimizer", {}), source)
    if fraction is not None:
        fields.update(offload_optimizer=True, offload_fraction=fraction)
    if model.moe is not None:
        fields["ep"] = as_int(m, "expert_model_parallel_size", source, 1)
        fields["etp"] = as_int(m, "expert_tensor_parallel_size", source, tp)
    elif as_int(m, "expert_model_parallel_size", source, 1) > 1:
        raise CannotImport(source, "expert_model_parallel_size", m["expert_model_parallel_size"],
                           "a dense model (no num_moe_experts) has no experts to spread")
    return PlanSpec.build(fields, context=source)


def job_from_mcore(sec: Mapping[str, Mapping[str, Any]], base_stack: SoftwareSpec, gpus: int, source: str, *,
                   base_model: ModelSpec | None = None, gpus_per_node: int | None = None,
                   notes: tuple[str, ...] = ()) -> LaunchJob:
    """The model, plan and stack of Megatron-Core config sections, each checked as ``simulate`` checks them."""
    model = model_from_mcore(sec["model"], source, base_model)
    plan = canonical_plan(_plan(sec, model, gpus, source), model)
    stack = _stack(sec, base_stack, source)
    if not stack.moe_probs_in_activation and model.moe is not None:
        notes = notes + (f"stack {base_stack.name}: router probabilities applied at un-permutation (Megatron-Core "
                         "<= 0.12), which no flag states",)
    try:
        validate_experts(plan, model)
    except EchoPlanError as exc:
        raise CannotImport(source, "plan", plan.short(), str(exc)) from None
    return LaunchJob(model=model, plan=plan, stack=stack, gpus=gpus, gpus_per_node=gpus_per_node, source=source,
                     notes=notes)


def _offload(opt: Mapping[str, Any], source: str) -> float | None:
    """The share of its optimizer the job offloads to the CPU (Megatron-Core's HybridDeviceOptimizer), or None."""
    if not as_bool(opt.get("optimizer_cpu_offload", False)):
        return None
    fraction = opt.get("optimizer_offload_fraction", 1.0)  # Megatron-LM's flag defaults to 1.0
    try:
        share = float(fraction)
    except (TypeError, ValueError):
        share = float("nan")
    if not 0.0 < share <= 1.0:  # NaN fails too
        raise CannotImport(source, "optimizer_offload_fraction", fraction, "a share in (0, 1] of the optimizer on "
                                                                           "the CPU")
    if not as_bool(opt.get("overlap_cpu_optimizer_d2h_h2d", False)):
        raise CannotImport(source, "overlap_cpu_optimizer_d2h_h2d", False, "true: the offloaded step is modelled "
                                                                           "with the copies and the CPU step overlapped")
    return share
