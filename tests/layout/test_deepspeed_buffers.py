"""DeepSpeed's BF16_Optimizer (stack gradient_buffers: deepspeed-bf16): what it holds and moves beyond Megatron's
gradient buffer, read from its code (runtime/bf16_optimizer.py, runtime/engine.py, pipe/engine.py)."""

from __future__ import annotations

import pytest

from echo_plan.cost.memory import estimate_memory
from echo_plan.errors import EchoPlanError
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.replay.dp import chunk_buckets
from echo_plan.specs import DType, PlanSpec, Recompute, load_cluster, load_model, load_stack
from echo_plan.specs.software import GradientBuffers, SoftwareSpec
from echo_plan.trace.records import Phase, StageKind
from echo_plan.trace.tracer import trace_stage

DS = load_stack("megatron-deepspeed")
MEGATRON_BUFFERS = DS.replace(gradient_buffers=GradientBuffers.MEGATRON)
MODEL = load_model("gpt3-175b")
CLUSTER = load_cluster("dgx-a100", gpus=256)


def _plan(**kw) -> PlanSpec:
    base = dict(tp=4, pp=16, dp=4, micro_batch_size=1, global_batch_size=64, recompute="full",
                distributed_optimizer=True)
    base.update(kw)
    return PlanSpec.build(base, "plan")


def test_the_preset_runs_the_bf16_optimizer_and_it_needs_unfused_accumulation():
    assert DS.gradient_buffers is GradientBuffers.DEEPSPEED_BF16
    with pytest.raises((EchoPlanError, ValueError), match="gradient_accumulation_fusion"):
        SoftwareSpec(name="x", gradient_buffers="deepspeed-bf16")


def test_bf16_gradients_are_held_beside_the_fp32_buffer():
    p = _plan()
    ds, mg = estimate_memory(MODEL, p, CLUSTER, DS), estimate_memory(MODEL, p, CLUSTER, MEGATRON_BUFFERS)
    for a, b in zip(ds, mg):
        assert a.gradients_bytes - b.gradients_bytes == a.weights_bytes  # one bf16 gradient per bf16 weight
        assert a.total_bytes >= b.total_bytes + a.weights_bytes
        # the step-end copy of the fp32 buffer: the device holds it beside the cached blocks, never less than the peak
        assert a.device_bytes >= a.total_bytes and b.device_bytes == b.total_bytes
        held = a.total_bytes - a.outside_allocator_bytes  # the copy is cached beside the blocks only where it fits
        assert a.reserved_bytes <= max(held, a.capacity_bytes - a.outside_allocator_bytes)
    assert all(m.fits for m in ds)


def test_the_whole_fp32_buffer_is_all_reduced_before_the_sharded_step():
    p = _plan()
    ds, mg = DataParallelSharding.of(p, DS), DataParallelSharding.of(p, MEGATRON_BUFFERS)
    assert ds.reduce_all and not mg.reduce_all and ds.optimizer_shards() == mg.optimizer_shards() == 4

    def comm(kind, nbytes, group):  # an all-reduce moves twice a reduce-scatter's bytes
        return nbytes * (2.0 if kind.value == "all_reduce" else 1.0) * 1e-9

    a, b = (chunk_buckets(10**8, p, comm, 4, False, s) for s in (ds, mg))
    assert sum(x.reduce_s for x in a) == pytest.approx(2 * sum(x.reduce_s for x in b))
    assert [x.gather_s for x in a] == [x.gather_s for x in b]  # the bf16 weights gathered alike after the step


def test_each_weight_gradient_is_added_through_an_fp32_copy():
    def casts(stack):
        t = trace_stage(MODEL, StageKind.BLOCK, tp=4, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16,
                        recompute=Recompute.NONE, stack=stack)
        return [op for op in t.ops if op.phase is Phase.BACKWARD and op.name == "aten._to_copy.default"]

    assert len(casts(DS)) - len(casts(MEGATRON_BUFFERS)) == 4  # QKV, proj, FC1, FC2


def test_simulate_says_the_optimizer_and_that_fp16_runs_are_costed_as_bf16():
    from echo_plan.replay.step_costs import stack_notes

    (bf16,) = [n for n in stack_notes(_plan(), DS) if "BF16_Optimizer" in n]
    assert "all-reduced whole before each rank steps its shard" in bf16 and "fp16" not in bf16
    (fp16,) = [n for n in stack_notes(_plan(dtype="fp16"), DS) if "BF16_Optimizer" in n]
    assert "costed as bf16's" in fp16
    assert not [n for n in stack_notes(_plan(), MEGATRON_BUFFERS) if "BF16_Optimizer" in n]


def test_zero_2_and_3_run_deepspeeds_stage_optimizers_not_the_bf16_one():
    from echo_plan.replay.step_costs import stack_notes

    for level in ("gradients", "parameters"):
        p = _plan(sharding=level)
        sharding = DataParallelSharding.of(p, DS)
        assert not sharding.bf16_buffers and not sharding.reduce_all
        ds, mg = estimate_memory(MODEL, p, CLUSTER, DS), estimate_memory(MODEL, p, CLUSTER, MEGATRON_BUFFERS)
        assert [m.gradients_bytes for m in ds] == [m.gradients_bytes for m in mg]
        assert [m.device_bytes for m in ds] == [m.total_bytes for m in ds]
        assert [n for n in stack_notes(p, DS) if "not the BF16_Optimizer" in n]
    assert DataParallelSharding.of(_plan(distributed_optimizer=False), DS).bf16_buffers  # ZeRO 0: held, all-reduced
