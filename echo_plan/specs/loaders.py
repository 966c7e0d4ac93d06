"""Reading spec files: YAML/JSON with line numbers in errors, and Hugging Face config.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo_plan.errors import FileFormatError
from echo_plan.files import parse_json, parse_yaml, read_text
from echo_plan.specs.hf_moe import HF_MOE_FAMILIES, moe_fields_from_hf, whole_number

# Hugging Face config.json keys -> ModelSpec fields (Llama, Mistral, Qwen2, Qwen3 and GPT-2 families).
HF_KEY_MAP: dict[str, str] = {
    "num_hidden_layers": "num_layers",  # Llama, Mistral, Qwen2
    "n_layer": "num_layers",  # GPT-2
    "hidden_size": "hidden_size",
    "n_embd": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "n_head": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "ffn_hidden_size",
    "n_inner": "ffn_hidden_size",  # GPT-2: null means 4 x n_embd
    "vocab_size": "vocab_size",
    "max_position_embeddings": "seq_length",
    "n_positions": "seq_length",  # GPT-2
    "tie_word_embeddings": "tied_embeddings",
}
HF_LLAMA_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
HF_GPT2_TYPES = {"gpt2"}
# Activations as each family names them; the llama family's is the gate of a SwiGLU MLP.
HF_ACTIVATIONS = {"llama": {"silu": "swiglu", "swish": "swiglu"},
                  "gpt2": {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu"}}
# Keys that make a different architecture than echo-plan models: never ignored (see _unsupported).
HF_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
HF_MOE_TYPES = {"qwen2_moe", "deepseek_v2", "dbrx", "jamba", "olmoe"}  # MoE families not modelled


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON file that must hold a mapping; errors say the file and the line."""
    p = Path(path)
    text = read_text(p)
    data = parse_json(text, str(p)) if p.suffix.lower() == ".json" else parse_yaml(text, str(p))
    if not isinstance(data, dict):
        raise FileFormatError(str(p), f"expected a mapping of fields, found {type(data).__name__}")
    return data


