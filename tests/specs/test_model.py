import json

import pytest

from echo_plan.errors import FileFormatError, SpecError, UnknownPresetError
from echo_plan.specs import Activation, ModelSpec, Norm, load_model, model_names


def test_every_preset_loads_with_a_source():
    for name in model_names():
        m = load_model(name)
        assert m.name == name
        assert m.source, f"preset {name} must say where its numbers come from"


@pytest.mark.parametrize(
    "name,billions",
    [("gpt3-175b", 175), ("llama2-7b", 6.7), ("llama2-70b", 69), ("llama3-8b", 8.0),
     ("llama3-70b", 70.6), ("llama3-405b", 405)],
)
def test_parameter_counts_match_published_sizes(name, billions):
    assert load_model(name).num_params / 1e9 == pytest.approx(billions, rel=0.03)


def test_issue_figures_for_gpt_family():
    expected = {"gpt3-175b": (96, 12288, 96), "gpt-13b": (40, 5120, 32), "gpt-30b": (40, 7680, 48),
                "gpt-40b": (40, 9216, 72), "gpt-70b": (80, 8192, 64)}
    for name, (layers, hidden, heads) in expected.items():
        m = load_model(name)
        assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, hidden, heads)
        assert m.seq_length == 2048 and m.ffn_size == 4 * hidden


def test_defaults_kv_heads_and_ffn():
    gpt = ModelSpec.build(dict(name="g", num_layers=2, hidden_size=64, num_attention_heads=4,
                               vocab_size=100, seq_length=16))
    assert gpt.kv_heads == 4 and gpt.ffn_size == 256
    llama = ModelSpec.build(dict(name="l", num_layers=2, hidden_size=4096, num_attention_heads=32,
                                 vocab_size=100, seq_length=16, activation="swiglu", norm="rmsnorm"))
    assert llama.ffn_size == 11008  # Llama-2 7B's width
    assert llama.activation is Activation.SWIGLU and llama.norm is Norm.RMSNORM


@pytest.mark.parametrize(
    "changes,field",
    [({"num_kv_heads": 3}, "num_kv_heads"), ({"hidden_size": 65}, "hidden_size"),
     ({"num_layers": 0}, "num_layers"), ({"activation": "relu"}, "activation"), ({"bogus": 1}, "bogus")],
)
def test_invalid_models_name_the_field(changes, field):
    data = dict(name="g", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)
    data.update(changes)
    with pytest.raises(SpecError) as err:
        ModelSpec.build(data)
    assert field in str(err.value)


def test_unknown_preset_lists_known():
    with pytest.raises(UnknownPresetError) as err:
        load_model("gpt5")
    assert "gpt3-175b" in str(err.value) and "llama3-8b" in str(err.value)


def test_yaml_and_json_files(tmp_path):
    y = tmp_path / "tiny.yaml"
    y.write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 100\nseq_length: 16\n")
    assert load_model(str(y)).name == "tiny"
    j = tmp_path / "tiny.json"
    j.write_text(json.dumps({"name": "t", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                             "vocab_size": 100, "seq_length": 16}))
    assert load_model(str(j)).hidden_size == 64


def test_malformed_yaml_says_the_line(tmp_path):
    y = tmp_path / "bad.yaml"
    y.write_text("num_layers: 2\nhidden_size: [64\nnum_attention_heads: 4\n")
    with pytest.raises(FileFormatError) as err:
        load_model(str(y))
    assert "line" in str(err.value) and "bad.yaml" in str(err.value)


def test_malformed_json_says_the_line(tmp_path):
    j = tmp_path / "bad.json"
    j.write_text('{\n "num_layers": 2,\n "hidden_size": \n}')
    with pytest.raises(FileFormatError) as err:
        load_model(str(j))
    assert "line 4" in str(err.value)


def test_hugging_face_llama_config(tmp_path):
    d = tmp_path / "Llama-3-8B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    }))
    m = load_model(str(d / "config.json"))
    assert m.name == "Llama-3-8B"
    assert (m.num_layers, m.kv_heads, m.ffn_size, m.vocab_size) == (32, 8, 14336, 128256)
    assert m.activation is Activation.SWIGLU and not m.tied_embeddings
    assert m.num_params == load_model("llama3-8b").num_params


def test_hugging_face_gpt2_config(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                             "n_positions": 1024, "vocab_size": 50257, "n_inner": None}))
    m = load_model(str(p))
    assert m.ffn_size == 3072 and m.activation is Activation.GELU and m.tied_embeddings
    assert m.num_params / 1e6 == pytest.approx(124, rel=0.02)  # GPT-2 small


def test_unsupported_hf_family(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "t5", "d_model": 512}))
    with pytest.raises(FileFormatError) as err:
        load_model(str(p))
    assert "t5" in str(err.value) and "llama" in str(err.value)


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
         "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 4096}


