"""Which layer kinds each pipeline rank holds: every layer is on exactly one rank, in model order."""

from __future__ import annotations

from collections import Counter

import pytest

from echo_plan.layout.layer_mix import all_stage_kind_counts, kind_counts, stage_kind_counts
from echo_plan.specs import ModelSpec, PlanSpec


@pytest.fixture(scope="module")
def moe() -> ModelSpec:  # dense first layers, then MoE: the rank a layer lands on decides its kind
    return ModelSpec.build(dict(
        name="mix", num_layers=12, hidden_size=256, num_attention_heads=4, num_kv_heads=4, vocab_size=1024,
        seq_length=256, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        moe=dict(num_experts=8, top_k=2, expert_ffn_hidden_size=128, first_dense_layers=3)))


def naive(model: ModelSpec, plan: PlanSpec, stage: int) -> dict:
    per_chunk = plan.virtual_layers(model.num_layers)
    out: Counter = Counter()
    for c in range(plan.virtual_stages):
        vs = c * plan.pp + stage
        for kind, n in kind_counts(model, sum(per_chunk[:vs]), per_chunk[vs]):
            out[kind] += n
    return dict(out)


@pytest.mark.parametrize("fields", [
    dict(pp=1), dict(pp=2), dict(pp=3), dict(pp=2, virtual_stages=3, schedule="interleaved"),
    dict(pp=2, virtual_stages=2, schedule="interleaved", layer_split=[2, 3, 4, 3]),
    dict(pp=4, layer_split=[2, 4, 4, 2]),
])
def test_all_ranks_at_once_equal_each_rank_alone(moe, fields):
    plan = PlanSpec(**fields, dp=1, global_batch_size=8)
    every = all_stage_kind_counts(moe, plan)
    assert len(every) == plan.pp
    for s in range(plan.pp):
        assert every[s] == naive(moe, plan, s) == stage_kind_counts(moe, plan, s)
        assert list(every[s]) == list(naive(moe, plan, s))  # same order of first appearance
    total: Counter = Counter()
    for counts in every:
        total.update(counts)
    assert dict(total) == dict(Counter(moe.layer_kinds()))
