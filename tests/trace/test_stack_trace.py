"""What the software stack changes in the traced layer, and in the simulated step."""

from __future__ import annotations

import pytest

from echo_plan.specs import DType, ModelSpec, PlanSpec, Recompute, load_cluster, load_model, load_stack
from echo_plan.trace.tracer import trace_stage
from echo_plan.trace.records import OpKind, Phase, StageKind

GPT3 = load_model("gpt3-175b")
CORE = load_stack()
UNFUSED_2022 = load_stack("megatron-lm-2022")


def block(model, stack, tp=4, sp=False, recompute=Recompute.NONE, mbs=1):
    return trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=sp, micro_batch_size=mbs,
                       dtype=DType.BF16, recompute=recompute, stack=stack)


def test_traced_activations_equal_korthikanti_for_megatron_lm():
    """The traced GPT-3 layer of Megatron-LM 2022 (unfused attention, dropout) saves exactly
    s*b*h*(10 + 24/t + 5as/(ht)) bytes, 34sbh/t + 5as^2b/t with sequence parallelism, and 34sbh/t
    with selective recompute (Korthikanti et al. 2022, Eqs. 1-4, in bytes)."""
    s, h, a, t = GPT3.seq_length, GPT3.hidden_size, GPT3.num_attention_heads, 4
    stats = 2 * 8 * s  # at most the two LayerNorms' fp32 mean and rstd per token, which the paper leaves out

    def within_stats(traced: int, paper: float, shards: int = 1) -> bool:
        return 0 <= traced - paper <= stats / shards

    plain = block(GPT3, UNFUSED_2022).saved_bytes_by_mode
    assert within_stats(plain["none"], s * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = block(GPT3, UNFUSED_2022, sp=True).saved_bytes_by_mode
    assert within_stats(sp["none"], s * h / t * (34 + 5 * a * s / h), t)
    assert within_stats(sp["selective"], s * h * 34 / t, t)
    assert sp["full"] == 2 * s * h / t  # the layer's input shard, bf16


def test_dropout_adds_saved_bytes_and_kernels():
    plain = block(GPT3, CORE, sp=True)
    drop = block(GPT3, load_stack("megatron-core", {"hidden_dropout": 0.1, "attention_dropout": 0.1}), sp=True)
    s, h, t = GPT3.seq_length, GPT3.hidden_size, 4
    assert drop.saved_bytes - plain.saved_bytes == 2 * s * h // t  # two 1-byte masks per token, sequence-sharded
    names = {op.name for op in drop.ops}
    assert "echo_plan.flash_attention_dropout.default" in names and "echo_plan.dropout_backward.default" in names


def test_unfused_attention_costs_time_and_memory():
    from echo_plan.simulate import simulate

    cluster = load_cluster("h800", gpus=64)
    plan = PlanSpec(tp=8, pp=8, dp=1, global_batch_size=8, sequence_parallel=True)
    fused = simulate(GPT3, cluster, plan, stack=CORE)
    unfused = simulate(GPT3, cluster, plan, stack=load_stack("megatron-core", {"attention": "unfused"}))
    assert unfused.step_time_s > fused.step_time_s
    assert unfused.memory[0].activations_bytes > fused.memory[0].activations_bytes


@pytest.mark.parametrize("name,cluster,plan", [
    ("gpt3-175b", "h800", dict(tp=8, pp=4, dp=3, global_batch_size=48, virtual_stages=2)),
    ("llama3-70b", "dgx-h100", dict(tp=4, pp=4, dp=2, global_batch_size=32)),
    ("llama2-7b", "dgx-a100", dict(tp=2, pp=1, dp=4, global_batch_size=16, micro_batch_size=2)),
])
def test_tp_overlap_never_slows_a_step(name, cluster, plan):
    from echo_plan.simulate import simulate

    model = load_model(name)
    spec = load_cluster(cluster, gpus=plan["tp"] * plan["pp"] * plan["dp"])
    p = PlanSpec(sequence_parallel=True, **plan)
    on = simulate(model, spec, p, stack=load_stack("megatron-core", {"tp_comm_overlap": True}))
    off = simulate(model, spec, p, stack=load_stack("megatron-core", {"tp_comm_overlap": False}))
    assert on.step_time_s <= off.step_time_s


def test_unfused_gradient_accumulation_adds_one_kernel_per_weight():
    fused = block(GPT3, CORE, sp=True)
    unfused = block(GPT3, load_stack("megatron-core", {"gradient_accumulation_fusion": False}), sp=True)
    adds = [op for op in unfused.ops if op.name == "aten.add_.Tensor" and op.phase is Phase.BACKWARD]
    assert len(adds) == 4 and not [op for op in fused.ops if op.name == "aten.add_.Tensor"]  # QKV, proj, FC1, FC2
    assert all(op.outputs[0].dtype == "float32" for op in adds)  # into the fp32 main_grad


def test_recompute_modules_choose_what_selective_recompute_saves():
    llama = load_model("llama3-8b")
    saved = {}
    for modules in (["core_attn"], ["mlp"], ["layernorm"], ["core_attn", "mlp", "layernorm"]):
        t = block(llama, load_stack("megatron-core", {"recompute_modules": modules}), sp=True,
                  recompute=Recompute.SELECTIVE)
        saved[tuple(modules)] = t.saved_bytes
        assert t.by_phase(Phase.RECOMPUTE)
    none = block(llama, CORE, sp=True).saved_bytes
    # the MLP keeps far more than flash attention does; checkpointing the flash core saves nothing (its checkpointed
    # V, a view, holds the QKV output: test_attention.py)
    assert saved[("mlp",)] < min(saved[("core_attn",)], none)
    assert saved[("layernorm",)] < none
    assert saved[("core_attn", "mlp", "layernorm")] < min(saved[("mlp",)], saved[("layernorm",)])


def test_nemotron_features_are_traced():
    m = ModelSpec(name="n", num_layers=2, hidden_size=256, num_attention_heads=8, num_kv_heads=2, ffn_hidden_size=1024,
                  vocab_size=512, seq_length=128, activation="squared_relu", norm="layernorm1p",
                  position_embedding="rotary", rotary_percent=0.5, tied_embeddings=False)
    t = block(m, CORE, tp=2)
    assert t.param_count * 2 == m.params_per_layer + 2 * m.norm_params  # the two norms replicated, the rest split
    names = [op.name for op in t.ops if op.phase is Phase.FORWARD]
    assert "aten.relu.default" in names and "aten.pow.Tensor_Scalar" in names  # squared ReLU, unfused
    rope = [op for op in t.ops if op.name == "echo_plan.rope.default"]
    assert rope and rope[0].inputs[1].shape[-1] == m.head_dim // 2  # half of each head rotated
    assert not m.has_bias and not [op for op in t.ops if op.kind is OpKind.GEMM and op.name.startswith("aten.addmm")]


def test_bias_dropout_fusion_is_its_own_setting():
    """Megatron-Bridge's GPT-OSS provider keeps bias_activation_fusion but turns bias_dropout_fusion off: the biased
    residual adds of a GPT layer become separate bias and residual adds; the activation stays fused."""
    names = {}
    for bda in (None, False):
        ops = block(GPT3, CORE.replace(fused_bias_dropout_add=bda)).ops
        names[bda] = [op.name for op in ops if op.phase is Phase.FORWARD]
    assert names[None].count("echo_plan.bias_dropout_add.default") == 2
    assert "echo_plan.bias_dropout_add.default" not in names[False]
    assert names[False].count("aten.add.Tensor") >= names[None].count("aten.add.Tensor") + 4  # bias + residual, twice
    assert [n for n in names[False] if "gelu" in n] == [n for n in names[None] if "gelu" in n]
    assert CORE.replace(fused_bias_dropout_add=False).trace_signature() != CORE.trace_signature()
    assert CORE.replace(fused_bias_dropout_add=True).trace_signature() == CORE.trace_signature()


def test_an_eager_rmsnorm_runs_its_ops_and_keeps_its_fp32_copy_unless_compiled():
    """torchtitan's norm_type rmsnorm is an eager module: x.float(), pow, mean, rsqrt, the products, the cast back, each
    a kernel, autograd keeping the fp32 copy (4 bytes per element more than the fused kernel's input); a compiled block
    fuses its norms, but the final norm outside the blocks stays eager."""
    llama = load_model("llama3-8b")
    eager = load_stack("torchtitan").replace(torch_compile=False)
    fused = eager.replace(fused_norm=True)
    compiled = load_stack("torchtitan")
    assert not eager.fused_norm and compiled.block_norm_fused and not compiled.fused_norm

    def norm_ops(trace):
        return [op.name for op in trace.ops if op.phase is Phase.FORWARD and op.module.endswith("norm")]

    e, f, c = (block(llama, s, tp=1) for s in (eager, fused, compiled))
    assert {"aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default"} <= set(norm_ops(e))
    assert norm_ops(f) == norm_ops(c) == ["echo_plan.rms_norm.default"] * 2
    tokens, h = llama.seq_length, llama.hidden_size
    assert e.saved_bytes_by_mode["none"] - f.saved_bytes_by_mode["none"] == 2 * 4 * tokens * h  # two norms a layer
    out = trace_stage(llama, StageKind.OUTPUT, tp=1, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16,
                      recompute=Recompute.NONE, stack=compiled)
    assert "aten.rsqrt.default" in norm_ops(out)
