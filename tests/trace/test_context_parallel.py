"""Context parallelism as traced: properties that must hold whatever the sizes."""

from __future__ import annotations

import pytest

from echo_plan.cost.attention_cost import attention_work_flops
from echo_plan.errors import SpecError
from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.trace.records import CollectiveKind, GroupKind, OpKind, Phase, StageKind, Stream
from echo_plan.trace.tracer import trace_stage


def _block(model, tp=1, cp=1, sp=False, stack=None, mbs=1):
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=sp, micro_batch_size=mbs,
                       dtype=DType.BF16, recompute=Recompute.NONE, cp=cp, stack=stack)


def _attention_work(trace, phase_forward: bool) -> float:
    return sum(attention_work_flops(op) for op in trace.ops
               if op.kind is OpKind.ATTENTION and (op.phase is Phase.FORWARD) == phase_forward)


def _kv_bytes(model, tp, cp, mbs=1) -> int:
    """K and V of one CP rank's s / cp tokens on one TP rank, bf16."""
    return 2 * (model.seq_length // cp) * mbs * (model.kv_heads // tp) * model.head_dim * 2


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 2), (8, 1)])
def test_cp_never_changes_total_attention_flops(llama_small, cp, tp):
    base = _block(llama_small, tp=tp)
    split = _block(llama_small, tp=tp, cp=cp, sp=tp > 1)
    for fwd in (True, False):  # summed over the cp ranks (load balancing gives each the same work)
        assert cp * _attention_work(split, fwd) == pytest.approx(_attention_work(base, fwd), rel=1e-9)


@pytest.mark.parametrize("cp, tp", [(2, 1), (4, 1), (4, 2)])
def test_ring_p2p_bytes_are_kv_bytes_times_cp_minus_one(llama_small, cp, tp):
    trace = _block(llama_small, tp=tp, cp=cp, sp=tp > 1)
    ring = [op for op in trace.ops if op.collective is not None and op.collective.group.kind is GroupKind.CP]
    assert all(op.collective.kind is CollectiveKind.SEND_RECV and op.stream is Stream.CP_COMM for op in ring)
    assert all(op.collective.group.size == cp and op.collective.group.stride == tp for op in ring)
    fwd = sum(op.collective.nbytes for op in ring if op.phase is Phase.FORWARD)
    bwd = sum(op.collective.nbytes for op in ring if op.phase is not Phase.FORWARD)
    kv = _kv_bytes(llama_small, tp, cp)
    assert fwd == kv * (cp - 1)  # K/V round the ring in forward
    assert bwd == 2 * kv * (cp - 1)  # K/V again and dK/dV back to their owners in backward


def test_ring_exchange_overlaps_the_attention_of_the_chunk_in_hand(llama_small):
    trace = _block(llama_small, cp=4)
    fwd = [op for op in trace.ops if op.phase is Phase.FORWARD]
    attn = [op for op in fwd if op.kind is OpKind.ATTENTION]
    sends = [op for op in fwd if op.stream is Stream.CP_COMM]
    for send, att in zip(sends, attn):  # step i's exchange: issued before step i's attention, not read by it
        assert send.index < att.index and send.index not in att.deps
    reads = {d for op in attn for d in op.deps}
    assert all(send.index in reads or any(send.index in o.deps for o in fwd) for send in sends)


def test_activations_split_by_cp(llama_small):
    base, split = _block(llama_small), _block(llama_small, cp=4)
    assert split.saved_bytes < base.saved_bytes / 2


def test_cp1_trace_is_todays(llama_small):
    from echo_plan.trace.keys import make_key

    a = _block(llama_small, cp=1)
    common = dict(tp=1, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16, recompute=Recompute.NONE,
                  version="v", software="s")
    assert make_key(llama_small, StageKind.BLOCK, cp=1, **common) == make_key(llama_small, StageKind.BLOCK, **common)
    assert make_key(llama_small, StageKind.BLOCK, cp=2, **common) != make_key(llama_small, StageKind.BLOCK, **common)
    assert a.key.variant == ""
    assert not any(op.stream is Stream.CP_COMM for op in a.ops)
    assert [op.name for op in a.ops if op.kind is OpKind.ATTENTION] == [
        "echo_plan.flash_attention.default", "echo_plan.flash_attention_backward.default"]