def is_hf_config(data: dict[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


def model_fields_from_hf(data: dict[str, Any], name: str, path: str = "config.json") -> dict[str, Any]:
    """Translate a Hugging Face config.json mapping into ModelSpec fields (see HF_KEY_MAP)."""
    model_type = str(data.get("model_type", "")).lower()
    if model_type in HF_MOE_FAMILIES:
        return moe_fields_from_hf(data, model_type, name, path)
    moe = [f"{k} {data[k]!r}" for k in HF_MOE_KEYS if data.get(k)]
    if model_type in HF_MOE_TYPES or moe:
        what = moe[0] if moe else f"model_type {model_type!r}"
        raise FileFormatError(path, f"{what}: this mixture-of-experts family is not supported; supported: "
                                    f"{', '.join(HF_MOE_FAMILIES)}")
    if model_type not in HF_LLAMA_TYPES | HF_GPT2_TYPES:
        known = ", ".join(sorted(HF_LLAMA_TYPES | HF_GPT2_TYPES))
        raise FileFormatError(path, f"model_type {model_type!r} is not supported; supported: {known}")
    family = "gpt2" if model_type in HF_GPT2_TYPES else "llama"
    fields: dict[str, Any] = {"name": name, "source": f"Hugging Face config {path}"}
    for key, field in HF_KEY_MAP.items():
        if key in data and data[key] is not None:
            fields[field] = data[key]
    act_key = "activation_function" if family == "gpt2" else "hidden_act"
    act = str(data.get(act_key, "gelu_new" if family == "gpt2" else "silu"))
    if act not in HF_ACTIVATIONS[family]:
        raise FileFormatError(path, f"{act_key} {act!r} is not supported for {model_type}; supported: "
                                    f"{', '.join(HF_ACTIVATIONS[family])}")
    if family == "gpt2":
        fields.update(activation=HF_ACTIVATIONS[family][act], norm="layernorm", position_embedding="learned")
        fields.setdefault("tied_embeddings", True)
    else:
        fields.update(activation=HF_ACTIVATIONS[family][act], norm="rmsnorm", position_embedding="rotary")
        fields.setdefault("tied_embeddings", False)
        if isinstance(fields.get("seq_length"), int):  # long-context configs: train at most at 8k by default
            fields["seq_length"] = min(fields["seq_length"], 8192)
        if model_type == "qwen3":
            fields["qk_norm"] = True  # RMSNorm on each query and key head (Qwen3Attention)
        if model_type == "qwen2":  # Qwen2Attention's q/k/v projections always carry biases: no key says so
            fields["source"] += " (Qwen2's query/key/value biases not modelled)"
        _attention_fields(data, fields, model_type, path)
    _unsupported(data, fields, path)
    return fields


def _windowed_layers(data: dict[str, Any], model_type: str, layers: int) -> list[bool]:
    """Which layers attend over a sliding window, as the family's attention code decides it: ``layer_types``
    where the config lists them; Qwen2/Qwen3 only with ``use_sliding_window``, from layer ``max_window_layers``
    on; Mistral and Llama every layer."""
    types = data.get("layer_types")
    if isinstance(types, list) and types:
        return [t == "sliding_attention" for t in types]
    if model_type in ("qwen2", "qwen3"):
        if not data.get("use_sliding_window", False):
            return [False] * layers
        return [i >= (data.get("max_window_layers") or 0) for i in range(layers)]
    return [True] * layers


def _attention_fields(data: dict[str, Any], fields: dict[str, Any], model_type: str, path: str) -> None:
    """The head width when not hidden_size / heads, and sliding-window attention where its window is shorter
    than the training sequence and its windowed layers are every n-th from layer 0 (the model's pattern)."""
    heads, hidden = fields.get("num_attention_heads"), fields.get("hidden_size")
    head_dim = whole_number(data, "head_dim", path, 1)
    if head_dim is not None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0 \
            and head_dim != hidden // heads:
        fields["attention_head_dim"] = head_dim
    whole_number(data, "max_window_layers", path, 0)
    if not isinstance(data.get("use_sliding_window", False), bool):
        raise FileFormatError(path, f"use_sliding_window {data['use_sliding_window']!r} is not true or false")
    types = data.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise FileFormatError(path, f"layer_types {types!r} is not a list of full_attention / sliding_attention")
    odd = sorted({str(t) for t in types or ()} - {"sliding_attention", "full_attention"})
    if odd:
        raise FileFormatError(path, f"layer_types {odd[0]!r} is not supported; supported: full_attention, "
                                    "sliding_attention")
    window, seq, layers = whole_number(data, "sliding_window", path, 1), fields.get("seq_length"), \
        fields.get("num_layers")
    if not (window is not None and isinstance(seq, int) and isinstance(layers, int) and window < seq):
        return
    windowed = _windowed_layers(data, model_type, layers)
    if len(windowed) != layers:
        raise FileFormatError(path, f"layer_types lists {len(windowed)} layers; num_hidden_layers is {layers}")
    if not any(windowed):
        return
    every = next((n for n in range(1, layers + 1) if windowed == [i % n == 0 for i in range(layers)]), None)
    if every is None:
        shown = ", ".join(str(i) for i, w in enumerate(windowed) if w)
        raise FileFormatError(path, f"sliding_window {window}: windowed layers {shown} are not every n-th layer "
                                    "from layer 0, the only pattern supported; set max_position_embeddings to at "
                                    f"most {window} to simulate full attention")
    fields.update(sliding_window=window, sliding_window_pattern=every)


def _unsupported(data: dict[str, Any], fields: dict[str, Any], path: str) -> None:
    """FileFormatError for keys that change the architecture in ways echo-plan does not model yet:
    a simulation of the dense model instead would be silently wrong."""
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            raise FileFormatError(path, f"{key}: true is not supported for this family yet (biases on some "
                                        "layers only); set it to false to simulate without")
