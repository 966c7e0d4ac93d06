"""MoE layers traced from module code: properties the issue asks for, on a small MoE model."""

from __future__ import annotations

import pytest

from echo_plan.errors import SpecError
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster, load_stack, validate_plan
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.trace.records import CollectiveKind, GroupKind, Phase
from echo_plan.trace.tracer import StageKind, trace_stage

MOE = LayerKind(moe=True)


def tiny(top_k: int = 2, experts: int = 8, **moe) -> ModelSpec:
    return ModelSpec.build(dict(
        name="tiny-moe", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=2, vocab_size=1000,
        seq_length=256, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        moe=dict(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=128, **moe)))


def moe_trace(model: ModelSpec, tp: int = 1, ep: int = 1, etp: int = 1, imbalance: float = 1.0):
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=tp > 1, micro_batch_size=1, dtype="bf16",
                       recompute="none", kind=MOE, layout=ExpertLayout(ep, etp, imbalance))


def a2a_bytes(trace) -> int:
    return sum(op.collective.nbytes for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL)


def expert_flops(trace) -> float:
    return sum(op.flops for op in trace.ops if op.phase is Phase.FORWARD and op.name == "aten.bmm.default")


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_traced_expert_flops_are_top_k_tokens_times_expert_gemm_flops(ep):
    model = tiny()
    trace = moe_trace(model, ep=ep)
    tokens = model.seq_length  # micro-batch 1, tp 1: every rank routes the whole sequence
    h, f = model.hidden_size, model.moe.expert_ffn_hidden_size
    per_copy = 2 * h * (2 * f) + 2 * f * h  # SwiGLU FC1 (gate and up) and FC2
    assert expert_flops(trace) == pytest.approx(model.moe.top_k * tokens * per_copy)


def test_more_experts_per_token_never_shrink_all_to_all_bytes():
    sizes = [a2a_bytes(moe_trace(tiny(top_k=k), ep=4)) for k in (1, 2, 4, 8)]
    assert sizes == sorted(sizes) and sizes[0] > 0


def test_all_to_all_runs_on_the_expert_group_with_megatron_strides():
    trace = moe_trace(tiny(), tp=2, ep=4, etp=1)
    groups = {op.collective.group for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL}
    assert {(g.kind, g.size, g.stride) for g in groups} == {(GroupKind.EP, 4, 1)}
    # Megatron-Core >= 0.13 (the default stack): dispatch, the probabilities' own all-to-all, combine; and back
    assert len([op for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL]) == 6


