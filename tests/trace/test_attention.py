"""What the fused attention core is handed and saves (``echo_plan.trace.attention``): Transformer Engine's
layouts, and the QKV output freed or held."""

from __future__ import annotations

import pytest
import torch

from echo_plan.specs import DType, ModelSpec, Recompute, load_stack
from echo_plan.trace.attention import fused_inputs
from echo_plan.trace.records import StageKind
from echo_plan.trace.tracer import trace_stage

S, HEAD_DIM = 128, 32


def packed(heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k, v split from Megatron's grouped QKV output ([s, b, groups, (heads/groups + 2) * d])."""
    per_group = heads // kv_heads
    qkv = torch.zeros(4, 1, kv_heads, (per_group + 2) * HEAD_DIM)
    q, k, v = torch.split(qkv, [per_group * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
    return qkv, q.reshape(4, 1, heads, HEAD_DIM), k, v


def test_three_views_of_one_packed_buffer_pass_unchanged():
    qkv, q, k, v = packed(heads=4, kv_heads=4)  # multi-head, no rotary: TE's sbh3d layout
    assert all(a is b for a, b in zip(fused_inputs(q, k, v), (q, k, v)))


def test_fresh_query_and_key_beside_a_view_copy_the_view():
    qkv, q, k, v = packed(heads=8, kv_heads=2)
    q, k = q * 1, k * 1  # rotary's outputs
    q2, k2, v2 = fused_inputs(q, k, v)
    assert q2 is q and k2 is k and v2.is_contiguous() and v2.untyped_storage().data_ptr() != qkv.data_ptr()
    assert torch.equal(v2, v)


def layer(heads: int, kv_heads: int, rotary: bool, tp: int) -> dict[str, int]:
    m = ModelSpec(name="l", num_layers=2, hidden_size=256, num_attention_heads=heads, num_kv_heads=kv_heads,
                  ffn_hidden_size=512, vocab_size=1000, seq_length=S, activation="swiglu", norm="rmsnorm",
                  position_embedding="rotary" if rotary else "learned", tied_embeddings=False)
    assert m.head_dim == HEAD_DIM
    return trace_stage(m, StageKind.BLOCK, tp=tp, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16,
                       recompute=Recompute.NONE, stack=load_stack("megatron-core", {"tp_comm_overlap": False})
                       ).saved_bytes_by_mode


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 4, 1), (8, 4, 2), (8, 8, 1), (8, 2, 1)])
def test_the_fused_kernel_saves_its_own_value_and_a_checkpointed_core_holds_the_qkv_output(heads, kv_heads, tp):
    """With rotary embedding, no recompute saves q, k, a copy of V, the output and the fp32 log-sum-exp; Megatron's
    checkpoint of the core saves q, k and V as it came, a view that holds the whole QKV output. The difference is
    exactly QKV - V - log-sum-exp (the output is saved by the projection either way)."""
    modes = layer(heads, kv_heads, rotary=True, tp=tp)
    qkv, v = S * (heads + 2 * kv_heads) * HEAD_DIM * 2 // tp, S * kv_heads * HEAD_DIM * 2 // tp
    lse = S * heads * 4 // tp
    assert modes["selective"] - modes["none"] == qkv - v - lse


def test_a_packed_layout_is_saved_once_either_way():
    modes = layer(8, 8, rotary=False, tp=1)  # q, k, v three views of the QKV output: the kernel takes them as they are
    assert modes["none"] - modes["selective"] == S * 8 * 4  # only the log-sum-exp


def rope_ops(factor: float, stack_over: dict) -> dict[str, list[str]]:
    """The forward and backward ops the rotary module issues, by phase, for a model with this YaRN factor."""
    m = ModelSpec(name="y", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=512,
                  vocab_size=1000, seq_length=S, activation="swiglu", norm="rmsnorm", position_embedding="rotary",
                  tied_embeddings=False, rope_attention_factor=factor)
    trace = trace_stage(m, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16,
                        recompute=Recompute.NONE, stack=load_stack("megatron-core", {"tp_comm_overlap": False,
                                                                                     **stack_over}))
    out: dict[str, list[str]] = {}
    for op in trace.ops:
        if op.module.endswith("rotary") and op.kind.value != "view":
            out.setdefault(op.phase.value, []).append(op.name)
    return out


def test_a_yarn_factor_sends_megatron_cores_rope_to_its_unfused_ops_scaled_on_every_call():
    plain, scaled = rope_ops(1.0, {}), rope_ops(1.3466, {})
    assert plain["forward"] == ["echo_plan.rope.default"] * 2  # query and key: TE's fused kernel
    fwd = scaled["forward"]
    assert "echo_plan.rope.default" not in fwd
    assert fwd.count("aten.cos.default") == fwd.count("aten.sin.default") == 2  # cos and sin, once per call
    assert fwd.count("aten.cat.default") == 4  # rotate-half's and the final one with the (empty) rest, per call
    assert len(scaled["backward"]) > len(plain["backward"])
    # a stack whose fused kernel takes the factor (torchtitan-like) keeps the fused RoPE
    assert rope_ops(1.3466, {"fused_rope_scales": True})["forward"] == plain["forward"]


def test_a_rope_factor_needs_rotary_embedding():
    with pytest.raises(ValueError, match="rope_attention_factor 1.3 needs position_embedding rotary"):
        ModelSpec(name="y", num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=1000, seq_length=S,
                  rope_attention_factor=1.3)
