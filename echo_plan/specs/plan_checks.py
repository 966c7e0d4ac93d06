"""The checks a plan passes against its model and cluster before anything is simulated: the GPUs it needs, the
layers and heads its degrees split, its experts, its context parallelism and its precision on the GPU. Each raises
SpecError naming the value and what is valid."""

from __future__ import annotations

from echo_plan.errors import SpecError
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import FP4_MIN_SM_ARCH, FP8_MIN_SM_ARCH, PlanSpec, Schedule, schedule_rule


def validate_plan(plan: PlanSpec, model: ModelSpec, cluster: ClusterSpec) -> None:
    """Check that ``plan`` can run ``model`` on ``cluster``; raise SpecError naming what cannot."""
    if plan.world_size != cluster.num_gpus:
        if plan.cp > 1:
            raise SpecError(
                "tp x cp x pp x dp", f"{plan.tp} x {plan.cp} x {plan.pp} x {plan.dp} = {plan.world_size}",
                f"must equal the cluster's {cluster.num_gpus} GPUs "
                f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})",
            )
        raise SpecError(
            "tp x pp x dp", f"{plan.tp} x {plan.pp} x {plan.dp} = {plan.world_size}",
            f"must equal the cluster's {cluster.num_gpus} GPUs "
            f"({cluster.num_nodes} nodes x {cluster.gpus_per_node})",
        )
    validate_cp(plan.cp, plan.tp, plan.sequence_parallel, model)
    if model.num_attention_heads % plan.tp:
        raise SpecError("tp", plan.tp, f"must divide num_attention_heads {model.num_attention_heads} of {model.name}")
    if model.kv_heads % plan.tp:
        raise SpecError("tp", plan.tp, f"must divide num_kv_heads {model.kv_heads} of {model.name}")
    if model.ffn_size % plan.tp:
        raise SpecError("tp", plan.tp, f"must divide ffn_hidden_size {model.ffn_size} of {model.name}")
    validate_experts(plan, model)
    check_fp8_gpu(plan.dtype, cluster)
    if plan.pp > model.num_layers:
        raise SpecError("pp", plan.pp, f"must not exceed num_layers {model.num_layers} of {model.name}")
    if plan.sequence_parallel and model.seq_length % plan.tp:
        raise SpecError("sequence_parallel", True, f"needs seq_length {model.seq_length} divisible by tp {plan.tp}")
    chunks = plan.pp * plan.virtual_stages
    if plan.layer_split is not None:
        nvs = plan.pp * plan.virtual_stages
        per_virtual = plan.virtual_stages > 1 and len(plan.layer_split) == nvs
        if len(plan.layer_split) != plan.pp and not per_virtual:
            extra = f" or one per virtual stage ({nvs})" if plan.virtual_stages > 1 else ""
            raise SpecError("layer_split", plan.layer_split, f"needs one entry per pipeline stage ({plan.pp}){extra}")
        # the first and last virtual stage may hold no transformer layer: only the embedding, or the output layer
        # and loss (Megatron-Core's account_for_embedding/loss_in_pipeline_split with one layer per virtual stage)
        inner = plan.layer_split[1:-1] if per_virtual else plan.layer_split
        if sum(plan.layer_split) != model.num_layers or min(plan.layer_split) < 0 or (inner and min(inner) < 1):
            raise SpecError("layer_split", plan.layer_split,
                            f"positive layer counts that add up to num_layers {model.num_layers} (with one per "
                            "virtual stage, the first and last may be 0: the embedding, the output layer)")
        if not per_virtual and any(n % plan.virtual_stages for n in plan.layer_split):
            raise SpecError("layer_split", plan.layer_split,
                            f"each stage's layers must divide into {plan.virtual_stages} virtual stages")
    elif model.num_layers % chunks:
        raise SpecError(
            "pp x virtual_stages", f"{plan.pp} x {plan.virtual_stages}",
            f"must divide num_layers {model.num_layers} of {model.name} (or give layer_split)",
        )
    why = schedule_rule(plan.schedule, plan.pp, plan.virtual_stages, plan.num_microbatches)
    if why is not None:
        raise SpecError("schedule", plan.schedule.value, why)
    most = max(plan.virtual_layers(model.num_layers))
    if plan.recompute_layers > most:
        raise SpecError("recompute_layers", plan.recompute_layers, f"at most the {most} layers of a model chunk "
                        f"({model.name}: {model.num_layers} layers over pp x virtual_stages = "
                        f"{plan.pp * plan.virtual_stages}); --recompute full recomputes them all")
    if plan.virtual_stages > 1 and plan.pp == 1:
        raise SpecError("virtual_stages", plan.virtual_stages, "interleaving needs pp > 1")
    if plan.virtual_stages > 1 and plan.schedule is Schedule.INTERLEAVED and plan.num_microbatches % plan.pp:
        raise SpecError(
            "virtual_stages", plan.virtual_stages,
            f"the interleaved schedule needs the number of micro-batches ({plan.num_microbatches}) "
            f"to be a multiple of pp ({plan.pp})",
        )