@pytest.mark.parametrize("changes, says", [
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "mixture-of-experts"),  # a Mixtral config
    ({"model_type": "mixtral"}, "a mixtral config.json needs"),  # a family we model, keys missing
    ({"model_type": "qwen2_moe", "num_experts": 60}, "mixture-of-experts"),
    ({"hidden_act": "relu"}, "hidden_act 'relu'"),
    ({"attention_bias": True}, "attention_bias"),
    ({"model_type": "gemma2"}, "model_type 'gemma2' is not supported"),
    ({"sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"] * 2},
     "layer_types lists 4 layers; num_hidden_layers is 2"),
    ({"layer_types": ["chunked_attention", "full_attention"]}, "layer_types 'chunked_attention'"),
    ({"layer_types": "sliding_attention"}, "is not a list"),
    # a malformed number is an error, never a key ignored or (true) read as 1
    ({"model_type": "mistral", "sliding_window": True}, "sliding_window True is not a whole number"),
    ({"model_type": "mistral", "sliding_window": "4k"}, "sliding_window '4k' is not a whole number"),
    ({"model_type": "mistral", "sliding_window": -5}, "sliding_window -5 is not a whole number of at least 1"),
    ({"head_dim": 7.5}, "head_dim 7.5 is not a whole number"),
    ({"model_type": "qwen2", "use_sliding_window": "yes"}, "use_sliding_window 'yes' is not true or false"),
    ({"model_type": "qwen2", "max_window_layers": "all"}, "max_window_layers 'all' is not a whole number"),
])
def test_hf_keys_that_change_the_architecture_are_errors(tmp_path, changes, says):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA, **changes}))
    with pytest.raises(FileFormatError) as err:
        load_model(str(p))
    assert says in str(err.value)


@pytest.mark.parametrize("changes", [
    {"model_type": "mistral", "sliding_window": 4096},  # the window covers the whole sequence
    {"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": False},
    {"model_type": "qwen2", "sliding_window": 1024},  # Qwen2's windows are off unless use_sliding_window says on
    {"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 2},
    {"sliding_window": 1024, "layer_types": ["full_attention", "full_attention"]},
    {"head_dim": 64, "hidden_act": "silu", "attention_bias": False},
])
def test_hf_keys_that_change_nothing_are_accepted(tmp_path, changes):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA, **changes}))
    assert load_model(str(p)).num_layers == 2


def test_hf_keys_that_change_nothing_leave_full_attention(tmp_path):
    for changes in ({"model_type": "qwen2", "sliding_window": 1024},
                    {"sliding_window": 1024, "layer_types": ["full_attention", "full_attention"]}):
        p = tmp_path / "config.json"
        p.write_text(json.dumps({**LLAMA, **changes}))
        assert load_model(str(p)).sliding_window is None


QWEN3_32B = {  # Hugging Face Qwen/Qwen3-32B config.json (the keys read)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "head_dim": 128,
    "intermediate_size": 25600, "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
    "attention_bias": False, "sliding_window": None, "use_sliding_window": False, "max_window_layers": 64}


def test_a_qwen3_dense_config_keeps_its_head_width_and_qk_norm(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN3_32B))
    m = load_model(str(p))
    assert (m.attention_head_dim, m.qk_norm, m.kv_heads, m.seq_length) == (128, True, 8, 8192)
    assert m.num_params / 1e9 == pytest.approx(32.8, rel=0.01)  # Qwen3-32B: 32.8B parameters (model card)


@pytest.mark.parametrize("changes, window, every", [
    ({"model_type": "mistral", "sliding_window": 1024}, 1024, 1),  # Mistral: every layer windowed
    ({"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}, 512, 2),
    ({"model_type": "qwen2", "sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 0}, 1024, 1),
])
def test_sliding_windows_shorter_than_the_sequence_are_modelled(tmp_path, changes, window, every):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA, **changes}))
    m = load_model(str(p))
    assert (m.sliding_window, m.sliding_window_pattern) == (window, every)


def test_windowed_layers_that_are_not_every_nth_are_an_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA, "num_hidden_layers": 4, "sliding_window": 1024, "model_type": "qwen2",
                             "use_sliding_window": True, "max_window_layers": 2}))
    with pytest.raises(FileFormatError, match="windowed layers 2, 3 are not every n-th layer from layer 0") as err:
        load_model(str(p))
    assert "\n" not in str(err.value)


def test_a_hf_config_file_not_named_config_json_is_named_by_its_file(tmp_path):
    d = tmp_path / "downloads"
    d.mkdir()
    (d / "mistral-7b.json").write_text(json.dumps({**LLAMA, "model_type": "mistral", "sliding_window": 1024}))
    m = load_model(str(d / "mistral-7b.json"))
    assert m.name == "mistral-7b" and m.sliding_window == 1024


def test_a_folder_holding_config_json_is_a_model(tmp_path):
    d = tmp_path / "my-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA))
    m = load_model(str(d))
    assert m.name == "my-llama" and m.hidden_size == 256
    with pytest.raises(FileFormatError, match="is a folder"):
        load_model(str(tmp_path))  # a folder without config.json
