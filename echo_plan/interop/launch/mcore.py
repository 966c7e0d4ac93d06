"""A job in Megatron-Core's own terms, both ways: the fields of its config classes.

Megatron-LM's ``pretrain_gpt.py`` copies its arguments into Megatron-Core's ``TransformerConfig``
(and ``DistributedDataParallelConfig``, ``OptimizerConfig``) by name, and Megatron-Bridge's
``ConfigContainer`` holds those same classes (``model``, ``ddp``, ``optimizer``), so one mapping
serves both formats: :func:`to_mcore` gives the sections a plan, a model and a stack set, and
:func:`from_mcore` reads them back. Field names are Megatron-Core 0.16's; where a Megatron-LM flag
has another name, ``megatron_lm.py`` renames it.

What Megatron-Core cannot run as simulated (a schedule it lacks, ZeRO-2, a sparse gradient
exchange, DeepSeek's FP8 caching of the experts' activation input) is refused with one line
(:class:`CannotExpress`); what a config sets that echo-plan cannot model is refused on import
(:class:`CannotImport`).
"""

from __future__ import annotations

import ast
import re
from typing import Any, Mapping

from echo_plan.interop.launch.job import (
    CannotExpress, CannotImport, LaunchFormat, even_split, named_like_preset, virtual_split,
)
from echo_plan.specs import ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.specs.cluster import DType
from echo_plan.specs.model import Activation, Norm, PositionEmbedding
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.specs.plan import DpComm, Recompute, Schedule, Sharding
from echo_plan.specs.software import (
    AttentionKernel, AttentionLibrary, Fp8Recipe, MoEDispatcher, OptimizerOffload, OptimizerSharding, RecomputeModule,
)

SECTIONS = ("model", "train", "ddp", "optimizer")
NORMS = {Norm.RMSNORM: "RMSNorm", Norm.LAYERNORM: "LayerNorm", Norm.LAYERNORM1P: "LayerNorm"}
POSITIONS = {PositionEmbedding.ROTARY: "rope", PositionEmbedding.LEARNED: "learned_absolute",
             PositionEmbedding.NONE: "none"}
ACTIVATIONS = {Activation.SWIGLU: "swiglu", Activation.GELU: "gelu", Activation.SQUARED_RELU: "squared_relu"}
FP8_RECIPES = {Fp8Recipe.DELAYED: ("hybrid", "delayed"), Fp8Recipe.CURRENT: ("hybrid", "tensorwise"),
               Fp8Recipe.BLOCKWISE: ("e4m3", "blockwise"), Fp8Recipe.MXFP8: ("e4m3", "mxfp8")}
FP4_FORMAT, FP4_RECIPE = "e2m1", "nvfp4"  # TransformerConfig fp4 / fp4_recipe: NVFP4, the one FP4 recipe modelled
MCORE_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)
# Megatron-Core's recompute modules that echo-plan traces (its others, moe and shared_experts, it does not)
RECOMPUTE_NAMES = {m.value for m in RecomputeModule}


FLASH_LIBRARIES = (AttentionLibrary.FLASH_ATTN_2, AttentionLibrary.FLASH_ATTN_3)


def _attention_backend(stack: SoftwareSpec) -> str:
    if stack.attention is AttentionKernel.UNFUSED:
        return "unfused"
    # Transformer Engine's flash backend runs FlashAttention-3 on Hopper where its package (flash_attn_3) is
    # installed, FlashAttention-2 otherwise: a config read back says flash, taken as FlashAttention-2
    return "flash" if stack.attention_library in FLASH_LIBRARIES else "fused"


def layout_string(split: tuple[int, ...], mtp_layers: int) -> str:
    """Megatron-Core's ``pipeline_model_parallel_layout``: virtual stages split by ``|``, ``t`` a
    transformer layer (``t*N``: N of them), ``E`` the embedding, ``m`` an MTP module, ``L`` the loss."""
    stages = [f"t*{n}" for n in split]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_layers + "L"
    return "|".join(stages)


def parse_layout(text: str, source: str) -> tuple[tuple[int, ...], int]:
    """(transformer layers per virtual stage, MTP modules) of a layout string (Megatron-Core's grammar:
    ``(..)*n`` and ``x*n`` repeat, commas are cosmetic)."""
    s = str(text).replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    if not s or set(s) - set("EtmL|"):
        raise CannotImport(source, "pipeline_model_parallel_layout", text, "expected stages of E, t, m and L "
                                                                             "separated by |")
    stages = s.split("|")
    return tuple(st.count("t") for st in stages), s.count("m")


