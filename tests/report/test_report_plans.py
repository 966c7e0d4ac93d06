"""Plans in words and labels, and which knobs differ."""

import pytest

from echo_plan.report.plans import (
    constant_knobs, differing_knobs, knob_differences, num_microbatches, plan_in_words, short_label,
)
from echo_plan.specs import PlanSpec

PLANS = [
    dict(tp=8, pp=4, dp=3, micro_batch_size=1, global_batch_size=1536, virtual_stages=2, recompute="selective",
         sequence_parallel=True, distributed_optimizer=True),
    dict(tp=4, pp=8, dp=3, micro_batch_size=2, global_batch_size=1536, recompute="full"),
    dict(tp=1, pp=1, dp=96, micro_batch_size=1, global_batch_size=1536, schedule="gpipe"),
    dict(tp=2, pp=8, dp=32, ep=64, etp=1, micro_batch_size=1, global_batch_size=1536, sequence_parallel=True,
         expert_imbalance=1.5),
]


@pytest.mark.parametrize("fields", PLANS)
def test_short_label_matches_planspec(fields):
    spec = PlanSpec.build(fields)
    assert short_label(spec.model_dump(mode="json")) == spec.short()


@pytest.mark.parametrize("fields", PLANS)
def test_plan_in_words_names_degrees_and_batch(fields):
    plan = PlanSpec.build(fields).model_dump(mode="json")
    text = plan_in_words(plan)
    assert f"{plan['dp']}-way data parallel" in text or plan["dp"] == 1
    assert f"{num_microbatches(plan)} micro-batches per step" in text
    if plan["tp"] > 1:
        assert f"{plan['tp']}-way tensor parallel" in text
    if plan["pp"] > 1:
        assert f"{plan['pp']} pipeline stages" in text


def test_differing_and_constant_knobs_partition_the_plan_fields():
    plans = [PlanSpec.build(f).model_dump(mode="json") for f in PLANS]
    diff = {k.key for k in differing_knobs(plans)}
    same = {k.key for k, _ in constant_knobs(plans)}
    assert diff.isdisjoint(same)
    assert diff | same == {k for k, v in plans[0].items() if v is not None}
    assert {"tp", "pp", "dp", "micro_batch_size", "recompute"} <= diff
    assert "global_batch_size" in same


def test_knob_differences_lists_only_changed_knobs():
    a = PlanSpec.build(PLANS[0]).model_dump(mode="json")
    b = dict(a, micro_batch_size=2)
    assert knob_differences(a, b) == [("micro-batch size", "1", "2")]
    assert knob_differences(a, a) == []


def test_unknown_plan_fields_still_show_as_knobs():
    plans = [dict(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, new_knob=1),
             dict(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, new_knob=2)]
    assert [k.key for k in differing_knobs(plans)] == ["new_knob"]