def test_all_gather_variant_gathers_kv_and_reduce_scatters_grads(llama_small):
    stack = load_stack(None, {"cp_comm": "all_gather"})
    trace = _block(llama_small, cp=4, stack=stack)
    cp_ops = [op for op in trace.ops if op.collective is not None and op.collective.group.kind is GroupKind.CP]
    kinds = [(op.phase, op.collective.kind) for op in cp_ops]
    kv = _kv_bytes(llama_small, 1, 4)
    assert (Phase.FORWARD, CollectiveKind.ALL_GATHER) in kinds
    assert (Phase.BACKWARD, CollectiveKind.REDUCE_SCATTER) in kinds
    assert all(op.collective.nbytes == 4 * kv for op in cp_ops)  # gathered size: every rank's K/V
    base = _block(llama_small)
    assert 4 * _attention_work(trace, True) == pytest.approx(_attention_work(base, True), rel=1e-9)


def test_cp_that_does_not_split_the_sequence_is_refused(llama_small):
    with pytest.raises(SpecError, match="2 x cp"):
        _block(llama_small, cp=3)  # 128 tokens do not divide into 6 chunks


def _torch_ring(model, cp, comm="all_gather"):
    return _block(model, cp=cp, stack=load_stack(None, {"cp_runtime": "torch", "cp_comm": comm}))


@pytest.mark.parametrize("comm", ["all_gather", "p2p"])
@pytest.mark.parametrize("cp", [2, 4])
def test_torch_ring_attention_keeps_the_attention_flops(llama_small, cp, comm):
    base = _block(llama_small)
    ring = _torch_ring(llama_small, cp, comm)
    for fwd in (True, False):
        assert cp * _attention_work(ring, fwd) == pytest.approx(_attention_work(base, fwd), rel=1e-9)


@pytest.mark.parametrize("cp", [2, 4])
def test_torch_ring_moves_the_repeated_heads_and_fp32_gradients_after_every_step(llama_small, cp):
    """torchtitan repeats the K/V heads before SDPA, so the ring carries the query heads; the allgather rotate
    method gathers K/V once each way, and dK/dV travel in fp32 after each of the cp steps."""
    rep = llama_small.num_attention_heads // llama_small.kv_heads
    kv = _kv_bytes(llama_small, 1, cp) * rep
    trace = _torch_ring(llama_small, cp)
    ring = [op for op in trace.ops if op.collective is not None and op.collective.group.kind is GroupKind.CP]
    gathers = [op for op in ring if op.collective.kind is CollectiveKind.ALL_GATHER]
    sends = [op for op in ring if op.collective.kind is CollectiveKind.SEND_RECV]
    assert sorted(op.phase is Phase.FORWARD for op in gathers) == [False, True]  # once in forward, once in backward
    assert all(op.collective.nbytes == cp * kv for op in gathers)
    assert len(sends) == cp and all(op.phase is not Phase.FORWARD and op.collective.nbytes == 2 * kv for op in sends)
    p2p = _torch_ring(llama_small, cp, "p2p")  # the alltoall rotate method: K/V sent on at each step instead
    kv_sends = [op for op in p2p.ops if op.collective is not None and op.collective.kind is CollectiveKind.SEND_RECV
                and op.collective.nbytes == kv]
    assert len([op for op in kv_sends if op.phase is Phase.FORWARD]) == cp - 1


def test_torch_ring_merges_in_fp32_with_eager_ops(llama_small):
    """Each ring step after the first is merged into the running output by eager fp32 ops (no fused correction
    kernel); the TE runtime's merge is one fused kernel per step."""
    cp = 4
    ring = _torch_ring(llama_small, cp)
    fwd = [op for op in ring.ops if op.phase is Phase.FORWARD]
    assert sum(op.name == "aten.sigmoid.default" and op.outputs[0].dtype == "float32" for op in fwd) == cp - 1
    assert not any("attn_out_correction" in op.name for op in ring.ops)
    te = _block(llama_small, cp=cp)
    assert sum("attn_out_correction" in op.name for op in te.ops if op.phase is Phase.FORWARD) == cp - 1
    assert ring.key != te.key  # the runtime is part of the trace's key
