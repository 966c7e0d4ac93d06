"""Properties every traced layer must have, over randomly drawn small architectures."""

from hypothesis import given, settings, strategies as st

from echo_plan.specs import DType, ModelSpec, Recompute, load_stack
from echo_plan.trace.tracer import trace_stage
from echo_plan.trace.records import CollectiveKind, OpKind, Phase, StageKind


@st.composite
def model_and_tp(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    kv = tp * draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([16, 32]))
    llama = draw(st.booleans())
    model = ModelSpec(
        name="drawn", num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_kv_heads=kv,
        ffn_hidden_size=tp * draw(st.sampled_from([32, 48])), vocab_size=draw(st.integers(100, 600)),
        seq_length=tp * draw(st.sampled_from([16, 32])),
        activation="swiglu" if llama else "gelu", norm="rmsnorm" if llama else "layernorm",
        position_embedding="rotary" if llama else "learned",
    )
    return (model, tp, draw(st.booleans()), draw(st.sampled_from(list(Recompute))), draw(st.sampled_from([1, 2])),
            draw(st.booleans()))


@settings(max_examples=10, deadline=None)
@given(model_and_tp())
def test_layer_invariants(case):
    model, tp, sp, recompute, mbs, overlap = case
    stack = load_stack("megatron-core", {"tp_comm_overlap": overlap})
    trace = trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=sp, micro_batch_size=mbs,
                        dtype=DType.BF16, recompute=recompute, stack=stack)
    s, h, f = model.seq_length, model.hidden_size, model.ffn_size
    kv = model.kv_heads * model.head_dim
    fc1 = 2 * f if model.activation.value == "swiglu" else f
    gemm = 2 * mbs * s * (h * (h + 2 * kv) + h * h + h * fc1 + f * h) / tp
    fwd = sum(op.flops for op in trace.by_phase(Phase.FORWARD) if op.kind is OpKind.GEMM)
    assert abs(fwd - gemm) <= 1e-9 * gemm
    comm = [op for op in trace.collectives if op.phase is Phase.FORWARD]
    full = mbs * s * h * 2  # one [s, b, h] bf16 activation
    if tp == 1:
        assert not trace.collectives
    elif sp and tp > 1 and overlap:
        # userbuffers: each all-gather is tp - 1 ring exchanges of a shard, each reduce-scatter chunked;
        # the bytes moved are those of the plain collectives
        by_kind = {k: sum(op.collective.nbytes for op in comm if op.collective.kind is k) for k in CollectiveKind}
        assert by_kind[CollectiveKind.SEND_RECV] == 2 * (tp - 1) * full // tp
        assert by_kind[CollectiveKind.REDUCE_SCATTER] == 2 * full
        assert by_kind[CollectiveKind.ALL_GATHER] == by_kind[CollectiveKind.ALL_REDUCE] == 0
    elif sp and tp > 1:
        assert [op.collective.kind for op in comm] == [CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER] * 2
        assert all(op.collective.nbytes == full for op in trace.collectives)
    else:
        assert [op.collective.kind for op in comm] == [CollectiveKind.ALL_REDUCE] * 2
        assert all(op.collective.nbytes == full for op in trace.collectives)
    assert all(all(d < op.index for d in op.deps) for op in trace.ops)
    assert bool(trace.by_phase(Phase.RECOMPUTE)) == (recompute is not Recompute.NONE)
    modes = trace.saved_bytes_by_mode
    assert modes["full"] < min(modes["selective"], modes["none"]) and trace.saved_bytes == modes[recompute.value]
    # checkpointing the fused core saves nothing of its own, and its inputs' views may hold the packed QKV output
    # alive (attention.py's docstring), so selective keeps at most that much more than none
    assert modes["selective"] <= modes["none"] + mbs * s * (h + 2 * kv) * 2 // tp
    assert modes["full"] == mbs * (s // tp if sp and tp > 1 else s) * h * 2
