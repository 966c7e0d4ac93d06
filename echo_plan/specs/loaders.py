"""Reading spec files: YAML/JSON with line numbers in errors, and Hugging Face config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from echo_plan.errors import FileFormatError
from echo_plan.files import read_text

# Hugging Face config.json keys -> ModelSpec fields (Llama, Mistral, Qwen2 and GPT-2 families).
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
HF_LLAMA_TYPES = {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe"}
HF_GPT2_TYPES = {"gpt2"}


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON file that must hold a mapping; errors say the file and the line."""
    p = Path(path)
    text = read_text(p)
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FileFormatError(str(p), f"malformed JSON: {exc.msg}", exc.lineno) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
            raise FileFormatError(str(p), f"malformed YAML: {exc.problem}", line) from None
        except yaml.YAMLError as exc:
            raise FileFormatError(str(p), f"malformed YAML: {exc}") from None
    if not isinstance(data, dict):
        raise FileFormatError(str(p), f"expected a mapping of fields, found {type(data).__name__}")
    return data


def is_hf_config(data: dict[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


def model_fields_from_hf(data: dict[str, Any], name: str, path: str = "config.json") -> dict[str, Any]:
    """Translate a Hugging Face config.json mapping into ModelSpec fields (see HF_KEY_MAP)."""
    model_type = str(data.get("model_type", "")).lower()
    if model_type not in HF_LLAMA_TYPES | HF_GPT2_TYPES:
        known = ", ".join(sorted(HF_LLAMA_TYPES | HF_GPT2_TYPES))
        raise FileFormatError(path, f"model_type {model_type!r} is not supported; supported: {known}")
    fields: dict[str, Any] = {"name": name, "source": f"Hugging Face config {path}"}
    for key, field in HF_KEY_MAP.items():
        if key in data and data[key] is not None:
            fields[field] = data[key]
    if model_type in HF_GPT2_TYPES:
        fields.update(activation="gelu", norm="layernorm", position_embedding="learned")
        fields.setdefault("tied_embeddings", True)
    else:
        fields.update(activation="swiglu", norm="rmsnorm", position_embedding="rotary")
        fields.setdefault("tied_embeddings", False)
        if "seq_length" in fields:  # long-context configs: train at most at 8k by default
            fields["seq_length"] = min(int(fields["seq_length"]), 8192)
    return fields
