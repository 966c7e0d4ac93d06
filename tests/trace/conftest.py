"""Small models that trace in a fraction of a second, GPT-style and Llama-style."""

import pytest

from echo_plan.specs import ModelSpec


@pytest.fixture(scope="session")
def gpt_small() -> ModelSpec:
    return ModelSpec(name="gpt-small", num_layers=2, hidden_size=256, num_attention_heads=8,
                     vocab_size=1000, seq_length=128)


@pytest.fixture(scope="session")
def llama_small() -> ModelSpec:
    return ModelSpec(name="llama-small", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=4,
                     ffn_hidden_size=512, vocab_size=1000, seq_length=128, activation="swiglu", norm="rmsnorm",
                     position_embedding="rotary", tied_embeddings=False)
