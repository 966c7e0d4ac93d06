"""torchtitan's per-op selective checkpointing (``recompute_policy: ops``): the layer checkpointed, the outputs
of every other matmul and of attention kept (trace/op_checkpoint.py)."""

from __future__ import annotations

import pytest

from echo_plan.specs import load_model, load_stack
from echo_plan.specs.plan import Recompute
from echo_plan.trace.records import OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

TT = load_stack("torchtitan")


@pytest.fixture(scope="module")
def traces():
    model = load_model("llama3-8b").replace(seq_length=1024)
    return {mode: trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                              dtype="bf16", recompute=mode, stack=TT) for mode in Recompute}


def test_the_op_policy_keeps_between_full_and_no_recompute(traces):
    none, op, full = (traces[m].saved_bytes for m in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL))
    assert full < op < none


def test_the_op_policy_keeps_the_odd_numbered_matmuls_and_attention(traces):
    """torchtitan's Llama layer: wq, wk, wv, wo, w1, w3, w2. Kept: the outputs of wq, wv, w1 and w2 (the 1st, 3rd,
    5th and 7th), attention's output and its log-sum-exp, and the layer's input; recomputed: wk, wo and w3."""
    model = load_model("llama3-8b").replace(seq_length=1024)
    h, kv, f, s = model.hidden_size, model.kv_heads * model.head_dim, model.ffn_size, 1024
    kept = 2 * s * (h + h + kv + f + h + h)  # input, wq, wv, w1, w2, attention's output
    assert traces[Recompute.SELECTIVE].saved_bytes == pytest.approx(kept, rel=0.02)


def test_recomputed_ops_run_again_in_backward(traces):
    def gemms(t, phase):
        return sum(1 for op in t.ops if op.phase is phase and op.kind is OpKind.GEMM)
    none, op, full = traces[Recompute.NONE], traces[Recompute.SELECTIVE], traces[Recompute.FULL]
    assert gemms(op, Phase.RECOMPUTE) == 3 and gemms(full, Phase.RECOMPUTE) == 7  # wk, wo and w3 again
    assert gemms(none, Phase.RECOMPUTE) == 0
    assert gemms(op, Phase.FORWARD) == gemms(none, Phase.FORWARD)


def test_the_policy_is_part_of_the_trace_key():
    assert TT.trace_signature() != TT.replace(recompute_policy="modules", recompute_modules=["core_attn"]).trace_signature()
