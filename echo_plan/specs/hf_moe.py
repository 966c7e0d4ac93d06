"""Hugging Face config.json of the mixture-of-experts families echo-plan models -> ModelSpec fields.

Families and the keys read (each config.json's own names): ``mixtral`` (num_local_experts,
num_experts_per_tok, intermediate_size), ``qwen3_moe`` (num_experts, num_experts_per_tok,
moe_intermediate_size, head_dim; QK norm), ``deepseek_v3`` (n_routed_experts, n_shared_experts,
moe_intermediate_size, first_k_dense_replace, scoring_func, the MLA ranks and head dims,
num_nextn_predict_layers) and ``gpt_oss`` (num_local_experts, experts_per_token or
num_experts_per_tok, sliding_window with layer_types alternating from a sliding layer).
A key the family needs and the file lacks is an error that names it.
"""

from __future__ import annotations

from typing import Any

from echo_plan.errors import FileFormatError

HF_MOE_FAMILIES = ("deepseek_v3", "gpt_oss", "mixtral", "qwen3_moe")
TRAIN_SEQ_MAX = 4096  # configs give the longest position; MoE pre-training ran at 4K (moe_h100.csv)


def whole_number(data: dict[str, Any], key: str, path: str, least: int) -> int | None:
    """``data[key]`` as a whole number of at least ``least``, None when absent or null; anything else (a word, a
    fraction, true/false, a list) is a one-line file error rather than a key silently ignored or misread."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise FileFormatError(path, f"{key} {value!r} is not a whole number of at least {least} (or null)")
    return value


def _need(data: dict[str, Any], path: str, family: str, *keys: str) -> list[Any]:
    missing = [k for k in keys if data.get(k) is None]
    if missing:
        raise FileFormatError(path, f"a {family} config.json needs {', '.join(missing)}; not found")
    return [data[k] for k in keys]


def moe_fields_from_hf(data: dict[str, Any], family: str, name: str, path: str) -> dict[str, Any]:
    """ModelSpec fields of an MoE ``family`` config (see the module docstring)."""
    layers, hidden, heads, vocab = _need(data, path, family, "num_hidden_layers", "hidden_size",
                                         "num_attention_heads", "vocab_size")
    seq = data.get("max_position_embeddings") or TRAIN_SEQ_MAX
    fields: dict[str, Any] = {
        "name": name, "source": f"Hugging Face config {path}", "num_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "vocab_size": vocab, "seq_length": min(int(seq), TRAIN_SEQ_MAX),
        "activation": "swiglu", "norm": "rmsnorm", "position_embedding": "rotary",
        "tied_embeddings": bool(data.get("tie_word_embeddings", False)),
    }
    if data.get("num_key_value_heads") is not None and family != "deepseek_v3":
        fields["num_kv_heads"] = data["num_key_value_heads"]
    top_k = data.get("num_experts_per_tok", data.get("experts_per_token"))
    if top_k is None:
        raise FileFormatError(path, f"a {family} config.json needs num_experts_per_tok; not found")
    if family == "mixtral":
        experts, ffn = _need(data, path, family, "num_local_experts", "intermediate_size")
        fields.update(ffn_hidden_size=ffn, moe=dict(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=ffn))
    elif family == "qwen3_moe":
        experts, ffn = _need(data, path, family, "num_experts", "moe_intermediate_size")
        fields.update(ffn_hidden_size=data.get("intermediate_size") or ffn, qk_norm=True,
                      moe=dict(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=ffn))
        if whole_number(data, "head_dim", path, 1):
            fields["attention_head_dim"] = data["head_dim"]
    elif family == "gpt_oss":
        experts, ffn = _need(data, path, family, "num_local_experts", "intermediate_size")
        fields.update(ffn_hidden_size=ffn, bias=bool(data.get("attention_bias", True)), activation="swiglu_clamped",
                      moe=dict(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=ffn))
        if whole_number(data, "head_dim", path, 1):
            fields["attention_head_dim"] = data["head_dim"]
        window, types = whole_number(data, "sliding_window", path, 1), data.get("layer_types")
        if window:
            fields["sliding_window"] = window
            if isinstance(types, list) and len(types) > 1:
                if types[0] != "sliding_attention" or any(
                        t != ("sliding_attention" if i % 2 == 0 else "full_attention") for i, t in enumerate(types)):
                    raise FileFormatError(path, "layer_types: only sliding and full attention alternating from "
                                                "layer 0 is supported")
                fields["sliding_window_pattern"] = 2
    else:  # deepseek_v3
        experts, ffn, dense_ffn = _need(data, path, family, "n_routed_experts", "moe_intermediate_size",
                                        "intermediate_size")
        kv_rank, nope, rope, v = _need(data, path, family, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim")
        fields.update(ffn_hidden_size=dense_ffn, mtp_layers=int(data.get("num_nextn_predict_layers") or 0),
                      mla=dict(q_lora_rank=data.get("q_lora_rank"), kv_lora_rank=kv_rank, qk_nope_head_dim=nope,
                               qk_rope_head_dim=rope, v_head_dim=v),
                      moe=dict(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=ffn,
                               num_shared_experts=int(data.get("n_shared_experts") or 0),
                               first_dense_layers=int(data.get("first_k_dense_replace") or 0),
                               router="sigmoid" if data.get("scoring_func") == "sigmoid" else "softmax",
                               **({"routing_groups": int(data["n_group"]), "groups_per_token": int(data["topk_group"])}
                                  if data.get("n_group") and data.get("topk_group") and int(data["n_group"]) > 1
                                  else {})))
    return fields
