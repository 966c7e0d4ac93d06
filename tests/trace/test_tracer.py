"""Properties of traced stages: sharding, collectives, FLOPs, recompute and saved bytes."""

import pytest

from echo_plan.errors import SpecError
from echo_plan.specs import DType, PlanSpec, Recompute, load_stack
from echo_plan.trace.tracer import trace_model, trace_stage
from echo_plan.trace.records import CollectiveKind, GroupKind, OpKind, Phase, StageKind, Stream


NO_TP_OVERLAP = load_stack("megatron-core", {"tp_comm_overlap": False})


def block(model, tp=1, sp=False, mbs=1, recompute=Recompute.NONE, dtype=DType.BF16, stack=NO_TP_OVERLAP):
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=sp, micro_batch_size=mbs,
                       dtype=dtype, recompute=recompute, stack=stack)


def gemm_flops(trace, phase):
    return sum(op.flops for op in trace.by_phase(phase) if op.kind is OpKind.GEMM)


def test_tp_changes_shapes_and_collectives(gpt_small):
    one, two, four = block(gpt_small, tp=1), block(gpt_small, tp=2), block(gpt_small, tp=4)
    assert not one.collectives
    for trace, tp in ((two, 2), (four, 4)):
        kinds = [(op.phase, op.collective.kind) for op in trace.collectives]
        # Megatron's g in forward (after attention-out and FC2) and f in backward (before QKV and FC1)
        assert kinds == [(Phase.FORWARD, CollectiveKind.ALL_REDUCE)] * 2 + [(Phase.BACKWARD, CollectiveKind.ALL_REDUCE)] * 2
        s, h = gpt_small.seq_length, gpt_small.hidden_size
        for op in trace.collectives:
            assert op.stream is Stream.TP_COMM
            assert op.collective.group.kind is GroupKind.TP and op.collective.group.size == tp
            assert op.collective.nbytes == s * h * 2  # the full [s, b, h] bf16 activation
    fwd_gemm_shapes = lambda t: [op.outputs[0].shape for op in t.by_phase(Phase.FORWARD) if op.kind is OpKind.GEMM]
    qkv1, qkv2 = fwd_gemm_shapes(one)[0], fwd_gemm_shapes(two)[0]
    assert qkv1[-1] == 3 * gpt_small.hidden_size and qkv2[-1] == qkv1[-1] // 2
    assert gemm_flops(two, Phase.FORWARD) == pytest.approx(gemm_flops(one, Phase.FORWARD) / 2)
    assert two.param_count < one.param_count


