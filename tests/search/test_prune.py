"""Pruning: counts add up, every surviving plan is valid and fits, duplicates collapse, reasons are right."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from echo_plan.cost.memory import estimate_memory
from echo_plan.search.prune import PruneReason, Pruner, canonical, closed_form_memory, prune_space
from echo_plan.search.space import load_space, space_from_mapping
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack, validate_plan

MODEL = load_model("gpt-13b")


def _pruned(gpus=64, gbs=512, space=None, model=MODEL):
    cluster = load_cluster("h800", gpus=gpus)
    return cluster, prune_space(Pruner(model, cluster, gbs, space or load_space()))


def test_counts_add_up_and_survivors_are_valid_and_fit():
    cluster, pruned = _pruned()
    assert sum(pruned.counts().values()) + len(pruned.valid) == pruned.total == load_space().size
    assert pruned.valid
    for v in pruned.valid:
        validate_plan(v.plan, MODEL, cluster)
        assert all(m.fits for m in v.memory)
        assert v.plan.world_size == cluster.num_gpus


def test_survivors_are_distinct_plans():
    _, pruned = _pruned()
    dumps = [tuple(sorted(v.plan.model_dump(mode="json").items(), key=str)) for v in pruned.valid]
    assert len(set(map(str, dumps))) == len(dumps)


def test_duplicates_point_at_a_combination_with_the_same_plan():
    _, pruned = _pruned()
    dups = [v for v in pruned.verdicts if v.reason is PruneReason.DUPLICATE]
    assert dups
    for v in dups:
        first = pruned.verdicts[v.same_as]
        assert first.plan.model_dump() == v.plan.model_dump()
        assert canonical(first.combo, v.plan.dp) == canonical(v.combo, v.plan.dp)


def test_dp1_plans_differ_only_in_what_dp_changes():
    # one data-parallel replica: the distributed optimizer and the DP overlap switches change nothing,
    # so those variants are one plan (they used to be ranked twice with the same step time)
    space = space_from_mapping({"knobs": {"tp": [8], "pp": [8], "distributed_optimizer": [True, False],
                                          "overlap_grad_reduce": [True, False]}})
    model, cluster = load_model("gpt3-175b"), load_cluster("h800", gpus=64)
    pruned = prune_space(Pruner(model, cluster, 64, space, memory=lambda *_: ()))
    assert len(pruned.valid) == 1
    assert not pruned.valid[0].plan.distributed_optimizer
    assert sum(v.reason is PruneReason.DUPLICATE for v in pruned.verdicts) == 3


def test_tp_beyond_a_server_is_pruned_for_that_reason():
    space = space_from_mapping({"knobs": {"tp": [8, 16], "pp": [1, 2, 4]}, "fixed": {"recompute": "full"}})
    _, pruned = _pruned(space=space)
    for v in pruned.verdicts:
        if v.combo["tp"] == 16:
            assert v.reason is PruneReason.TP_NODE
    allowed = space_from_mapping({"knobs": {"tp": [16]}, "constraints": {"tp_within_node": False}})
    _, pruned = _pruned(space=allowed)
    assert all(v.reason is not PruneReason.TP_NODE for v in pruned.verdicts)


def test_memory_is_checked_against_the_gpu():
    # 175B on 8 GPUs cannot hold its weights and optimizer states
    space = space_from_mapping({"knobs": {"tp": [8]}, "fixed": {"recompute": "full"}})
    _, pruned = _pruned(gpus=8, gbs=16, space=space, model=load_model("gpt3-175b"))
    assert pruned.counts() == {PruneReason.OOM_ESTIMATE.value: 1}
    assert "GiB" in pruned.verdicts[0].detail


def test_batch_and_gpu_divisibility_reasons():
    space = space_from_mapping({"knobs": {"tp": [1], "pp": [3, 4], "micro_batch_size": [3]}})
    _, pruned = _pruned(space=space, gbs=80)
    reasons = {v.combo["pp"]: v.reason for v in pruned.verdicts}
    assert reasons[3] is PruneReason.GPUS  # 64 GPUs
    assert reasons[4] is PruneReason.BATCH  # dp 16 x mbs 3 does not divide 80


def test_closed_form_memory_uses_the_stack_and_the_headroom():
    cluster = load_cluster("h800", gpus=64)
    stack = load_stack("megatron-lm-2022")
    for fields in ({"tp": 2, "pp": 4, "dp": 8}, {"tp": 8, "pp": 2, "dp": 4, "recompute": "full", "micro_batch_size": 2},
                   {"tp": 4, "pp": 4, "dp": 4, "virtual_stages": 2, "distributed_optimizer": True,
                    "sequence_parallel": True, "recompute": "selective"}):
        plan = PlanSpec.build(dict(fields, global_batch_size=512))
        assert closed_form_memory(stack, 5 * 2**30)(MODEL, plan, cluster) == estimate_memory(
            MODEL, plan, cluster, stack, 5 * 2**30)


def test_more_headroom_never_lets_more_plans_through():
    cluster = load_cluster("h800", gpus=64)
    counts = []
    for gib in (0, 8, 30):
        pruned = prune_space(Pruner(MODEL, cluster, 512, load_space(), memory_headroom_bytes=gib * 2**30))
        counts.append({id(v.combo) for v in pruned.valid} and len(pruned.valid))
        assert all(m.headroom_bytes == gib * 2**30 for v in pruned.valid for m in v.memory)
    assert counts[0] >= counts[1] >= counts[2] and counts[0] > counts[2]


def test_plans_the_stack_cannot_run_are_pruned_with_that_reason():
    cluster = load_cluster("h800", gpus=64)
    pruned = prune_space(Pruner(MODEL, cluster, 512, load_space(), stack=load_stack("megatron-lm-2021")))
    assert pruned.counts().get(PruneReason.STACK.value, 0) > 0
    for v in pruned.valid:
        assert not v.plan.sequence_parallel and not v.plan.distributed_optimizer and v.plan.recompute.value != "selective"


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 3, 4, 5, 8]), mbs=st.sampled_from([1, 2, 3]),
       vpp=st.sampled_from([1, 2, 3]),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"]),
       sp=st.booleans(), gbs=st.sampled_from([64, 96, 100, 512]))
def test_a_verdict_without_reason_is_always_a_runnable_plan(tp, pp, mbs, vpp, schedule, sp, gbs):
    cluster = load_cluster("h800", gpus=32)
    space = load_space()
    pruner = Pruner(MODEL, cluster, gbs, space, memory=closed_form_memory())
    combo = {"tp": tp, "pp": pp, "micro_batch_size": mbs, "virtual_stages": vpp, "schedule": schedule,
             "recompute": "none", "sequence_parallel": sp, "distributed_optimizer": True,
             "overlap_grad_reduce": True, "overlap_param_gather": True}
    v = pruner.check(combo)
    if v.reason is None:
        validate_plan(v.plan, MODEL, cluster)
        assert v.plan.global_batch_size == gbs and v.plan.micro_batch_size == mbs
    else:
        assert isinstance(v.reason, PruneReason) and v.detail


def test_precision_is_a_knob_and_fp8_is_pruned_where_the_gpu_has_no_fp8():
    space = space_from_mapping({"knobs": {"tp": [2, 4], "dtype": ["bf16", "fp8"]},
                                "fixed": {"sequence_parallel": True, "distributed_optimizer": True}})
    model = load_model("llama3-8b")
    for preset, fp8_ok in (("dgx-h100", True), ("dgx-a100", False)):
        cluster = load_cluster(preset, gpus=16)
        pruned = prune_space(Pruner(model, cluster, 64, space))
        dtypes = {v.plan.dtype.value for v in pruned.valid}
        assert dtypes == ({"bf16", "fp8"} if fp8_ok else {"bf16"})
        reasons = {v.reason for v in pruned.verdicts if v.combo["dtype"] == "fp8"}
        assert reasons == ({None} if fp8_ok else {PruneReason.PRECISION})
        if not fp8_ok:
            detail = next(v.detail for v in pruned.verdicts if v.reason is PruneReason.PRECISION)
            assert cluster.gpu.name in detail


def test_long_sequences_that_do_not_fit_without_cp_are_pruned_with_that_reason():
    model = load_model("llama3-70b").replace(seq_length=131072)
    space = space_from_mapping({"knobs": {"tp": [8], "cp": [1, 16], "pp": [2], "recompute": ["none"]},
                                "fixed": {"sequence_parallel": True, "distributed_optimizer": True}})
    cluster = load_cluster("h800", gpus=256)
    pruned = prune_space(Pruner(model, cluster, 16, space))
    by_cp = {v.combo["cp"]: v for v in pruned.verdicts}
    assert by_cp[1].reason is PruneReason.NEEDS_CP
    assert "context parallelism" in by_cp[1].detail
    assert by_cp[16].reason is None and by_cp[16].plan.cp == 16 and by_cp[16].plan.dp == 1


def test_cp_that_does_not_split_the_sequence_is_pruned_with_its_reason():
    model = load_model("llama3-8b").replace(seq_length=8188)  # 8188 / 6 is not whole for cp 3
    space = space_from_mapping({"knobs": {"tp": [1], "cp": [3]}})
    cluster = load_cluster("h800", gpus=24)
    pruned = prune_space(Pruner(model, cluster, 24, space))
    assert pruned.verdicts[0].reason is PruneReason.CP_SEQUENCE


def test_schedule_rules_prune_with_their_reason():
    cluster = load_cluster("h800", gpus=32)
    pruner = Pruner(MODEL, cluster, 64, load_space(), memory=closed_form_memory())
    base = {"tp": 8, "pp": 4, "micro_batch_size": 1, "virtual_stages": 1, "recompute": "none",
            "sequence_parallel": True, "distributed_optimizer": True, "overlap_grad_reduce": True,
            "overlap_param_gather": True}
    # dp 1, gbs 64: 64 micro-batches; DualPipe with pp 4 runs, with pp 2 too; odd pp does not
    assert pruner.check(dict(base, schedule="dualpipe")).reason is None
    odd = Pruner(load_model("gpt-13b"), load_cluster("h800", gpus=40), 60, load_space()).check(
        dict(base, tp=8, pp=5, schedule="dualpipe"))
    assert odd.reason is PruneReason.SCHEDULE and "even number of pipeline stages" in odd.detail
    few = Pruner(MODEL, cluster, 4, load_space()).check(dict(base, schedule="dualpipe"))
    assert few.reason is PruneReason.SCHEDULE and "at least 2 x pp = 8" in few.detail
    zbv = pruner.check(dict(base, schedule="zb-v", virtual_stages=3))
    assert zbv.reason is PruneReason.SCHEDULE and "two chunks" in zbv.detail
    assert pruner.check(dict(base, schedule="zb-h1", virtual_stages=2)).reason is PruneReason.SCHEDULE
    assert canonical(dict(base, schedule="zb-v"))["virtual_stages"] == 2  # ZB-V is two chunks by definition


def test_a_stack_runs_only_its_own_pipeline_schedules():
    """megatron-deepspeed's PipelineEngine runs 1F1B only (stack pipeline_schedules): the search never proposes
    another schedule with a pipeline, simulate refuses one in a line, and a stack that names none keeps them all."""
    import pytest

    from echo_plan.errors import SpecError
    from echo_plan.specs import Schedule
    from echo_plan.specs.software_checks import check_stack_supports

    ds = load_stack("megatron-deepspeed")
    assert ds.pipeline_schedules == (Schedule.ONE_F_ONE_B,) and load_stack("megatron-core").pipeline_schedules == ()
    cluster = load_cluster("h800", gpus=64)
    pruned = prune_space(Pruner(MODEL, cluster, 512, load_space(), stack=ds))
    kept = [v.plan for v in pruned.verdicts if v.reason is None]
    assert kept and all(p.pp == 1 or p.schedule is Schedule.ONE_F_ONE_B for p in kept)
    assert any(v.reason is PruneReason.STACK and "pipeline schedules" in v.detail for v in pruned.verdicts)
    with pytest.raises(SpecError, match="runs the pipeline schedules 1f1b"):
        check_stack_supports(ds, sequence_parallel=False, distributed_optimizer=True, selective_recompute=False,
                             schedule=Schedule.ZB_V, pp=4)
    check_stack_supports(ds, sequence_parallel=False, distributed_optimizer=True, selective_recompute=False,
                         schedule=Schedule.ZB_V, pp=1)  # no pipeline: nothing to run


def test_deepspeed_zero3_has_no_pipeline():
    """DeepSpeed's PipelineEngine takes ZeRO stage 0 or 1 only: the deepspeed-zero3 stack refuses pp > 1 and its search
    keeps single-stage plans."""
    import pytest

    from echo_plan.errors import SpecError
    from echo_plan.specs.software_checks import check_stack_supports

    z3 = load_stack("deepspeed-zero3")
    with pytest.raises(SpecError, match="no pipeline parallelism"):
        check_stack_supports(z3, sequence_parallel=False, distributed_optimizer=True, selective_recompute=False, pp=2)
    pruned = prune_space(Pruner(MODEL, load_cluster("h800", gpus=64), 512, load_space(), stack=z3))
    kept = [v.plan for v in pruned.verdicts if v.reason is None]
    assert kept and all(p.pp == 1 for p in kept)
    assert load_stack("megatron-core").pipeline_parallel and load_stack("torchtitan").pipeline_parallel


def test_llm_foundry_has_no_tensor_or_context_parallelism():
    """llm-foundry 0.3 (Composer FSDP) shards over data parallelism only: the stack refuses tp > 1 and cp > 1 in one
    line each, and its search keeps plans without them."""
    import pytest

    from echo_plan.errors import SpecError
    from echo_plan.specs.software_checks import check_stack_supports

    lf = load_stack("llm-foundry")
    ask = dict(sequence_parallel=False, distributed_optimizer=True, selective_recompute=False)
    with pytest.raises(SpecError, match="tp.*no tensor parallelism: use tp 1"):
        check_stack_supports(lf, **ask, tp=2)
    with pytest.raises(SpecError, match="cp.*no context parallelism: use cp 1"):
        check_stack_supports(lf, **ask, cp=2)
    with pytest.raises(SpecError, match="recompute_layers.*every layer or none"):
        check_stack_supports(lf, **ask, recompute_layers=20)
    check_stack_supports(lf, **ask)
    pruned = prune_space(Pruner(MODEL, load_cluster("dgx-a100", gpus=64), 512, load_space(), stack=lf))
    kept = [v.plan for v in pruned.verdicts if v.reason is None]
    assert kept and all(p.tp == 1 and p.pp == 1 and p.cp == 1 and not p.recompute_layers for p in kept)
    fsdp = prune_space(Pruner(MODEL, load_cluster("dgx-a100", gpus=64), 512, load_space("fsdp"), stack=lf))
    assert not any(v.plan.recompute_layers for v in fsdp.verdicts if v.reason is None)
    assert any(v.combo.get("recompute_layers") for v in fsdp.verdicts)  # the FSDP space asks, the stack refuses
    refused = [v for v in pruned.verdicts if v.combo.get("tp", 1) > 1]
    assert refused and all(v.reason is not None for v in refused)
    for name in ("megatron-core", "torchtitan"):
        assert load_stack(name).tensor_parallel and load_stack(name).context_parallel


def test_offloading_the_optimizer_is_a_knob_that_lets_a_bigger_shard_fit():
    """A space that varies offload_optimizer: without a sharded optimizer it is the same plan (a duplicate); the
    offloaded plans hold no optimizer states on the GPU; a stack that cannot offload prunes them by name."""
    space = space_from_mapping({"knobs": {"tp": [8], "pp": [8], "distributed_optimizer": [True, False],
                                          "offload_optimizer": [False, True]}})
    model, cluster = load_model("gpt3-175b"), load_cluster("h800", gpus=128)
    pruned = prune_space(Pruner(model, cluster, 128, space))
    offloaded = [v for v in pruned.valid if v.plan.offload_optimizer]
    assert offloaded and all(v.plan.distributed_optimizer for v in offloaded)
    assert all(m.optimizer_bytes == 0 < m.host_bytes for v in offloaded for m in v.memory)
    assert sum(v.reason is PruneReason.DUPLICATE for v in pruned.verdicts) == 1  # no dist-opt: nothing offloaded
    refused = prune_space(Pruner(model, cluster, 128, space, stack=load_stack("megatron-lm-2022")))
    assert not [v for v in refused.valid if v.plan.offload_optimizer]
    assert any("optimizer_offload none" in v.detail for v in refused.verdicts)


def test_an_offloaded_share_is_a_knob_and_means_nothing_without_offload():
    space = space_from_mapping({"knobs": {"tp": [8], "pp": [8], "offload_optimizer": [False, True],
                                          "offload_fraction": [0.5, 1.0]}, "fixed": {"distributed_optimizer": True}})
    model, cluster = load_model("gpt3-175b"), load_cluster("h800", gpus=128)
    pruned = prune_space(Pruner(model, cluster, 128, space))
    plans = {(v.plan.offload_optimizer, v.plan.offload_fraction) for v in pruned.valid}
    assert plans == {(False, 1.0), (True, 0.5), (True, 1.0)}  # not offloaded at 0.5 is the plan not offloaded
    half = next(v for v in pruned.valid if v.plan.offload_fraction == 0.5)
    whole = next(v for v in pruned.valid if v.plan.offload_optimizer and v.plan.offload_fraction == 1.0)
    assert all(0 < h.optimizer_bytes and h.host_bytes < w.host_bytes for h, w in zip(half.memory, whole.memory))


def test_a_host_too_small_for_the_offloaded_optimizer_is_pruned_as_out_of_memory_not_for_cp():
    space = space_from_mapping({"knobs": {"tp": [8]}, "fixed": {"distributed_optimizer": True,
                                                                "offload_optimizer": True, "recompute": "full"}})
    cluster = load_cluster("dgx-h100", gpus=8)
    tiny = cluster.replace(host=cluster.host.replace(memory_GiB=4).model_dump())
    model = load_model("llama3-8b").replace(seq_length=32768)  # long: a GPU overflow would point at CP
    pruned = prune_space(Pruner(model, tiny, 8, space))
    assert not pruned.valid
    over = [v for v in pruned.verdicts if v.reason is PruneReason.OOM_ESTIMATE]
    assert over and all("offloaded optimizer needs" in v.detail and "host memory" in v.detail for v in over)


def test_a_share_of_layers_is_that_count_of_every_chunk_or_pruned_with_its_reason():
    """recompute_layers "1/n" (search_spaces/README.md): every n-th layer of each model chunk, whatever the model
    and the pipeline: 32 layers on one stage at 1/4 is 8, on 2 stages 4 each; a share of uneven chunks, or one
    that is no whole count of them, is pruned as invalid with that reason."""
    import pytest

    from echo_plan.errors import SpecError

    space = space_from_mapping({"knobs": {"pp": [1, 2, 4], "recompute_layers": [0, "1/4", "1 / 16"]},
                                "fixed": {"sharding": "parameters"}})
    assert dict((k.value, v) for k, v in space.knobs)["recompute_layers"] == (0, "1/4", "1/16")  # written one way
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=64)
    pruned = prune_space(Pruner(model, cluster, 512, space, stack=load_stack("torchtitan")))
    made = {(v.combo["pp"], v.combo["recompute_layers"]): v for v in pruned.verdicts}
    assert made[(1, "1/4")].plan.recompute_layers == 8 and made[(2, "1/4")].plan.recompute_layers == 4
    assert made[(2, "1/16")].plan.recompute_layers == 1 and made[(4, "1/4")].plan.recompute_layers == 2
    assert made[(4, "1/16")].reason is PruneReason.INVALID and "no whole count" in made[(4, "1/16")].detail
    for bad in ("2/3", "1/0", "a quarter"):
        with pytest.raises(SpecError, match="1/n"):
            space_from_mapping({"knobs": {"recompute_layers": [0, bad]}})
    uneven = prune_space(Pruner(load_model("llama3-405b"), load_cluster("dgx-h100", gpus=512), 512,
                                space_from_mapping({"knobs": {"tp": [8], "pp": [8], "recompute_layers": ["1/2"]},
                                                    "fixed": {"sharding": "parameters", "sequence_parallel": True}}),
                                stack=load_stack("torchtitan")))
    (v,) = uneven.verdicts  # 126 layers over 8 stages: 15 and 16
    assert v.reason is PruneReason.INVALID and "15, 16" in v.detail


def test_a_simulated_plan_counts_under_the_share_its_candidate_asked_for():
    """--explain's per-value counts: a trial of a plan made from "1/4" counts under "1/4", not under the 8 layers it
    made, so every simulated plan is counted once per knob."""
    from echo_plan.search.explain import knob_stats
    from echo_plan.search.results import TrialRecord, TrialState

    space = space_from_mapping({"knobs": {"micro_batch_size": [1, 2], "recompute_layers": [0, "1/4", "1/2"]},
                                "fixed": {"sharding": "parameters"}})
    pruned = prune_space(Pruner(load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8), 64, space,
                                stack=load_stack("torchtitan")))
    plans = [v.plan for v in pruned.verdicts if v.reason is None]
    trials = [TrialRecord(i, p.model_dump(mode="json"), TrialState.COMPLETE) for i, p in enumerate(plans)]
    stats = knob_stats(pruned, trials)
    assert sum(row["evaluated"] for row in stats["recompute_layers"].values()) == len(plans) >= 4
    assert stats["recompute_layers"]["1/4"]["evaluated"] == stats["recompute_layers"]["1/4"]["valid"] >= 1


def test_a_megatron_space_on_an_fsdp_stack_names_the_stacks_level():
    """A space written with distributed_optimizer (long-context) on a stack that shards parameters makes plans that
    say so (sharding parameters: 'fsdp' in every label), the same plans as before; on Megatron-Core the optimizer's
    level stays the distributed optimizer's name."""
    space = space_from_mapping({"knobs": {"tp": [1, 2]}, "fixed": {"distributed_optimizer": True}})
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=16)
    fsdp = [v.plan for v in prune_space(Pruner(model, cluster, 32, space, stack=load_stack("torchtitan"))).valid]
    assert fsdp and all(p.sharding.value == "parameters" and "fsdp" in p.short() for p in fsdp)
    mcore = [v.plan for v in prune_space(Pruner(model, cluster, 32, space, stack=load_stack("megatron-core"))).valid]
    assert mcore and all(p.sharding is None and "dist-opt" in p.short() for p in mcore)
