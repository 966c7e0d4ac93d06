"""Hugging Face config.json of the MoE families -> the same shapes as the presets."""

from __future__ import annotations

import json

import pytest

from echo_plan.errors import EchoPlanError
from echo_plan.specs import load_model

DEEPSEEK_V3 = {  # keys of deepseek-ai/DeepSeek-V3 config.json
    "model_type": "deepseek_v3", "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "scoring_func": "sigmoid",
    "tie_word_embeddings": False, "v_head_dim": 128, "vocab_size": 129280, "n_group": 8, "topk_group": 4}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False}


def write(tmp_path, data):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(data))
    return str(p)


def test_deepseek_v3_config_matches_the_preset_plus_its_mtp_module(tmp_path):
    m = load_model(write(tmp_path, DEEPSEEK_V3))
    preset = load_model("deepseek-v3")
    assert m.moe == preset.moe and m.mla == preset.mla and m.mtp_layers == 1
    assert m.num_params - m.mtp_params == preset.num_params
    assert (m.moe.routing_groups, m.moe.groups_per_token) == (8, 4)  # node-limited routing
    assert [m.moe.server_limit(n) for n in (1, 2, 8, 16)] == [1, 2, 4, 8]  # a group spans 2 of 16 servers


def test_mixtral_config_matches_the_preset(tmp_path):
    m = load_model(write(tmp_path, MIXTRAL))
    assert m.num_params == load_model("mixtral-8x7b").num_params


@pytest.mark.parametrize("family, key, value", [("gpt_oss", "head_dim", True), ("gpt_oss", "sliding_window", "128"),
                                                ("qwen3_moe", "head_dim", 12.5)])
def test_a_malformed_width_or_window_is_named_not_misread(tmp_path, family, key, value):
    data = {**MIXTRAL, "model_type": family, "num_experts": 8, "moe_intermediate_size": 1024, key: value}
    with pytest.raises(EchoPlanError, match=f"{key} .* is not a whole number"):
        load_model(write(tmp_path, data))


@pytest.mark.parametrize("key", ["n_routed_experts", "kv_lora_rank", "num_experts_per_tok"])
def test_a_missing_key_is_named(tmp_path, key):
    data = dict(DEEPSEEK_V3)
    del data[key]
    with pytest.raises(EchoPlanError, match=key):
        load_model(write(tmp_path, data))