def test_sequence_parallel_uses_gather_and_reduce_scatter(gpt_small):
    trace = block(gpt_small, tp=4, sp=True)
    fwd = [op.collective.kind for op in trace.collectives if op.phase is Phase.FORWARD]
    assert fwd == [CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER] * 2
    bwd = [op.collective.kind for op in trace.collectives if op.phase is Phase.BACKWARD]
    # backward: the conjugates plus Megatron's re-gather of the input shard for the weight gradient
    assert bwd.count(CollectiveKind.REDUCE_SCATTER) == 2 and bwd.count(CollectiveKind.ALL_GATHER) == 4
    full = gpt_small.seq_length * gpt_small.hidden_size * 2
    assert {op.collective.nbytes for op in trace.collectives} == {full}  # nccl-tests size convention
    norm_inputs = [op.inputs[0].shape for op in trace.ops if op.kind is OpKind.NORM and op.phase is Phase.FORWARD]
    assert norm_inputs and all(shape[0] == gpt_small.seq_length // 4 for shape in norm_inputs)
    plain = block(gpt_small, tp=4)
    assert trace.saved_bytes < plain.saved_bytes


def test_forward_flops_match_the_analytical_count(gpt_small, llama_small):
    for model in (gpt_small, llama_small):
        s, h, f = model.seq_length, model.hidden_size, model.ffn_size
        kv = model.kv_heads * model.head_dim
        fc1 = 2 * f if model.activation.value == "swiglu" else f
        gemm = 2 * s * (h * (h + 2 * kv) + h * h + h * fc1 + f * h)
        attention = 4 * s * s * h  # torch's flop counter ignores causality
        trace = block(model, tp=2)
        fwd = sum(op.flops for op in trace.by_phase(Phase.FORWARD))
        assert fwd == pytest.approx((gemm + attention) / 2)
        assert gemm_flops(trace, Phase.BACKWARD) == pytest.approx(2 * gemm_flops(trace, Phase.FORWARD))
        bwd_attention = sum(op.flops for op in trace.by_phase(Phase.BACKWARD) if op.kind is OpKind.ATTENTION)
        assert bwd_attention == pytest.approx(2.5 * attention / 2)  # torch counts 5 matmuls (scores recomputed)


def test_attention_is_one_fused_op_each_way(llama_small):
    trace = block(llama_small, tp=2)
    att = [op for op in trace.ops if op.kind is OpKind.ATTENTION]
    assert [op.phase for op in att] == [Phase.FORWARD, Phase.BACKWARD]
    q, k = att[0].inputs[0].shape, att[0].inputs[1].shape
    assert q[1] == llama_small.num_attention_heads // 2 and k[1] == llama_small.kv_heads // 2


def test_recompute_modes(gpt_small):
    none, sel, full = (block(gpt_small, tp=2, recompute=r) for r in Recompute)
    assert not none.by_phase(Phase.RECOMPUTE)
    # the core again, with Transformer Engine's copies of views of the QKV output (attention.py)
    assert {op.kind for op in sel.by_phase(Phase.RECOMPUTE)} - {OpKind.VIEW, OpKind.COPY} == {OpKind.ATTENTION}
    fwd_kernels = [op.name for op in full.by_phase(Phase.FORWARD) if op.kind is not OpKind.VIEW]
    re_kernels = [op.name for op in full.by_phase(Phase.RECOMPUTE) if op.kind is not OpKind.VIEW]
    assert re_kernels == fwd_kernels  # the full layer's forward runs again in backward
    assert [op.collective.kind for op in full.collectives if op.phase is Phase.RECOMPUTE] == [CollectiveKind.ALL_REDUCE] * 2
    for t in (none, sel, full):
        assert t.saved_bytes == t.saved_bytes_by_mode[t.key.recompute]
        assert t.saved_bytes_by_mode == none.saved_bytes_by_mode  # measured the same way in every trace
    by_mode = none.saved_bytes_by_mode
    assert by_mode["full"] < min(by_mode["selective"], by_mode["none"])
    assert by_mode["full"] == gpt_small.seq_length * gpt_small.hidden_size * 2  # only the layer input


def test_saved_bytes_scale_with_micro_batch(gpt_small):
    one, two = block(gpt_small, tp=2, mbs=1), block(gpt_small, tp=2, mbs=2)
    assert two.saved_bytes == 2 * one.saved_bytes
    assert two.total_flops > one.total_flops


@pytest.mark.parametrize("overlap", [False, True])
def test_dependencies_point_backwards_and_views_are_free(llama_small, overlap):
    trace = block(llama_small, tp=2, sp=True, recompute=Recompute.FULL,
                  stack=load_stack("megatron-core", {"tp_comm_overlap": overlap}))
    for i, op in enumerate(trace.ops):
        assert op.index == i and all(0 <= d < i for d in op.deps)
        if op.kind is OpKind.VIEW:
            assert op.flops == 0 and op.bytes_read == 0 and op.bytes_written == 0
        if op.kind is OpKind.GEMM:
            assert op.flops > 0 and op.bytes_read > 0
        if op.collective is None:
            assert op.stream is Stream.COMPUTE
    gemms = [op for op in trace.ops if op.kind is OpKind.GEMM and op.phase is not Phase.FORWARD]
    # every recompute/backward GEMM waits on something, but with the TP ring exchange the first
    # input-gradient chunk starts on the gradient that arrives with the phase
    assert sum(1 for op in gemms if not op.deps) <= (1 if overlap else 0)
    assert {op.outputs[0].dtype for op in gemms} == {"bfloat16"}


def test_llama_has_no_biases_and_gpt_has(gpt_small, llama_small):
    for model in (gpt_small, llama_small):
        trace = block(model, tp=1)
        assert trace.param_count == model.params_per_layer


def test_dtype_is_used(gpt_small):
    trace = block(gpt_small, tp=2, dtype=DType.FP16)
    assert {op.outputs[0].dtype for op in trace.ops if op.kind is OpKind.GEMM} == {"float16"}
    with pytest.raises(SpecError):
        block(gpt_small, tp=2, dtype=DType.FP32)


def test_model_change_changes_trace(llama_small):
    mha = llama_small.model_copy(update={"num_kv_heads": 8})
    a, b = block(llama_small, tp=2), block(mha, tp=2)
    assert a.key.structure != b.key.structure
    assert a.ops[0] != b.ops[0] or len(a.ops) != len(b.ops) or a.total_flops != b.total_flops


def test_output_and_embedding_stages(gpt_small, llama_small):
    plan = PlanSpec(tp=2, micro_batch_size=1, global_batch_size=1)
    traces = trace_model(gpt_small, plan)
    out = traces.output
    fwd = [(op.collective.kind, op.collective.nbytes) for op in out.collectives if op.phase is Phase.FORWARD]
    s = gpt_small.seq_length
    assert fwd == [(CollectiveKind.ALL_REDUCE, s * 4)] * 3  # max, target logit, sum of exp (fp32 per token)
    assert any(op.outputs and op.outputs[0].dtype == "float32" and op.outputs[0].shape[-1] == 512
               for op in out.ops)  # fp32 logits over the padded vocab shard (1000 -> 1024 / 2)
    emb = traces.embedding
    assert [op.collective.kind for op in emb.collectives] == [CollectiveKind.ALL_REDUCE]
    assert any(op.kind is OpKind.EMBEDDING for op in emb.ops)
    assert emb.param_count == 512 * gpt_small.hidden_size + gpt_small.seq_length * gpt_small.hidden_size
    assert out.param_count == 2 * gpt_small.hidden_size  # tied: the projection belongs to the embedding
    llama = trace_model(llama_small, plan.model_copy(update={"sequence_parallel": True}))
    assert [(op.phase, op.collective.kind) for op in llama.embedding.collectives] == [
        (Phase.FORWARD, CollectiveKind.REDUCE_SCATTER), (Phase.BACKWARD, CollectiveKind.ALL_GATHER)]
    assert llama.output.param_count == llama_small.hidden_size + 512 * llama_small.hidden_size
    assert llama.output.key.recompute == "none" and llama.block.key.tp == 2


def test_invalid_tp_names_valid_values(llama_small):
    with pytest.raises(SpecError, match="num_kv_heads") as err:
        block(llama_small, tp=8)
    assert "valid: 1, 2, 4" in str(err.value)
    with pytest.raises(SpecError):
        block(llama_small, tp=3)


def test_no_process_group_left_behind(gpt_small):
    """Nothing of the fake group outlives a trace: not the group, not the "[rank0]: " excepthook that
    init_process_group installs (each trace used to wrap it once more)."""
    import sys

    import torch.distributed as dist

    hook = sys.excepthook
    block(gpt_small, tp=2)
    block(gpt_small, tp=4)
    assert not dist.is_initialized()
    assert sys.excepthook is hook


def test_tp_overlap_pipelines_the_collectives_with_gemm_chunks(gpt_small):
    tp = 4
    plain = block(gpt_small, tp=tp, sp=True)
    over = block(gpt_small, tp=tp, sp=True, stack=load_stack("megatron-core", {"tp_comm_overlap": True}))
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert gemm_flops(over, phase) == pytest.approx(gemm_flops(plain, phase))  # same work, in chunks
    fwd_gemms = lambda t: [op for op in t.by_phase(Phase.FORWARD) if op.kind is OpKind.GEMM]
    assert len(fwd_gemms(over)) > len(fwd_gemms(plain))
    rings = [op for op in over.collectives if op.collective.kind is CollectiveKind.SEND_RECV]
    # each column-parallel all-gather (2 in forward, 2 of the row-parallel gradient in backward): tp - 1 steps
    assert len(rings) == 4 * (tp - 1)
    # a chunk GEMM waits for the ring step that brought its input, not for the whole gather
    ring_ids = {op.index for op in rings}
    waits = [op for op in over.ops if op.kind is OpKind.GEMM and set(op.deps) & ring_ids]
    assert len(waits) == len(rings)
    # TE keeps only the local shard of a column-parallel input: saved activations do not grow
    assert over.saved_bytes <= plain.saved_bytes
