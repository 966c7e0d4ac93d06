"""Plans in words and labels, and which knobs differ."""

import pytest

from echo_plan.report.plans import (
    constant_knobs, differing_knobs, knob_differences, knob_value, knobs_of, num_microbatches, plan_in_words,
    short_label,
)
from echo_plan.specs import PlanSpec

PLANS = [
    dict(tp=8, pp=4, dp=3, micro_batch_size=1, global_batch_size=1536, virtual_stages=2, recompute="selective",
         sequence_parallel=True, distributed_optimizer=True),
    dict(tp=4, pp=8, dp=3, micro_batch_size=2, global_batch_size=1536, recompute="full"),
    dict(tp=1, pp=1, dp=96, micro_batch_size=1, global_batch_size=1536, schedule="gpipe"),
    dict(tp=2, pp=8, dp=32, ep=64, etp=1, micro_batch_size=1, global_batch_size=1536, sequence_parallel=True,
         expert_imbalance=1.5),
    # the knobs later stops added: each once in a label, so the report cannot fall behind simulate's and search's
    dict(tp=8, pp=2, dp=16, micro_batch_size=1, global_batch_size=1536, sequence_parallel=True,
         sharding="parameters", shard_degree=8, recompute_layers=3, dtype="fp8"),
    dict(tp=1, pp=1, dp=64, micro_batch_size=2, global_batch_size=1536, sharding="gradients",
         offload_optimizer=True, offload_fraction=0.5),
    dict(tp=2, pp=4, dp=8, micro_batch_size=1, global_batch_size=512, schedule="zb-h1", distributed_optimizer=True),
    dict(tp=1, pp=1, dp=64, micro_batch_size=1, global_batch_size=512, sharding="parameters",
         reshard_after_forward=False, recompute="selective", recompute_layers=2),
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


@pytest.mark.parametrize("fields", PLANS)
def test_plan_in_words_says_what_data_parallelism_shards(fields):
    plan = PlanSpec.build(fields).model_dump(mode="json")
    text = plan_in_words(plan)
    words = {"none": None, "optimizer": "distributed (sharded) optimizer", "gradients": "(ZeRO-2)",
             "parameters": "(FSDP, ZeRO-3)"}[plan["sharding"] or ("optimizer" if plan["distributed_optimizer"]
                                                                 else "none")]
    assert words is None or words in text
    assert ("HSDP" in text) == (plan["shard_degree"] not in (None, plan["dp"] * plan["cp"]))
    assert ("CPU memory" in text) == plan["offload_optimizer"]
    assert (f"{plan['recompute_layers']} layers of each model chunk recomputed whole" in text) == \
        bool(plan["recompute_layers"])
    assert "dist-opt" not in short_label(plan) or plan["sharding"] in (None, "optimizer")


def test_a_dense_plan_shows_no_expert_knobs():
    """etp follows tp in a dense model's plan: it must not show as a knob that differs between plans."""
    plans = [PlanSpec.build(f).model_dump(mode="json") for f in (PLANS[0], PLANS[1])]
    assert plans[0]["etp"] != plans[1]["etp"]
    assert not {"ep", "etp", "expert_imbalance"} & {k.key for k in differing_knobs(plans)}
    assert not {"ep", "etp", "expert_imbalance"} & {k.key for k, _ in constant_knobs(plans)}
    moe = PlanSpec.build(PLANS[3]).model_dump(mode="json")
    assert "etp" in {k.key for k in differing_knobs(plans + [moe])}


def test_an_hsdp_runner_up_is_told_in_words():
    a = PlanSpec.build(dict(PLANS[4], shard_degree=None)).model_dump(mode="json")
    b = PlanSpec.build(PLANS[4]).model_dump(mode="json")
    assert [(n, x, y) for n, x, y in knob_differences(a, b)] == [
        ("ranks per HSDP shard group", "all", "8")]


def test_differing_and_constant_knobs_partition_the_plan_fields():
    plans = [PlanSpec.build(f).model_dump(mode="json") for f in PLANS]
    diff = {k.key for k in differing_knobs(plans)}
    same = {k.key for k, _ in constant_knobs(plans)}
    assert diff.isdisjoint(same)
    shown = {k.key for k in knobs_of(plans)  # a knob someone sees: set, and applying to its plan, in some plan
             if any(p.get(k.key) is not None and knob_value(p, k) != "-" for p in plans)}
    assert diff | same == shown
    assert {"tp", "sharding", "shard_degree", "recompute_layers", "etp"} <= shown
    assert {"tp", "pp", "dp", "micro_batch_size", "recompute"} <= diff
    assert "cp" in same and "global_batch_size" in diff


def test_knob_differences_lists_only_changed_knobs():
    a = PlanSpec.build(PLANS[0]).model_dump(mode="json")
    b = dict(a, micro_batch_size=2)
    assert knob_differences(a, b) == [("micro-batch size", "1", "2")]
    assert knob_differences(a, a) == []


def test_unknown_plan_fields_still_show_as_knobs():
    plans = [dict(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, new_knob=1),
             dict(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, new_knob=2)]
    assert [k.key for k in differing_knobs(plans)] == ["new_knob"]


def test_derived_and_idle_knobs_read_as_not_applying():
    """An FSDP plan's distributed_optimizer (the name of every sharding level) and an unused offload share or
    density say nothing of their own: they read "-" and are not listed as settings every plan shares."""
    fsdp = PlanSpec.build(PLANS[4]).model_dump(mode="json")
    assert fsdp["distributed_optimizer"] and fsdp["offload_fraction"] == 1.0
    shown = {k.key: knob_value(fsdp, k) for k in knobs_of([fsdp])}
    assert shown["distributed_optimizer"] == shown["offload_fraction"] == shown["density"] == "-"
    assert shown["sharding"] == "parameters" and shown["shard_degree"] == "8"
    megatron = PlanSpec.build(PLANS[0]).model_dump(mode="json")
    assert dict((k.key, v) for k, v in constant_knobs([megatron]))["distributed_optimizer"] == "on"
    offload = PlanSpec.build(PLANS[5]).model_dump(mode="json")
    assert {k.key: knob_value(offload, k) for k in knobs_of([offload])}["offload_fraction"] == "0.5"
