"""DTensor's batch-first sequence parallelism (stack ``tp_runtime`` torch, torchtitan): with more than one sequence a
micro-batch, a copy after each sequence-parallel all-gather and before each reduce-scatter (PyTorch's functional
collectives rearranging dim 1 to NCCL's dim 0); none with one sequence, none in Megatron's sequence-first layout, and
under async TP only the fused matmul-reduce-scatter's."""

from __future__ import annotations

import pytest

from echo_plan.specs import DType, ModelSpec, Recompute, load_cluster, load_stack
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import CollectiveKind, OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

S, H = 128, 256


def model() -> ModelSpec:
    return ModelSpec(name="dt", num_layers=2, hidden_size=H, num_attention_heads=8, num_kv_heads=2,
                     ffn_hidden_size=512, vocab_size=1000, seq_length=S, activation="swiglu", norm="rmsnorm",
                     position_embedding="rotary", tied_embeddings=False)


def trace(stack: str = "torchtitan", mbs: int = 2, overlap: bool = False, dtype: DType = DType.BF16, **fields):
    spec = load_stack(stack, {"tp_comm_overlap": overlap, **fields})
    return trace_stage(model(), StageKind.BLOCK, tp=2, sequence_parallel=True, micro_batch_size=mbs, dtype=dtype,
                       recompute=Recompute.NONE, stack=spec)


def forward(t) -> list:
    return [op for op in t.by_phase(Phase.FORWARD) if op.kind is not OpKind.VIEW]


def layout_copies(t, phase: Phase = Phase.FORWARD) -> list:
    """The full-activation copies: clones of a [s, b, h]-sized tensor."""
    return [op for op in t.by_phase(phase) if op.name == "aten.clone.default"
            and op.inputs[0].shape[-1] == H and len(op.inputs[0].shape) == 3]


def test_each_forward_sequence_parallel_collective_has_its_copy_where_it_runs():
    ops = forward(trace())
    for i, op in enumerate(ops):
        if op.collective is None:
            continue
        if op.collective.kind is CollectiveKind.ALL_GATHER:  # the gathered shards rearranged into sequence order
            after = next(o for o in ops[i + 1:] if o.name != "_c10d_functional.wait_tensor.default")
            assert after.name == "aten.clone.default" and after.inputs[0].shape == op.outputs[0].shape
        if op.collective.kind is CollectiveKind.REDUCE_SCATTER:  # the partial sums rearranged into rank order
            assert ops[i - 1].name == "aten.clone.default" and ops[i - 1].outputs[0].shape == op.inputs[0].shape
    sp = [op for op in ops if op.collective is not None]
    assert len(layout_copies(trace())) == len(sp) == 4  # attention and MLP: a gather and a scatter each


def test_one_sequence_a_micro_batch_and_megatrons_layout_copy_nothing():
    assert layout_copies(trace(mbs=1)) == []
    assert layout_copies(trace("megatron-core")) == []
    assert layout_copies(trace(tp_runtime="megatron")) == []
    # the copies are all the difference
    plain, dtensor = trace(tp_runtime="megatron"), trace()
    assert len(forward(dtensor)) - len(forward(plain)) == len(layout_copies(dtensor))


def test_async_tp_keeps_the_reduce_scatters_copies_only():
    """The fused all-gather-matmul takes the shards as they are (ring exchanges); the fused matmul-reduce-scatter
    copies its input once (torch's _symmetric_memory)."""
    t = trace(overlap=True)
    copies = layout_copies(t)
    scatters = [op for op in forward(t) if op.collective is not None and op.collective.kind is CollectiveKind.REDUCE_SCATTER]
    assert copies and sum(op.inputs[0].numel for op in copies) == sum(op.inputs[0].numel for op in scatters)
    assert not any(op.collective is not None and op.collective.kind is CollectiveKind.ALL_GATHER for op in forward(t))


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8])
def test_backward_rearranges_its_gradient_collectives(dtype):
    t = trace(dtype=dtype)
    grads = [op for op in t.by_phase(Phase.BACKWARD) if op.collective is not None
             and op.collective.kind is CollectiveKind.REDUCE_SCATTER]
    assert grads and len([op for op in t.by_phase(Phase.BACKWARD) if op.name == "aten.clone.default"]) >= len(grads)


def test_the_copies_never_speed_a_step():
    from echo_plan.simulate import simulate

    m, cluster = model(), load_cluster("dgx-h100", gpus=8)
    plan = PlanSpec(tp=2, pp=1, dp=4, micro_batch_size=2, global_batch_size=16, sequence_parallel=True)
    with_copies = simulate(m, cluster, plan, stack=load_stack("torchtitan")).step_time_s
    without = simulate(m, cluster, plan, stack=load_stack("torchtitan", {"tp_runtime": "megatron"})).step_time_s
    assert with_copies > without


def test_simulate_says_where_the_layout_copies_run():
    from echo_plan.simulate import simulate

    cluster = load_cluster("dgx-h100", gpus=8)
    plan = PlanSpec(tp=2, pp=1, dp=4, micro_batch_size=2, global_batch_size=16, sequence_parallel=True)
    said = [n for n in simulate(model(), cluster, plan, stack=load_stack("torchtitan")).notes if "batch-first" in n]
    assert len(said) == 1 and "all-gather's output" in said[0]
    async_tp = simulate(model(), cluster, plan, stack=load_stack("torchtitan", {"tp_comm_overlap": True})).notes
    assert any("reduce-scatter's input is copied" in n and "fused all-gathers" in n for n in async_tp)
    one = plan.model_copy(update={"micro_batch_size": 1})
    assert not any("batch-first" in n for n in simulate(model(), cluster, one, stack=load_stack("torchtitan")).notes)
    assert not any("batch-first" in n for n in simulate(model(), cluster, plan, stack=load_stack("megatron-core")).notes)
