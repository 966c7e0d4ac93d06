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


@pytest.mark.parametrize("schedule, pp, passes, layers", [("1f1b", 2, 8 * 3, 3), ("dualpipe", 2, 4 * 3 + 4 * 3, 6)])
def test_the_exchange_note_counts_every_moe_kind_and_dualpipes_two_copies(schedule, pp, passes, layers):
    """Six MoE layers alternating sliding-window and full attention (two traced kinds, as GPT-OSS): the note's
    per-step exchange counts both kinds, and a DualPipe rank both copies' stages with half the micro-batches each."""
    from types import SimpleNamespace

    from echo_plan.layout.layer_mix import all_to_all_note, expert_exchange_per_step
    from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

    model = ModelSpec.build(dict(
        name="windows", num_layers=6, hidden_size=256, num_attention_heads=4, num_kv_heads=4, vocab_size=1024,
        seq_length=256, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        sliding_window=64, sliding_window_pattern=2, moe=dict(num_experts=8, top_k=2, expert_ffn_hidden_size=128)))
    plan = PlanSpec.build(dict(pp=pp, dp=4, ep=4, global_batch_size=32, schedule=schedule))
    assert len({k for k in model.layer_kinds()}) == 2 and plan.num_microbatches == 8
    op = SimpleNamespace(collective=SimpleNamespace(kind=CollectiveKind.ALL_TO_ALL, nbytes=1 << 20,
                                                    group=CommGroup(GroupKind.EP, 4)))
    traces = SimpleNamespace(blocks=[(k, SimpleNamespace(collectives=[op, op])) for k in model.distinct_kinds()])
    note = all_to_all_note(model, plan, traces, lambda kind, nbytes, group: 1e-3, 8)
    assert f"{passes * 2 * 1e-3:.2f} s per step on the stage with {layers} MoE layers" in note
    assert expert_exchange_per_step(model, plan, traces, lambda kind, nbytes, group: 1e-3, 0) == \
        pytest.approx(passes * 2 * 1e-3)