def moe_layer_freq(first_dense: int, num_layers: int) -> list[int]:
    return [0] * first_dense + [1] * (num_layers - first_dense)


def parse_layer_freq(value: Any, num_layers: int, source: str) -> int:
    """Leading dense layers of Megatron's ``moe_layer_freq`` (an int N: every N-th layer is MoE; or a
    list of 0/1, or Megatron-LM's string such as ``([0]*3+[1]*58)``); refused when MoE layers are not
    all after the dense ones."""
    pattern = value
    if isinstance(value, str):
        pattern = _small_list_expr(value, source)
    if isinstance(pattern, int):
        if pattern != 1:
            raise CannotImport(source, "moe_layer_freq", value, "echo-plan models MoE in every layer after the "
                                                                "leading dense ones (1, or a 0/1 list)")
        return 0
    flags = [int(x) for x in pattern]
    if len(flags) != num_layers or set(flags) - {0, 1}:
        raise CannotImport(source, "moe_layer_freq", value, f"a list of {num_layers} zeros and ones")
    first = flags.index(1) if 1 in flags else num_layers
    if any(f == 0 for f in flags[first:]):
        raise CannotImport(source, "moe_layer_freq", value, "dense layers between MoE layers are not modelled "
                                                            "(only leading dense layers, as DeepSeek-V3's)")
    return first


