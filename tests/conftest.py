"""Suite-wide settings.

The suite runs on ``pytest -n 2`` (two xdist workers on the 2-core CI machine); a search's default of
one worker process per CPU would start two more processes per search test on top. Searches here run
in-process unless a test asks for processes (tests/search/test_process_pool.py exercises the pool and
the default count)."""

from __future__ import annotations

import os

os.environ.setdefault("ECHO_PLAN_PROCESSES", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def small_moe():
    """A four-layer MoE model (16 experts, top-2, the first layer dense) small enough to trace in a blink."""
    from echo_plan.specs import ModelSpec

    return ModelSpec.build(dict(
        name="small-moe", num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=4, vocab_size=4096,
        seq_length=512, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=1024,
        tied_embeddings=False, moe=dict(num_experts=16, top_k=2, expert_ffn_hidden_size=256, first_dense_layers=1)))


@pytest.fixture(scope="session")
def small_dense():
    """A four-layer Llama-style model small enough to trace and simulate in a blink."""
    from echo_plan.specs import ModelSpec

    return ModelSpec.build(dict(
        name="small-dense", num_layers=4, hidden_size=1024, num_attention_heads=8, num_kv_heads=4, vocab_size=4096,
        seq_length=1024, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=2816,
        tied_embeddings=False))
