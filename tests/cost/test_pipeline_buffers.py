"""torch.distributed.pipelining's own memory (stack pipeline_runtime torch): receive buffers for every micro-batch
and the last stage's kept outputs, counted where the stack runs that runtime and never where it does not."""

from __future__ import annotations

import pytest

from echo_plan.cost.memory import inflight_on_chunk
from echo_plan.cost.pipeline_buffers import pipeline_runtime_bytes
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.software import PipelineRuntime

MODEL = load_model("llama3-8b")
TORCH = load_stack("torchtitan")
MEGATRON = TORCH.model_copy(update={"pipeline_runtime": PipelineRuntime.MEGATRON})


def plan(pp=4, m=8, v=1, tp=1, mbs=1):
    return PlanSpec(tp=tp, pp=pp, dp=1, micro_batch_size=mbs, global_batch_size=m * mbs, virtual_stages=v,
                    sequence_parallel=tp > 1, schedule="interleaved" if v > 1 else "1f1b")


def held(p, stack=TORCH):
    return [pipeline_runtime_bytes(MODEL, p, stack, i) for i in range(p.pp)]


def test_only_the_torch_runtime_with_a_pipeline_holds_anything():
    assert held(plan(), MEGATRON) == [0, 0, 0, 0]
    assert held(plan(pp=1, m=4)) == [0]
    assert all(b > 0 for b in held(plan()))


def test_what_each_stage_holds_follows_from_its_buffers():
    p = plan(pp=4, m=8)
    boundary = p.micro_batch_size * MODEL.seq_length * MODEL.hidden_size * 2
    logits = p.micro_batch_size * MODEL.seq_length * MODEL.vocab_size * 2
    first, middle, _, last = held(p)
    assert first == 8 * boundary  # gradients received for every micro-batch; its input is the data, not received
    inflight = [inflight_on_chunk(p, i, 0) for i in range(4)]
    assert middle == (8 - inflight[1]) * boundary + 8 * boundary
    assert last == (8 - inflight[3]) * (boundary + logits)  # no gradient received; outputs kept after their backward


def test_tensor_parallelism_splits_what_is_held():
    one, eight = held(plan(tp=1)), held(plan(tp=8))
    assert all(b8 * 8 == pytest.approx(b1, rel=1e-6) for b1, b8 in zip(one, eight))


@pytest.mark.parametrize("v", [1, 2])
def test_more_micro_batches_never_hold_less(v):
    rows = [held(plan(pp=4, m=m, v=v)) for m in (4, 8, 16, 32)]
    for lo, hi in zip(rows, rows[1:]):
        assert all(a <= b for a, b in zip(lo, hi)), (lo, hi)


def test_the_stage_memory_counts_it_for_the_torch_runtime_only():
    from echo_plan.simulate import simulate

    p = PlanSpec(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=16, sharding="parameters")
    model = MODEL.replace(seq_length=2048)
    cluster = load_cluster("h100-gt", gpus=8)
    torch_run = simulate(model, cluster, p, stack=TORCH).memory
    megatron_run = simulate(model, cluster, p, stack=MEGATRON).memory
    for a, b in zip(torch_run, megatron_run):
        extra = pipeline_runtime_bytes(model, p, TORCH, a.stage)
        assert extra > 0
        assert a.buffers_bytes - b.buffers_bytes == pytest.approx(extra, abs=2)
        assert (a.weights_bytes, a.gradients_bytes, a.activations_bytes) == \
            (b.weights_bytes, b.gradients_bytes, b.activations_bytes)


def test_simulates_note_names_it_where_it_is_held():
    from echo_plan.cost.memory_notes import pipeline_note

    note = pipeline_note(MODEL, plan(pp=4, m=8), TORCH)
    most = max(held(plan(pp=4, m=8)))
    assert "8 micro-batches" in note and f"{most / 2**30:.1f} GiB" in note
    assert pipeline_note(MODEL, plan(pp=4, m=8), MEGATRON) == "" and pipeline_note(MODEL, plan(pp=1), TORCH) == ""