def validate_experts(plan: PlanSpec, model: ModelSpec) -> None:
    """The expert-parallel rules (Megatron-Core's): raise SpecError naming the one broken."""
    moe = model.moe
    if moe is None:
        if plan.ep > 1 or plan.expert_tp != plan.tp:
            raise SpecError("ep", plan.ep, f"expert parallelism needs a mixture-of-experts model; {model.name} is dense")
        if plan.expert_imbalance > 1.0:
            raise SpecError("expert_imbalance", plan.expert_imbalance, f"needs a mixture-of-experts model; "
                            f"{model.name} is dense")
        return
    if moe.num_experts % plan.ep:
        valid = [e for e in range(1, moe.num_experts + 1) if moe.num_experts % e == 0]
        raise SpecError("ep", plan.ep, f"must divide num_experts {moe.num_experts} of {model.name}; valid: "
                        f"{', '.join(map(str, valid))}")
    for ffn, what in ((moe.expert_ffn_hidden_size, "expert_ffn_hidden_size"),
                      (moe.shared_ffn, "shared_expert_ffn_hidden_size")):
        if ffn and ffn % plan.expert_tp:
            raise SpecError("etp", plan.expert_tp, f"must divide {what} {ffn} of {model.name}")
    if plan.tp > 1 and not plan.sequence_parallel:
        raise SpecError("sequence_parallel", False, "Megatron-Core runs MoE layers with tp > 1 only with sequence "
                        "parallelism; add --sp")


def check_fp8_gpu(dtype: DType, cluster: ClusterSpec) -> None:
    """FP8 and FP4 training need tensor cores of that precision: raise SpecError naming the GPU when it has none."""
    gpu = cluster.gpu
    if dtype is DType.FP8 and (gpu.sm_arch < FP8_MIN_SM_ARCH or gpu.peak_fp8_tflops is None):
        raise SpecError("dtype", "fp8", f"GPU {gpu.name} (sm{gpu.sm_arch}) has no FP8 tensor cores (they start with "
                        f"sm{FP8_MIN_SM_ARCH}, Ada/Hopper); use bf16 or fp16 there")
    if dtype is DType.FP4 and (gpu.sm_arch < FP4_MIN_SM_ARCH or gpu.peak_fp4_tflops is None):
        why = "no peak_fp4_tflops in its spec" if gpu.sm_arch >= FP4_MIN_SM_ARCH else "no FP4 tensor cores"
        raise SpecError("dtype", "fp4", f"GPU {gpu.name} (sm{gpu.sm_arch}) has {why} (NVFP4 starts with "
                        f"sm{FP4_MIN_SM_ARCH}, Blackwell); use fp8 or bf16 there")


def validate_cp(cp: int, tp: int, sequence_parallel: bool, model: ModelSpec) -> None:
    """Megatron-Core's context-parallel rules: raise SpecError naming the one broken."""
    if cp == 1:
        return
    if model.seq_length % (2 * cp):
        raise SpecError("cp", cp, f"seq_length {model.seq_length} of {model.name} must divide into 2 x cp = {2 * cp} "
                        "equal chunks (causal load balancing gives each CP rank two)")
    if sequence_parallel and (model.seq_length // cp) % tp:
        raise SpecError("cp", cp, f"each CP rank's {model.seq_length // cp} tokens must divide by tp {tp} for "
                        "sequence parallelism")
    if model.mla is not None:
        raise SpecError("cp", cp, f"context parallelism is modelled for standard attention; {model.name} uses "
                        "multi-head latent attention (use cp 1)")
    if any(kind.window for kind in model.distinct_kinds()):
        raise SpecError("cp", cp, f"context parallelism is modelled for full causal attention; {model.name} has "
                        "sliding-window layers (use cp 1)")
