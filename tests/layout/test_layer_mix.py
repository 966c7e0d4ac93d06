"""Which layer kinds each pipeline rank holds: every layer is on exactly one rank, in model order."""

from __future__ import annotations

from collections import Counter

import pytest

from echo_plan.layout.layer_mix import all_stage_kind_counts, kind_counts, output_rank, stage_kind_counts
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
        # ZB-V's V: rank s holds stages s and 2 pp - 1 - s (Qi et al. 2024, figure 4); otherwise round-robin
        vs = (stage if c == 0 else 2 * plan.pp - 1 - stage) if plan.schedule.value == "zb-v" else c * plan.pp + stage
        for kind, n in kind_counts(model, sum(per_chunk[:vs]), per_chunk[vs]):
            out[kind] += n
    return dict(out)


@pytest.mark.parametrize("fields", [
    dict(pp=1), dict(pp=2), dict(pp=3), dict(pp=2, virtual_stages=3, schedule="interleaved"),
    dict(pp=2, virtual_stages=2, schedule="interleaved", layer_split=[2, 3, 4, 3]),
    dict(pp=4, layer_split=[2, 4, 4, 2]),
    dict(pp=2, schedule="zb-v"), dict(pp=3, schedule="zb-v", layer_split=[1, 2, 2, 2, 2, 3]),
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


@pytest.mark.parametrize("fields, rank", [
    (dict(pp=1), 0), (dict(pp=4), 3), (dict(pp=2, virtual_stages=3, schedule="interleaved"), 1),
    (dict(pp=4, schedule="zb-v"), 0), (dict(pp=4, schedule="dualpipe"), 3),
])
def test_the_output_layer_is_on_the_rank_holding_the_last_stage(fields, rank):
    """In ZB-V's V rank 0 holds the first and the last stage, so the output layer and the loss are its."""
    plan = PlanSpec(**fields, dp=1, global_batch_size=16)
    assert output_rank(plan) == rank


def test_a_v_puts_both_ends_of_the_model_on_rank_zero(moe):
    """pp 3 in a V: rank 0 holds stages 0 and 5, the model's first and last layers (dense first layers, MoE last)."""
    plan = PlanSpec(pp=3, schedule="zb-v", dp=1, global_batch_size=8, layer_split=[1, 2, 2, 2, 2, 3])
    first, last = stage_kind_counts(moe, plan, 0), stage_kind_counts(moe, plan, 2)
    assert sum(first.values()) == 1 + 3 and sum(last.values()) == 2 + 2
    assert any(not k.moe for k in first) and any(k.moe for k in first)