def _small_list_expr(text: str, source: str) -> Any:
    """An int, or a list built from list literals with + and * (what Megatron-LM evaluates), safely."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise CannotImport(source, "moe_layer_freq", text, "an integer or a list such as ([0]*3+[1]*58)") from None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise CannotImport(source, "moe_layer_freq", text, "an integer or a list such as ([0]*3+[1]*58)")

    return ev(tree)


def _model_fields(model: ModelSpec, fmt: LaunchFormat) -> dict[str, Any]:
    if model.sliding_window is not None:
        raise CannotExpress(fmt, "model", model.name, "sliding-window attention layers are not exported yet "
                                                      "(Megatron's window_size / window_attn_skip_freq)")
    if model.activation not in ACTIVATIONS:
        raise CannotExpress(fmt, "activation", model.activation.value, "Megatron-Core has no such activation flag")
    m: dict[str, Any] = {
        "num_layers": model.num_layers, "hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_size,
        "num_attention_heads": model.num_attention_heads, "num_query_groups": model.kv_heads,
        "seq_length": model.seq_length, "max_position_embeddings": model.seq_length, "vocab_size": model.vocab_size,
        "activation": ACTIVATIONS[model.activation], "normalization": NORMS[model.norm],
        "layernorm_zero_centered_gamma": model.norm is Norm.LAYERNORM1P,
        "position_embedding_type": POSITIONS[model.position_embedding],
        "share_embeddings_and_output_weights": model.tied_embeddings, "add_bias_linear": model.has_bias,
        "qk_layernorm": model.qk_norm,
    }
    if model.position_embedding is PositionEmbedding.ROTARY and model.rotary_percent != 1.0:
        m["rotary_percent"] = model.rotary_percent
    if model.attention_head_dim is not None:
        m["kv_channels"] = model.attention_head_dim
    if model.mtp_layers:
        m["mtp_num_layers"] = model.mtp_layers
    if model.mla is not None:
        mla = model.mla
        m.update(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                 qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim)
    moe = model.moe
    if moe is not None:
        m.update(num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k,
                 moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
                 moe_router_score_function="sigmoid" if moe.router.value == "sigmoid" else "softmax")
        if moe.first_dense_layers:
            m["moe_layer_freq"] = moe_layer_freq(moe.first_dense_layers, model.num_layers)
        if moe.num_shared_experts:
            m["moe_shared_expert_intermediate_size"] = moe.shared_ffn
        if moe.routing_groups is not None:
            m.update(moe_router_num_groups=moe.routing_groups, moe_router_group_topk=moe.groups_per_token)
        if moe.capacity_factor is not None:
            m["moe_expert_capacity_factor"] = moe.capacity_factor
    return m


def _refuse_plan(plan: PlanSpec, stack: SoftwareSpec, fmt: LaunchFormat) -> None:
    if stack.attention is AttentionKernel.FUSED and stack.attention_library is AttentionLibrary.FLASH_ATTN_TRITON:
        raise CannotExpress(fmt, "attention_library", stack.attention_library.value,
                            "Megatron runs Transformer Engine's fused attention (cuDNN or FlashAttention-2), not the "
                            "Triton FlashAttention the plan was simulated with; simulate with another stack to export")
    if plan.schedule not in MCORE_SCHEDULES:
        raise CannotExpress(fmt, "schedule", plan.schedule.value, "Megatron-Core runs 1F1B and interleaved 1F1B "
                                                                  "pipelines only")
    if plan.dp_comm is not DpComm.DENSE:
        raise CannotExpress(fmt, "dp_comm", plan.dp_comm.value, "Megatron-Core exchanges dense gradients only")
    if plan.distributed_optimizer and stack.optimizer_sharding is OptimizerSharding.STATES_AND_GRADS:
        raise CannotExpress(fmt, "optimizer_sharding", stack.optimizer_sharding.value,
                            "Megatron-Core's distributed optimizer shards optimizer states, not the gradient "
                            "buffer (ZeRO-2); use a stack with optimizer_sharding: states")
    if stack.moe_act_input_fp8 and plan.dtype is DType.FP8:
        raise CannotExpress(fmt, "moe_act_input_fp8", True, "Megatron-Core keeps the experts' activation input in "
                                                            "bf16 (DeepSeek's FP8 caching has no flag); simulate "
                                                            "with a stack that sets it false")
    if stack.moe_dispatch_fp8 and plan.dtype is DType.FP8 and plan.ep > 1:
        raise CannotExpress(fmt, "moe_dispatch_fp8", True, "Megatron-Core's DeepEP dispatcher moves bf16 tokens "
                                                           "(DeepSeek's FP8 dispatch has no flag); simulate with a "
                                                           "stack that sets it false")
    if plan.dtype is DType.FP8 and stack.fp8_recipe is Fp8Recipe.BLOCKWISE:
        if stack.deepseek_fp8_kernels:
            raise CannotExpress(fmt, "fp8_kernels", stack.fp8_kernels.value, "Megatron-Core runs Transformer "
                                "Engine's blockwise FP8 kernels (DeepSeek's own have no flag); simulate with a stack "
                                "that sets fp8_kernels: transformer-engine")
        if stack.fp8_attention_output_e5m6:
            raise CannotExpress(fmt, "fp8_attention_output_e5m6", True, "Megatron-Core keeps the attention output "
                                "in bf16 (DeepSeek's E5M6 copy has no flag); simulate with a stack that sets it false")
    level = DataParallelSharding.of(plan, stack)
    if level.level in (Sharding.GRADIENTS, Sharding.PARAMETERS):
        raise CannotExpress(fmt, "sharding", level.level.value, "Megatron-Core's distributed optimizer shards "
                            "optimizer states (ZeRO-1); its own FSDP (use_megatron_fsdp) is not exported")
    if plan.shard_degree is not None and plan.shard_degree != plan.grad_dp:
        raise CannotExpress(fmt, "shard_degree", plan.shard_degree, "Megatron-Core's partial distributed optimizer "
                            "(num_distributed_optimizer_instances) is not exported")
    if plan.recompute_layers and plan.recompute is not Recompute.NONE:
        raise CannotExpress(fmt, "recompute_layers", plan.recompute_layers, "Megatron-Core recomputes a block of "
                            "layers only under full granularity, not beside selective recompute")
    if plan.offload_optimizer:
        if stack.optimizer_offload is not OptimizerOffload.MEGATRON_HYBRID:
            raise CannotExpress(fmt, "optimizer_offload", stack.optimizer_offload.value, "Megatron-Core offloads "
                                "the optimizer with its HybridDeviceOptimizer (megatron-hybrid); the plan was "
                                "simulated with another framework's offload: simulate with --stack megatron-core")
        if plan.dtype is DType.FP8 and stack.fp8_param_gather and stack.fp8_recipe is not Fp8Recipe.DELAYED:
            raise CannotExpress(fmt, "fp8_param_gather", True, "Megatron-Core's optimizer CPU offload takes FP8 "
                                "parameters only with the delayed recipe (arguments.py); use --fp8-param-gather false "
                                "or --fp8-recipe delayed")
        if stack.optimizer_state_bytes == 8.0:
            raise CannotExpress(fmt, "optimizer_state_bytes", 8.0, "the CPU AdamW Megatron-Core offloads to keeps "
                                "fp32 moments; simulate with a stack whose optimizer_state_bytes is 12")
    if stack.optimizer_state_bytes not in (None, 12.0, 8.0):
        raise CannotExpress(fmt, "optimizer_state_bytes", stack.optimizer_state_bytes,
                            "Megatron-Core keeps 12 (fp32 master and moments) or 8 (bf16 moments, the "
                            "precision-aware optimizer) bytes per parameter")


def to_mcore(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, fmt: LaunchFormat) -> dict[str, dict[str, Any]]:
    """The sections ``model``, ``train``, ``ddp``, ``optimizer`` of Megatron-Core config fields (plus
    ``activation``, which Megatron-LM gives as a flag and Bridge takes from its recipe)."""
    stack = stack.for_plan(plan)  # as the simulation runs it
    _refuse_plan(plan, stack, fmt)
    m = _model_fields(model, fmt)
    m.update(tensor_model_parallel_size=plan.tp, pipeline_model_parallel_size=plan.pp,
             context_parallel_size=plan.cp, sequence_parallel=plan.sequence_parallel)
    if not even_split(plan, model):
        m["pipeline_model_parallel_layout"] = layout_string(virtual_split(plan, model), model.mtp_layers)
    elif plan.virtual_stages > 1:
        m["virtual_pipeline_model_parallel_size"] = plan.virtual_stages
    if model.moe is not None:
        m.update(expert_model_parallel_size=plan.ep, expert_tensor_parallel_size=plan.expert_tp,
                 moe_grouped_gemm=stack.moe_grouped_gemm, moe_permute_fusion=stack.moe_permute_fusion)
        if stack.moe_dispatcher is MoEDispatcher.DEEPEP:
            m.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
            if stack.moe_comm_sms:
                m["moe_deepep_num_sms"] = stack.moe_comm_sms
        else:
            m["moe_token_dispatcher_type"] = stack.moe_dispatcher.value
        if stack.moe_a2a_overlap:
            m["overlap_moe_expert_parallel_comm"] = True
    if plan.recompute is Recompute.SELECTIVE:
        m.update(recompute_granularity="selective", recompute_modules=[r.value for r in stack.recompute_modules])
    elif plan.recompute is Recompute.FULL:
        m.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif plan.recompute_layers:
        m.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=plan.recompute_layers)
    m.update(bf16=plan.param_dtype is DType.BF16, fp16=plan.param_dtype is DType.FP16)
    if plan.dtype is DType.FP8:
        fmt8, recipe = FP8_RECIPES[stack.fp8_recipe]
        m.update(fp8=fmt8, fp8_recipe=recipe, fp8_param=stack.fp8_param_gather)
    elif plan.dtype is DType.FP4:
        m.update(fp4=FP4_FORMAT, fp4_recipe=FP4_RECIPE, fp4_param=stack.fp4_param_gather)
    m.update(attention_backend=_attention_backend(stack), hidden_dropout=stack.hidden_dropout,
             attention_dropout=stack.attention_dropout, gradient_accumulation_fusion=stack.gradient_accumulation_fusion,
             bias_activation_fusion=stack.fused_elementwise, bias_dropout_fusion=stack.fused_elementwise,
             masked_softmax_fusion=stack.fused_elementwise,
             tp_comm_overlap=stack.tp_comm_overlap and plan.sequence_parallel and plan.tp > 1,
             overlap_p2p_comm=stack.overlap_p2p)
    if plan.cp > 1:
        m["cp_comm_type"] = stack.cp_comm.value
    dist = plan.distributed_optimizer and stack.optimizer_sharding is not OptimizerSharding.NONE
    grad_fp32 = stack.grad_bytes(plan.param_dtype) == 4
    ddp = {"use_distributed_optimizer": dist, "overlap_grad_reduce": plan.overlap_grad_reduce and stack.overlap_grad_reduce,
           "overlap_param_gather": dist and plan.overlap_param_gather and stack.overlap_param_gather,
           "grad_reduce_in_fp32": grad_fp32}
    opt: dict[str, Any] = {"use_distributed_optimizer": dist}
    if plan.dtype is DType.FP8 and stack.fp8_param_gather:
        ddp["fp8_param_gather"] = True  # what --fp8-param-gather sets in DistributedDataParallelConfig too
        if stack.fp8_recipe is Fp8Recipe.MXFP8:  # MXFP8 parameters are gathered through the gradient buffer
            ddp["reuse_grad_buf_for_mxfp8_param_ag"] = opt["reuse_grad_buf_for_mxfp8_param_ag"] = True
    if stack.optimizer_state_bytes == 8.0:
        opt.update(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    if plan.offload_optimizer:  # HybridDeviceOptimizer needs the precision-aware optimizer's code path
        opt.update(optimizer_cpu_offload=True, optimizer_offload_fraction=plan.offload_fraction,
                   use_precision_aware_optimizer=True, overlap_cpu_optimizer_d2h_h2d=True)
    train = {"micro_batch_size": plan.micro_batch_size, "global_batch_size": plan.global_batch_size}
    return {"model": m, "train": train, "ddp": ddp, "optimizer": opt}


def as_int(sec: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = sec.get(key)
    if value is None:
        if default is None:
            raise CannotImport(source, key, None, "missing: the job's model or plan is not complete without it")
        return default
    try:
        return int(value)
    except (TypeError, ValueError):
        raise CannotImport(source, key, value, "expected an integer") from None


def as_bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def model_from_mcore(m: Mapping[str, Any], source: str, base: ModelSpec | None = None) -> ModelSpec:
    """The ModelSpec the ``model`` section describes (shape fields over ``base`` when given)."""
    fields: dict[str, Any] = dict(base.model_dump()) if base is not None else {}
    if base is None or "num_layers" in m:
        fields.update(num_layers=as_int(m, "num_layers", source), hidden_size=as_int(m, "hidden_size", source),
                      num_attention_heads=as_int(m, "num_attention_heads", source),
                      vocab_size=as_int(m, "vocab_size", source, fields.get("vocab_size")))
        heads = fields["num_attention_heads"]
        fields["num_kv_heads"] = as_int(m, "num_query_groups", source, heads)
        fields["ffn_hidden_size"] = as_int(m, "ffn_hidden_size", source, 4 * fields["hidden_size"])
        if m.get("kv_channels") is not None:
            fields["attention_head_dim"] = as_int(m, "kv_channels", source)
    fields["seq_length"] = as_int(m, "seq_length", source, fields.get("seq_length"))
    act = m.get("activation")
    if act is not None:
        names = {v: k for k, v in ACTIVATIONS.items()}
        if act not in names:
            raise CannotImport(source, "activation", act, "one of " + ", ".join(names))
        fields["activation"] = names[act]
    if "normalization" in m:
        norm = str(m["normalization"])
        if norm not in ("RMSNorm", "LayerNorm"):
            raise CannotImport(source, "normalization", norm, "RMSNorm or LayerNorm")
        fields["norm"] = Norm.RMSNORM if norm == "RMSNorm" else (
            Norm.LAYERNORM1P if as_bool(m.get("layernorm_zero_centered_gamma", False)) else Norm.LAYERNORM)
    if "position_embedding_type" in m:
        names = {v: k for k, v in POSITIONS.items()}
        pos = str(m["position_embedding_type"])
        if pos not in names:
            raise CannotImport(source, "position_embedding_type", pos, "one of " + ", ".join(names))
        fields["position_embedding"] = names[pos]
    for key, field in (("share_embeddings_and_output_weights", "tied_embeddings"), ("add_bias_linear", "bias"),
                       ("qk_layernorm", "qk_norm")):
        if key in m:
            fields[field] = as_bool(m[key])
    if m.get("rotary_percent") is not None:
        fields["rotary_percent"] = float(m["rotary_percent"])
    if m.get("mtp_num_layers") is not None:
        fields["mtp_layers"] = as_int(m, "mtp_num_layers", source)
    if as_bool(m.get("multi_latent_attention", False)):
        fields["mla"] = {"q_lora_rank": m.get("q_lora_rank"), "kv_lora_rank": as_int(m, "kv_lora_rank", source),
                         "qk_nope_head_dim": as_int(m, "qk_head_dim", source),
                         "qk_rope_head_dim": as_int(m, "qk_pos_emb_head_dim", source),
                         "v_head_dim": as_int(m, "v_head_dim", source)}
    experts = m.get("num_moe_experts")
    if experts:
        moe: dict[str, Any] = dict(fields.get("moe") or {})
        moe.update(num_experts=int(experts), top_k=as_int(m, "moe_router_topk", source, 2),
                   expert_ffn_hidden_size=as_int(m, "moe_ffn_hidden_size", source, fields["ffn_hidden_size"]))
        if "moe_layer_freq" in m:
            moe["first_dense_layers"] = parse_layer_freq(m["moe_layer_freq"], fields["num_layers"], source)
        shared = m.get("moe_shared_expert_intermediate_size")
        if shared:
            moe.update(num_shared_experts=1, shared_expert_ffn_hidden_size=int(shared))
        if "moe_router_score_function" in m:
            moe["router"] = str(m["moe_router_score_function"])
        if m.get("moe_router_num_groups") is not None:
            moe.update(routing_groups=int(m["moe_router_num_groups"]), groups_per_token=m.get("moe_router_group_topk"))
        if m.get("moe_expert_capacity_factor") is not None:
            moe["capacity_factor"] = float(m["moe_expert_capacity_factor"])
        fields["moe"] = moe
    fields.setdefault("name", "imported")
    return named_like_preset(ModelSpec.build(fields, context=source), fields["name"])
