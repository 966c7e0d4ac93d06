"""Separate projections (``fused_projections`` off: torchtitan's wq/wk/wv and w1/w3) against Megatron's fused ones:
the same FLOPs and the same layer without checkpointing, a GEMM per weight, one crossing into the TP region per input
(one ring with async TP), one FP8 cast per input, and what torchtitan's per-op checkpointing keeps."""

from __future__ import annotations

import pytest

from echo_plan.specs import DType, ModelSpec, Recompute, load_stack
from echo_plan.trace.records import CollectiveKind, OpKind, Phase, StageKind
from echo_plan.trace.tracer import trace_stage

S, H, HEADS, KV, FFN, MBS = 128, 256, 8, 2, 512, 2
D = H // HEADS


def model(activation: str = "swiglu") -> ModelSpec:
    return ModelSpec(name="p", num_layers=2, hidden_size=H, num_attention_heads=HEADS, num_kv_heads=KV,
                     ffn_hidden_size=FFN, vocab_size=1000, seq_length=S, activation=activation, norm="rmsnorm",
                     position_embedding="rotary", tied_embeddings=False)


def trace(fused: bool, *, tp: int = 1, recompute: Recompute = Recompute.NONE, dtype: DType = DType.BF16,
          overlap: bool = False, activation: str = "swiglu"):
    stack = load_stack("torchtitan", {"fused_projections": fused, "tp_comm_overlap": overlap})
    return trace_stage(model(activation), StageKind.BLOCK, tp=tp, sequence_parallel=tp > 1, micro_batch_size=MBS,
                       dtype=dtype, recompute=recompute, stack=stack)


def gemms(t, phase: Phase = Phase.FORWARD) -> list:
    return [op for op in t.by_phase(phase) if op.kind is OpKind.GEMM]


def collectives(t, kind: CollectiveKind, phase: Phase) -> int:
    return sum(1 for op in t.by_phase(phase) if op.collective is not None and op.collective.kind is kind)


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_gemm_per_weight_with_the_same_flops(tp, dtype):
    """Q, K, V and gate, up: seven forward GEMMs instead of four, the same work, the same parameters."""
    fused, split = trace(True, tp=tp, dtype=dtype), trace(False, tp=tp, dtype=dtype)
    assert len(gemms(fused)) == 4 and len(gemms(split)) == 7
    assert sum(op.flops for op in gemms(split)) == pytest.approx(sum(op.flops for op in gemms(fused)))
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert sum(op.flops for op in gemms(split, phase)) == pytest.approx(sum(op.flops for op in gemms(fused, phase)))
    assert split.param_count == fused.param_count
    widths = sorted(op.outputs[0].shape[-1] for op in gemms(split))
    assert widths == sorted([HEADS * D // tp, KV * D // tp, KV * D // tp, H, FFN // tp, FFN // tp, H])


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8])
def test_the_input_is_gathered_once_for_the_projections_that_read_it(dtype):
    """With sequence parallelism the input of wq/wk/wv (and of w1/w3) is all-gathered once, as DTensor's
    PrepareModuleInput does, gathered once more in backward, and the summed input gradient reduce-scattered once:
    the fused layer's collectives, no more."""
    fused, split = trace(True, tp=2, dtype=dtype), trace(False, tp=2, dtype=dtype)
    for kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER):
        for phase in (Phase.FORWARD, Phase.BACKWARD):
            assert collectives(split, kind, phase) == collectives(fused, kind, phase), (kind, phase)


def test_fp8_casts_the_shared_input_once():
    """torchtitan's PrepareFloat8ModuleInput (and compile's CSE of identical casts): one forward cast per input,
    as the fused layer has."""
    def casts(t):
        return sum(1 for op in t.by_phase(Phase.FORWARD) if "cast" in op.name or "amax" in op.name)
    for tp in (1, 2):
        assert casts(trace(False, tp=tp, dtype=DType.FP8)) == casts(trace(True, tp=tp, dtype=DType.FP8))


@pytest.mark.parametrize("tp", [1, 2])
def test_no_checkpointing_saves_the_same(tp):
    """Without checkpointing the separate GEMMs keep what the fused layer keeps: the input's shard once, q and k
    after rotary, V, the gate and up (the fused SwiGLU's input), the MLP's input; and full recompute keeps the
    layer's input either way."""
    split, fused = trace(False, tp=tp).saved_bytes_by_mode, trace(True, tp=tp).saved_bytes_by_mode
    assert split["none"] == fused["none"] and split["full"] == fused["full"]


def test_per_op_checkpointing_keeps_the_odd_numbered_matmuls():
    """torchtitan's policy keeps the 1st, 3rd, 5th ... matmul: wq, wv, w1 and w2 of a separate-projection block
    (QKV and the gate/up GEMM of a fused one), so the block keeps less."""
    fused, split = (trace(f, recompute=Recompute.SELECTIVE).saved_bytes for f in (True, False))
    e, tokens = 2, S * MBS
    attn_out, lse, block_input = e * tokens * HEADS * D, 4 * MBS * HEADS * S, e * tokens * H
    kept_fused = e * tokens * ((HEADS + 2 * KV) * D + 2 * FFN)
    kept_split = e * tokens * (HEADS * D + KV * D + FFN + H)
    assert fused == block_input + attn_out + lse + kept_fused
    assert split == block_input + attn_out + lse + kept_split
    assert split < fused


@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8])
def test_async_tp_rings_the_input_past_every_weight(dtype):
    """With TP communication overlap the shared input travels one ring (async TP's fused all-gather-matmul takes
    several weights): a GEMM per weight per arriving chunk, the fused layer's exchanges and reductions, the same
    work."""
    tp = 2
    fused, split = trace(True, tp=tp, overlap=True, dtype=dtype), trace(False, tp=tp, overlap=True, dtype=dtype)
    assert len(gemms(split)) - len(gemms(fused)) == 3 * tp  # wk/wv and w3: one more GEMM per chunk each
    assert sum(op.flops for op in gemms(split)) == pytest.approx(sum(op.flops for op in gemms(fused)))
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        assert [op.collective for op in split.by_phase(phase) if op.collective is not None] == \
            [op.collective for op in fused.by_phase(phase) if op.collective is not None]


def test_a_gelu_mlp_has_no_gate_to_split():
    assert len(gemms(trace(False, activation="gelu"))) == 6 and len(gemms(trace(True, activation="gelu"))) == 4