def _a2a_and_saved(stack):
    trace = trace_stage(tiny(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                        recompute="none", kind=MOE, layout=ExpertLayout(4, 1, 1.0), stack=load_stack(stack))
    a2a = [op for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL]
    return trace, a2a


def test_probabilities_at_unpermute_or_in_the_activation_follow_the_stack(tmp_path):
    """Megatron-Core <= 0.12 weights the copies at un-permutation, which keeps every expert output for
    backward; >= 0.13 sends the probabilities with the copies and weights the activation, keeping one fp32
    value per copy instead: fewer saved bytes, one small all-to-all more each way."""
    old = tmp_path / "mcore-0.12.yaml"
    old.write_text("base: megatron-core\nmoe_probs_in_activation: false\n")
    new_trace, new_a2a = _a2a_and_saved("megatron-core")
    old_trace, old_a2a = _a2a_and_saved(str(old))
    assert (len(old_a2a), len(new_a2a)) == (4, 6)
    model = tiny()
    copies = model.seq_length * model.moe.top_k // 4 * 4  # ep 4, balanced: as many copies in as out
    expert_out = 2 * copies * model.hidden_size  # bf16 rows the probability-weighted un-permutation keeps
    assert old_trace.saved_bytes - new_trace.saved_bytes == pytest.approx(expert_out - 4 * copies, rel=0.02)
    names = {op.name for op in new_trace.ops}
    assert any("weighted_act" in n for n in names) and not any(n.endswith("moe_unpermute.default") for n in names)
    deepep = tmp_path / "deepep.yaml"  # DeepEP's dispatch carries the gate weights inside the token exchange
    deepep.write_text("base: megatron-core\nmoe_dispatcher: deepep\n")
    dp_trace, dp_a2a = _a2a_and_saved(str(deepep))
    assert len(dp_a2a) == 4
    # DeepEP's kernels read and sum each token's copies in place: no permute before the dispatch, no
    # un-permute after the combine, and none of the row map (8 bytes per copy) Megatron-Core's keeps
    assert new_trace.saved_bytes - dp_trace.saved_bytes == 8 * model.seq_length * model.moe.top_k
    def kernels(trace, name):
        return sum(1 for op in trace.ops if op.name.endswith(f"{name}.default") and op.phase.value == "forward")
    assert kernels(dp_trace, "moe_unpermute_sum") == 0 < kernels(new_trace, "moe_unpermute_sum")
    assert kernels(dp_trace, "moe_permute") < kernels(new_trace, "moe_permute")
    assert {op.collective.nbytes for op in dp_a2a} <= {op.collective.nbytes for op in new_a2a}  # the same rows


def test_imbalance_never_lightens_the_busiest_rank():
    model = tiny()
    base = moe_trace(model, ep=4)
    hot = moe_trace(model, ep=4, imbalance=2.0)
    assert expert_flops(hot) > expert_flops(base)
    assert a2a_bytes(hot) >= a2a_bytes(base)


def test_bad_moe_inputs_are_one_line_errors():
    with pytest.raises(SpecError, match="top_k 9 must not exceed num_experts 8"):
        tiny(top_k=9)
    cluster = load_cluster("h800", gpus=8)
    with pytest.raises(SpecError, match="ep=8 is invalid: must divide num_experts 12 of tiny-moe"):
        validate_plan(PlanSpec(dp=8, ep=8, global_batch_size=8), tiny(experts=12), cluster)
    with pytest.raises(SpecError, match="needs a mixture-of-experts model"):
        dense = tiny().replace(moe=None)
        validate_plan(PlanSpec(dp=8, ep=2, global_batch_size=8), dense, cluster)
    with pytest.raises(SpecError, match="ep x etp"):
        PlanSpec.build(dict(tp=1, dp=6, ep=4, global_batch_size=6))


def _clamped(model: ModelSpec) -> ModelSpec:
    return model.replace(activation="swiglu_clamped")


def _expert_ops(trace, phase) -> list[str]:
    return [op.name for op in trace.ops if op.phase is phase and op.module.endswith("experts")]


@pytest.mark.parametrize("fused", [True, False])
def test_clamped_experts_run_megatrons_fused_geglu_when_the_stack_fuses(fused):
    """Megatron-Core's experts run GPT-OSS's clamped unit as one fused kernel each way
    (weighted_bias_quick_geglu_impl); a stack without fused elementwise ops runs the plain torch ops."""
    from echo_plan.specs import load_stack

    stack = load_stack("megatron-core", {"fused_elementwise": fused})
    trace = trace_stage(_clamped(tiny()), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                        dtype="bf16", recompute="none", kind=MOE, layout=ExpertLayout(1, 1, 1.0), stack=stack)
    fwd, bwd = _expert_ops(trace, Phase.FORWARD), _expert_ops(trace, Phase.BACKWARD)
    if fused:  # weighted by the router probabilities, as Megatron-Core >= 0.13 calls it (the default stack)
        assert fwd.count("echo_plan.weighted_act.default") == 1 and "aten.clamp.default" not in fwd
        assert bwd.count("echo_plan.weighted_act_backward.default") == 1 and "aten.sigmoid_backward.default" not in bwd
    else:
        assert "echo_plan.weighted_act.default" not in fwd and "aten.clamp.default" in fwd


@pytest.mark.parametrize("kind", ["swiglu", "clamped_geglu"])
def test_the_weighted_activation_matches_the_plain_ops_both_ways(kind):
    """act(h) x p in one kernel computes what the plain ops compute, both gradients included."""
    import torch

    from echo_plan.trace.fused_elementwise import clamped_geglu_reference
    from echo_plan.trace.moe_kernels import weighted_act

    gen = torch.Generator().manual_seed(1)
    h = (torch.randn(3, 5, 8, generator=gen) * 6).requires_grad_(True)
    p = torch.rand(3, 5, 1, generator=gen).requires_grad_(True)
    g = torch.randn(3, 5, 4, generator=gen)
    out = weighted_act(h, p, kind)
    dh, dp = torch.autograd.grad(out, (h, p), g)
    gate, up = torch.chunk(h, 2, dim=-1)
    plain = (clamped_geglu_reference(h) if kind == "clamped_geglu" else torch.nn.functional.silu(gate) * up) * p
    ph, pp = torch.autograd.grad(plain, (h, p), g)
    assert torch.allclose(out, plain, atol=1e-5) and torch.allclose(dh, ph, atol=1e-4) and torch.allclose(dp, pp, atol=1e-4)


def test_fused_clamped_geglu_matches_the_plain_ops_both_ways():
    """The fused kernel computes what the unfused ops compute, gradients included, clamped regions too."""
    import torch

    from echo_plan.trace.fused_elementwise import CLAMP_LIMIT, clamped_geglu, clamped_geglu_reference

    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(64, 32, generator=gen, dtype=torch.float64) * 2 * CLAMP_LIMIT).requires_grad_()
    h2 = h.detach().clone().requires_grad_()
    grad = torch.randn(64, 16, generator=gen, dtype=torch.float64)
    out, ref = clamped_geglu(h), clamped_geglu_reference(h2)
    assert torch.allclose(out, ref)
    out.backward(grad)
    ref.backward(grad)
    assert (h.abs() > CLAMP_LIMIT).any()  # the clamps are exercised
    assert torch.allclose(h.grad, h2.grad)


