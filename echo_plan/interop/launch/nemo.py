"""NeMo's training YAML (NeMo 1.x / NeMo-Framework-Launcher: ``trainer:`` and ``model:`` sections) read
into Megatron-Core fields, then into a job like every other launch config (import only).

Names from NeMo's ``megatron_gpt_config.yaml`` and the launcher's ``conf/training/*/*.yaml``. A NeMo
YAML names its tokenizer, not its vocabulary size: the model preset of the same shape supplies it
(and the job's notes say so); with none of that shape the import is refused. Settings that change
the step or its memory and that echo-plan does not model (a batch-size ramp, partial activation
checkpointing, CPU offloading, fp32 weights without ``megatron_amp_O2``...) are refused by name.
"""

from __future__ import annotations

from typing import Any, Mapping

from echo_plan.interop.launch.job import CannotImport, LaunchJob, preset_of_shape
from echo_plan.interop.launch.mcore import model_from_mcore
from echo_plan.interop.launch.mcore_read import job_from_mcore
from echo_plan.specs import SoftwareSpec, load_model

SAME = ("micro_batch_size", "global_batch_size")
SAME_MODEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "num_layers",
              "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "hidden_dropout", "attention_dropout", "share_embeddings_and_output_weights",
              "gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion", "overlap_p2p_comm",
              "sequence_parallel", "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_shared_expert_intermediate_size",
              "moe_router_score_function", "moe_layer_freq", "moe_permute_fusion", "position_embedding_type",
              "max_position_embeddings")
ACTIVATIONS = {"fast-swiglu": "swiglu", "swiglu": "swiglu", "gelu": "gelu", "fast-gelu": "gelu",
               "squared-relu": "squared_relu"}
NORMS = {"rmsnorm": ("RMSNorm", False), "layernorm": ("LayerNorm", False), "layernorm1p": ("LayerNorm", True)}
OPTIMIZERS = {"distributed_fused_adam": True, "mcore_distributed_optim": True, "fused_adam": False, "adam": False}
# (key, the value that is modelled): anything else changes the job in a way echo-plan does not simulate
MUST_BE = (("rampup_batch_size", None), ("num_micro_batches_with_partial_activation_checkpoints", None),
           ("activations_checkpoint_layers_per_pipeline", None), ("fp32_residual_connection", False),
           ("cpu_offloading", False), ("ffn_dropout", 0.0), ("transformer_block_type", "pre_ln"),
           ("headscale", False), ("megatron_amp_O2", True))


def is_nemo(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("trainer"), dict) and isinstance(doc.get("model"), dict)


def _check(model: Mapping[str, Any], source: str) -> None:
    for key, ok in MUST_BE:
        value = model.get(key, ok)
        if value != ok and not (ok is None and value in (None, "null")):
            raise CannotImport(source, f"model.{key}", value, f"echo-plan models {ok!r} only")


def _sections(doc: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    trainer, src = doc["trainer"], doc["model"]
    _check(src, source)
    m: dict[str, Any] = {k: src[k] for k in SAME_MODEL if src.get(k) is not None}
    m["seq_length"] = src.get("encoder_seq_length") or (src.get("data") or {}).get("seq_length")
    precision = str(trainer.get("precision", "32"))
    if precision.startswith("bf16"):
        m["bf16"] = True
    elif precision.startswith("16"):
        m["fp16"] = True
    else:
        raise CannotImport(source, "trainer.precision", precision, "bf16 or 16 (fp32 training is not modelled)")
    act = src.get("activation", "gelu")
    if act not in ACTIVATIONS:
        raise CannotImport(source, "model.activation", act, "one of " + ", ".join(ACTIVATIONS))
    m["activation"] = ACTIVATIONS[act]
    norm = src.get("normalization", "layernorm")
    if norm not in NORMS:
        raise CannotImport(source, "model.normalization", norm, "one of " + ", ".join(NORMS))
    m["normalization"], m["layernorm_zero_centered_gamma"] = NORMS[norm]
    m["add_bias_linear"] = bool(src.get("bias", True))
    if src.get("rotary_percentage") is not None:
        m["rotary_percent"] = float(src["rotary_percentage"])
    if src.get("bias_dropout_add_fusion") is not None:
        m["bias_dropout_fusion"] = bool(src["bias_dropout_add_fusion"])
    granularity = src.get("activations_checkpoint_granularity")
    if granularity:
        m["recompute_granularity"] = granularity
        if granularity == "full":
            m.update(recompute_method=src.get("activations_checkpoint_method") or "uniform",
                     recompute_num_layers=src.get("activations_checkpoint_num_layers") or 1)
    if src.get("fp8"):
        m["fp8"] = "hybrid" if src.get("fp8_hybrid") else "e4m3"
        m["fp8_recipe"] = "delayed"  # NeMo 1's Transformer Engine recipe (amax history)
        m["fp8_param"] = bool(src.get("fp8_params", False))
    m["tp_comm_overlap"] = bool(src.get("ub_tp_comm_overlap", False))
    optim = dict(src.get("optim") or {})
    name = str(optim.get("name", "fused_adam"))
    if name not in OPTIMIZERS:
        raise CannotImport(source, "model.optim.name", name, "one of " + ", ".join(OPTIMIZERS))
    dist = OPTIMIZERS[name]
    ddp = {"use_distributed_optimizer": dist, "overlap_grad_reduce": bool(optim.get("overlap_grad_sync", False)),
           "overlap_param_gather": dist and bool(optim.get("overlap_param_sync", False)),
           "grad_reduce_in_fp32": str(optim.get("grad_sync_dtype", "fp32")) in ("fp32", "float32")}
    train = {k: src[k] for k in SAME if src.get(k) is not None}
    return {"model": m, "train": train, "ddp": ddp, "optimizer": {"use_distributed_optimizer": dist}}


def _vocab_from_preset(m: dict[str, Any], source: str, tokenizer: Any) -> tuple[int, str]:
    """The vocabulary of the preset whose shape the YAML's model has (vocabulary aside)."""
    name = preset_of_shape(model_from_mcore(dict(m, vocab_size=1), source), ignore=("vocab_size",))
    if name is not None:
        return load_model(name).vocab_size, name
    raise CannotImport(source, "model.tokenizer", (tokenizer or {}).get("type"),
                       "a NeMo YAML names its tokenizer, not its vocabulary size, and no model preset has this "
                       "shape to take it from; write the model as a Megatron-LM command (--vocab-size) instead")


def import_nemo(doc: Mapping[str, Any], source: str, base_stack: SoftwareSpec, gpus: int | None = None) -> LaunchJob:
    trainer = doc["trainer"]
    sec = _sections(doc, source)
    try:
        world = gpus if gpus is not None else int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    except (TypeError, ValueError):
        raise CannotImport(source, "trainer.devices", trainer.get("devices"), "whole numbers of devices and "
                                                                              "nodes") from None
    vocab, preset = _vocab_from_preset(sec["model"], source, doc["model"].get("tokenizer"))
    sec["model"]["vocab_size"] = vocab
    notes = (f"vocabulary size {vocab:,} from the model preset {preset} of the same shape (the YAML names only "
             f"its tokenizer)",)
    per_node = trainer.get("devices") if isinstance(trainer.get("devices"), int) else None
    return job_from_mcore(sec, base_stack, world, source, gpus_per_node=per_node, notes=notes)