def test_fused_clamped_experts_never_cost_more_than_unfused():
    """One fused pass each way moves fewer bytes than the chain of plain kernels it replaces."""
    from echo_plan.cost.kernel_db import compute_model_for
    from echo_plan.specs import DType, load_stack

    cluster = load_cluster("h800", gpus=8)
    compute = compute_model_for(cluster)

    def seconds(fused: bool) -> float:
        stack = load_stack("megatron-core", {"fused_elementwise": fused})
        trace = trace_stage(_clamped(tiny()), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                            dtype="bf16", recompute="none", kind=MOE, layout=ExpertLayout(1, 1, 1.0), stack=stack)
        return sum(compute.op_time(op, cluster.gpu, DType.BF16) for op in trace.ops
                   if op.collective is None and op.module.endswith("experts") and op.kind.value == "elementwise")

    assert seconds(True) < seconds(False)


def test_the_activation_input_cached_in_fp8_halves_what_the_recomputed_activation_keeps(tmp_path):
    """DeepSeek-V3 keeps the SwiGLU inputs in FP8 (1 x 128 tiles) when it recomputes the activation: the
    saved bytes drop by half of that input (less the tiles' fp32 scales) and backward dequantises it."""
    def traced(fp8_input: bool):
        stack = load_stack("megatron-core", {"recompute_modules": ["moe_act"], "moe_act_input_fp8": fp8_input})
        return trace_stage(tiny(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                           recompute="selective", kind=MOE, layout=ExpertLayout(1, 1, 1.0), stack=stack)

    plain, cached = traced(False), traced(True)
    model = tiny()
    copies = model.seq_length * model.moe.top_k
    h_in = 2 * model.moe.expert_ffn_hidden_size  # gate and up halves
    expected = copies * h_in * 2 - copies * h_in - copies * (-(-h_in // 128)) * 4
    assert plain.saved_bytes - cached.saved_bytes == pytest.approx(expected, rel=0.02)
    assert any(op.name.endswith("fp8_block_dequant.default") for op in cached.ops if op.phase is Phase.BACKWARD)


def test_blockwise_fp8_round_trip_keeps_the_values():
    import torch

    from echo_plan.trace.fp8_kernels import fp8_block_cast, fp8_block_dequant

    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    q, s, _, _ = fp8_block_cast(x, False, False)
    back = fp8_block_dequant(q, s, 300).float()
    assert back.shape == x.shape and torch.allclose(back, x.float(), rtol=0.07, atol=0.02)


def test_mlp_recompute_checkpoints_dense_layers_only():
    """Megatron-Core's 'mlp' recompute module skips MoE layers (transformer_layer.py): an MoE layer traces and
    keeps the same with it as without, while a dense layer of the same model is recomputed and keeps less."""
    from echo_plan.cost.activation_memory import layer_activation_bytes
    from echo_plan.specs.plan import Recompute

    def traced(kind, modules):
        stack = load_stack("megatron-core", {"recompute_modules": modules})
        return trace_stage(tiny(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                           recompute="selective", kind=kind, layout=ExpertLayout(1, 1, 1.0), stack=stack)

    dense = LayerKind(moe=False)
    moe_plain, moe_mlp = traced(MOE, []), traced(MOE, ["mlp"])
    assert moe_mlp.saved_bytes == moe_plain.saved_bytes
    assert len(moe_mlp.ops) == len(moe_plain.ops)  # nothing re-run in backward
    dense_plain, dense_mlp = traced(dense, []), traced(dense, ["mlp"])
    assert dense_mlp.saved_bytes < dense_plain.saved_bytes and len(dense_mlp.ops) > len(dense_plain.ops)
    plan = PlanSpec.build(dict(tp=1, pp=1, dp=1, micro_batch_size=1, global_batch_size=1, recompute="selective"))
    for kind in (MOE, dense):  # the closed form agrees on which layers it applies to
        a, b = (layer_activation_bytes(tiny(), plan, Recompute.SELECTIVE,
                                       load_stack("megatron-core", {"recompute_modules": m}), kind)
                for m in ([], ["mlp"]))
        assert (a == b) if kind.moe else (b < a)


@pytest.mark.parametrize("ep", [1, 4])
def test_expert_biases_are_added_per_local_expert_as_megatron_core_does(ep):
    """GPT-OSS's experts carry biases: FC1's goes into the grouped GEMM, FC2's is added by Megatron-Core's
    _apply_bias, one weighted sum per local expert and a concatenation; a model without biases runs none of it,
    and the biases never lighten the layer's traced work."""
    plain = tiny()
    biased = ModelSpec.build({**plain.model_dump(), "bias": True})
    local = plain.moe.num_experts // ep

    def expert_ops(model):
        trace = moe_trace(model, ep=ep)
        fwd = [op.name for op in trace.ops if op.phase is Phase.FORWARD and op.module == "mlp.experts"]
        return trace, fwd

    plain_trace, plain_fwd = expert_ops(plain)
    biased_trace, biased_fwd = expert_ops(biased)
    added = [n for n in biased_fwd if n not in plain_fwd or biased_fwd.count(n) > plain_fwd.count(n)]
    assert biased_fwd.count("aten.add.Tensor") - plain_fwd.count("aten.add.Tensor") == local
    assert biased_fwd.count("aten.mul.Tensor") - plain_fwd.count("aten.mul.Tensor") == local
    assert "aten.cat.default" in added
    moved = lambda t: sum(op.bytes_read + op.bytes_written for op in t.ops)  # noqa: E731
    assert moved(biased_trace) > moved(plain_trace)
