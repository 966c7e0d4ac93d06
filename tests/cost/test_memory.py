"""The memory model: properties that must hold whatever the constants are."""

from __future__ import annotations

import pytest

from echo_plan.cost.memory import (
    embedding_activation_bytes,
    estimate_memory,
    inflight_chunk_passes,
    layer_activation_bytes,
    layer_params_per_rank,
    load_memory_constants,
    output_activation_bytes,
    stage_memory,
    stage_params,
)
from echo_plan.errors import FileFormatError
from echo_plan.specs import PlanSpec, Recompute, load_cluster, load_model, load_stack
from echo_plan.specs.software import RecomputeModule
from echo_plan.specs.software_kinds import CudaAllocator
from echo_plan.trace.records import LayerTrace, StageKind, TraceKey

CLUSTER = load_cluster("h800")
GPT = load_model("gpt3-175b")
LLAMA = load_model("llama2-70b")
STACK = load_stack()
# Megatron-LM with dropout and unfused attention: the stack Korthikanti et al. 2022 count for
UNFUSED = load_stack("megatron-lm-2022")


def estimate(model, p, cluster=CLUSTER, stack=STACK, headroom=None):
    return estimate_memory(model, p, cluster, stack, headroom)


def plan(**kw):
    base = dict(tp=8, pp=12, dp=1, global_batch_size=96)
    base.update(kw)
    return PlanSpec.build(base)


PLANS = [
    plan(),
    plan(sequence_parallel=True, recompute="selective"),
    plan(virtual_stages=2),
    plan(schedule="gpipe", global_batch_size=24),
    plan(tp=4, pp=8, dp=3, recompute="full"),
    plan(tp=8, pp=1, dp=12, global_batch_size=96, distributed_optimizer=True),
]


def test_params_add_up_to_the_model():
    for model in (GPT, LLAMA):
        assert layer_params_per_rank(model, 1) == model.params_per_layer
        p = plan(tp=1, pp=1, dp=96)
        assert stage_params(model, p, 0) == model.num_params


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("interleaved", 2), ("zb-v", 2)])
def test_every_parameter_is_on_one_rank_and_the_output_where_the_last_stage_is(schedule, v):
    """Untied Llama 2 70B on 4 stages: the ranks' parameters add up to the model's, whatever the layout; the
    output layer (and the loss's transient) is on the rank holding the last stage: rank 0 in ZB-V's V, where
    the first and last stages share a rank, else rank 3."""
    p = PlanSpec.build(dict(tp=1, pp=4, dp=1, global_batch_size=16, schedule=schedule, virtual_stages=v))
    assert sum(stage_params(LLAMA, p, s) for s in range(4)) == LLAMA.num_params
    word = LLAMA.vocab_size * LLAMA.hidden_size
    ends = 0 if schedule == "zb-v" else 3
    layers = [stage_params(LLAMA, p, s) - (word if s == 0 else 0) - (word + LLAMA.norm_params if s == ends else 0)
              for s in range(4)]
    assert layers == [LLAMA.num_layers // 4 * LLAMA.params_per_layer] * 4
    te = load_stack("megatron-core", {"cross_entropy": "te"})  # another loss kernel: only the loss's rank changes
    a, b = estimate(LLAMA, p, stack=STACK), estimate(LLAMA, p, stack=te)
    assert [s for s in range(4) if a[s].total_bytes != b[s].total_bytes] == [ends]


def test_tensor_parallel_splits_the_weights():
    assert layer_params_per_rank(GPT, 8) < GPT.params_per_layer / 7.9
    assert layer_params_per_rank(GPT, 8) >= GPT.params_per_layer / 8


@pytest.mark.parametrize("p", PLANS, ids=lambda p: p.short())
def test_distributed_optimizer_never_increases_memory(p):
    for model in (GPT, LLAMA):
        without = estimate(model, p.replace(distributed_optimizer=False))
        with_ = estimate(model, p.replace(distributed_optimizer=True))
        for a, b in zip(without, with_):
            assert b.total_bytes <= a.total_bytes
            assert b.weights_bytes == a.weights_bytes


def test_megatron_bytes_per_parameter():
    p = plan(tp=8, pp=1, dp=12, global_batch_size=96)
    plain = estimate(GPT, p)[0]
    dist = estimate(GPT, p.replace(distributed_optimizer=True))[0]
    n = stage_params(GPT, p, 0)
    assert (plain.weights_bytes + plain.gradients_bytes + plain.optimizer_bytes) == pytest.approx(18 * n, abs=3)
    assert (dist.weights_bytes + dist.gradients_bytes + dist.optimizer_bytes) == pytest.approx((6 + 12 / 12) * n, abs=3)


@pytest.mark.parametrize("p", PLANS, ids=lambda p: p.short())
def test_more_recomputation_never_increases_activations(p):
    for model in (GPT, LLAMA):
        for stack in (STACK, UNFUSED, load_stack("megatron-core", {"recompute_modules": ["core_attn", "mlp", "layernorm"]})):
            acts = [tuple(s.activations_bytes for s in estimate(model, p.replace(recompute=r), stack=stack))
                    for r in ("none", "selective", "full")]
            for stage in range(p.pp):
                assert min(acts[0][stage], acts[1][stage]) >= acts[2][stage]
                # a checkpointed flash core alone saves nothing, and with RoPE its V, a view, holds the QKV output
                # (trace/attention.py); recomputing the MLP or the norms too always saves memory
                if RecomputeModule.MLP in stack.recompute_modules:
                    assert acts[0][stage] >= acts[1][stage]


def test_doubling_micro_batch_doubles_activations():
    for model in (GPT, LLAMA):
        for r in ("none", "selective", "full"):
            one = plan(recompute=r, micro_batch_size=1, global_batch_size=96)
            two = plan(recompute=r, micro_batch_size=2, global_batch_size=192)
            a = estimate(model, one)
            b = estimate(model, two)
            for x, y in zip(a, b):
                assert y.activations_bytes == pytest.approx(2 * x.activations_bytes, rel=0.02)


def test_korthikanti_formula_is_a_special_case():
    # GPT-3 with dropout and without fused attention: s*b*h*(10 + 24/t + 5as/(ht)) per layer.
    s, h, a, t = GPT.seq_length, GPT.hidden_size, GPT.num_attention_heads, 8
    for sp in (False, True):
        p = plan(sequence_parallel=sp)
        got = layer_activation_bytes(GPT, p, Recompute.NONE, UNFUSED)
        if sp:
            want = s * h / t * (34 + 5 * a * s / h)
        else:
            want = s * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert got == pytest.approx(want, rel=1e-3)
        sel = layer_activation_bytes(GPT, p, Recompute.SELECTIVE, UNFUSED)
        assert sel == pytest.approx(s * h * 34 / t if sp else s * h * (10 + 24 / t), rel=1e-3)


def test_inflight_micro_batches_per_schedule():
    m = 96
    p = plan()
    assert [inflight_chunk_passes(p, i) for i in (0, 5, 11)] == [12, 7, 1]
    g = plan(schedule="gpipe")
    assert inflight_chunk_passes(g, 11) == m
    v = plan(virtual_stages=2)
    # Megatron-LM: (p - i - 1) * 2 + (v - 1) * p warm-up chunk forwards, plus one
    assert inflight_chunk_passes(v, 0) == 22 * 1 + 12 + 1
    assert inflight_chunk_passes(v, 11) == 12 + 1
    few = plan(global_batch_size=4)
    assert inflight_chunk_passes(few, 0) == 4


def test_first_stage_holds_most_activations_under_1f1b():
    mem = estimate(GPT, plan())
    assert mem[0].activations_bytes > mem[6].activations_bytes > 0


def test_capacity_and_fit():
    mem = estimate(GPT, plan())
    assert all(s.capacity_bytes == 80 * 2**30 for s in mem)
    tiny = estimate(GPT, plan(tp=1, pp=1, dp=96))
    assert not tiny[0].fits  # 175B parameters x 18 bytes cannot fit one GPU


def test_a_plan_fits_only_with_its_headroom_free():
    p = plan(tp=8, pp=12, dp=1, sequence_parallel=True, recompute="selective")
    peak = max(s.total_bytes for s in estimate(GPT, p, headroom=0))
    room = CLUSTER.gpu.hbm_GiB * 2**30 - peak
    assert room > 0
    assert all(s.fits for s in estimate(GPT, p, headroom=int(room) - 1))
    assert not all(s.fits for s in estimate(GPT, p, headroom=int(room) + 2**20))
    default = estimate(GPT, p)[0]
    assert default.headroom_bytes == int(0.02 * 80 * 2**30)  # memory.yaml's default share
    assert default.usable_bytes == default.capacity_bytes - default.headroom_bytes


def test_stack_gradient_dtype_and_sharding():
    p = plan(tp=8, pp=1, dp=12, global_batch_size=96, distributed_optimizer=True)
    fp32 = estimate(GPT, p)[0]
    bf16 = estimate(GPT, p, stack=load_stack("megatron-core", {"grad_reduce_dtype": "bf16"}))[0]
    zero2 = estimate(GPT, p, stack=load_stack("megatron-core", {"optimizer_sharding": "states_and_grads"}))[0]
    assert bf16.gradients_bytes * 2 == pytest.approx(fp32.gradients_bytes, abs=2)
    assert zero2.gradients_bytes * 12 == pytest.approx(fp32.gradients_bytes, abs=12)
    assert zero2.optimizer_bytes == fp32.optimizer_bytes


def test_dropout_and_unfused_attention_cost_memory():
    p = plan(sequence_parallel=True)
    flash = layer_activation_bytes(GPT, p, Recompute.NONE, STACK)
    dropout = layer_activation_bytes(GPT, p, Recompute.NONE, load_stack("megatron-core", {"hidden_dropout": 0.1}))
    unfused = layer_activation_bytes(GPT, p, Recompute.NONE, load_stack("megatron-core", {"attention": "unfused"}))
    assert dropout > flash and unfused > flash


class _Traces:
    def __init__(self, block, embedding, output):
        self.block, self.embedding, self.output = block, embedding, output


def _trace(stage, saved, by_mode=None):
    key = TraceKey(stage, "synthetic", 8, False, 1, 2048, "bf16", "none", "test")
    return LayerTrace(key, (), saved, by_mode or {})


@pytest.mark.parametrize("p", PLANS, ids=lambda p: p.short())
def test_trace_and_estimate_agree_when_saved_bytes_agree(p):
    # stage_memory with traces whose saved bytes equal the closed form reproduces estimate_memory.
    traces = _Traces(
        _trace(StageKind.BLOCK, layer_activation_bytes(GPT, p, p.recompute, STACK),
               {"none": layer_activation_bytes(GPT, p, Recompute.NONE, STACK)}),
        _trace(StageKind.EMBEDDING, embedding_activation_bytes(GPT, p, STACK)),
        _trace(StageKind.OUTPUT, output_activation_bytes(GPT, p, load_stack())),
    )
    for a, b in zip(stage_memory(GPT, p, CLUSTER, traces, STACK), estimate(GPT, p)):
        assert a == b


def test_traced_activations_scale_with_saved_bytes():
    p = plan()
    small = _Traces(_trace(StageKind.BLOCK, 10**8), _trace(StageKind.EMBEDDING, 0), _trace(StageKind.OUTPUT, 0))
    big = _Traces(_trace(StageKind.BLOCK, 2 * 10**8), _trace(StageKind.EMBEDDING, 0), _trace(StageKind.OUTPUT, 0))
    a, b = stage_memory(GPT, p, CLUSTER, small, STACK)[3], stage_memory(GPT, p, CLUSTER, big, STACK)[3]
    assert b.activations_bytes == 2 * a.activations_bytes == 2 * 10**8 * 8 * (12 - 3)


def test_corrupt_constants_raise_file_format_error():
    with pytest.raises(FileFormatError):
        load_memory_constants("bytes_per_param: 3", "bad.yaml")


AGREEMENT_PLANS = [
    ("gpt3-175b", dict(tp=8, pp=8, dp=1, global_batch_size=64, sequence_parallel=True, recompute="selective")),
    ("gpt3-175b", dict(tp=4, pp=8, dp=2, global_batch_size=64, virtual_stages=3, recompute="full")),
    ("llama2-70b", dict(tp=8, pp=4, dp=2, global_batch_size=64, micro_batch_size=2)),
    ("llama3-8b", dict(tp=2, pp=2, dp=4, global_batch_size=64, schedule="gpipe", sequence_parallel=True)),
]


@pytest.mark.parametrize("name,kw", AGREEMENT_PLANS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(AGREEMENT_PLANS)])
def test_closed_form_agrees_with_traced_activations(name, kw):
    from echo_plan.trace.tracer import trace_model

    model, p = load_model(name), PlanSpec.build(kw)
    for stack in (STACK, UNFUSED):
        traced = stage_memory(model, p, CLUSTER, trace_model(model, p, stack=stack), stack)
        closed = estimate(model, p, stack=stack)
        for t, e in zip(traced, closed):
            assert e.activations_bytes == pytest.approx(t.activations_bytes, rel=0.15)
            assert e.total_bytes == pytest.approx(t.total_bytes, rel=0.15)
            assert (e.weights_bytes, e.optimizer_bytes) == (t.weights_bytes, t.optimizer_bytes)


@pytest.mark.parametrize("p", PLANS)
def test_expandable_segments_never_need_more_memory_and_only_buffers_differ(p):
    default = STACK.model_copy(update={"cuda_allocator": CudaAllocator.DEFAULT})
    expandable = STACK.model_copy(update={"cuda_allocator": CudaAllocator.EXPANDABLE_SEGMENTS})
    a, b = estimate(LLAMA, p, stack=default), estimate(LLAMA, p, stack=expandable)
    for sa, sb in zip(a, b):
        assert sb.buffers_bytes < sa.buffers_bytes
        assert (sa.weights_bytes, sa.gradients_bytes, sa.optimizer_bytes, sa.activations_bytes) == \
            (sb.weights_bytes, sb.gradients_bytes, sb.optimizer_bytes, sb.activations_bytes)
    assert max(s.total_bytes for s in b) < max(s.total_bytes for s in a)


def test_fragmentation_fractions_are_the_measured_ones():
    """memory.yaml's fractions are the larger of the two probe shapes measured per allocator setting
    (data/measured/h100_sxm5/memory_probe.json): changing one without the other fails here."""
    import json
    from pathlib import Path

    import echo_plan

    probe = json.loads((Path(echo_plan.__file__).parent / "data" / "measured" / "h100_sxm5" /
                        "memory_probe.json").read_text())["fragmentation"]
    got = load_memory_constants().fragmentation_fraction
    for setting in ("default", "expandable_segments"):
        measured = [v["fragmentation_fraction"] for k, v in probe.items()
                    if ("expandable_segments" in k) == (setting == "expandable_segments")]
        assert len(measured) == 2
        assert got[setting] == pytest.approx(max(measured), abs=0.0005)


def test_the_stacks_say_which_allocator_their_launch_sets():
    assert load_stack("megatron-core").cuda_allocator.value == "expandable_segments"
    assert load_stack("torchtitan").cuda_allocator.value == "expandable_segments"
    assert load_stack("megatron-lm-2021").cuda_allocator.value == "default"  # before expandable segments existed
    assert load_stack("nemo-24.03").cuda_allocator.value == "default"


def test_a_fragmentation_table_missing_a_setting_is_a_file_format_error():
    from importlib import resources

    text = (resources.files("echo_plan") / "data" / "memory.yaml").read_text()
    broken = text.replace("    expandable_segments: 0.032\n", "")
    assert broken != text
    with pytest.raises(FileFormatError, match="expandable_segments"):
        load_memory_constants(broken, "mine.yaml")


def test_the_allocator_note_says_what_is_counted_and_what_the_launch_must_set():
    from echo_plan.cost.memory_notes import allocator_note

    note = allocator_note(load_stack("megatron-core"))
    assert "3.2%" in note and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in note and "13.8%" in note
    plain = allocator_note(load_stack("megatron-lm-2021"))
    assert "13.8%" in plain and "default" in plain and "PYTORCH_CUDA_ALLOC_CONF" not in plain


@pytest.mark.parametrize("p", PLANS)
def test_the_allocator_holds_all_but_the_context_and_nccl(p):
    consts = load_memory_constants()
    for m in estimate(LLAMA, p):
        outside = m.total_bytes - m.reserved_bytes
        assert outside == m.outside_allocator_bytes
        assert consts.cuda_context_bytes <= outside < m.buffers_bytes
        assert (outside - consts.cuda_context_bytes) % consts.nccl_per_communicator_bytes == 0


@pytest.mark.parametrize("p", PLANS)
def test_the_te_loss_never_needs_more_memory_and_saves_the_fp32_logits_on_the_last_stage(p):
    """Transformer Engine's cross entropy keeps the bf16 logits (their gradient) instead of an fp32 softmax and
    makes no fp32 copy: the last stage needs 2 + 6 bytes per logit less, the other stages the same."""
    te = load_stack("megatron-core", {"cross_entropy": "te"})
    a, b = estimate(LLAMA, p, stack=STACK), estimate(LLAMA, p, stack=te)
    logits = LLAMA.seq_length * p.micro_batch_size * LLAMA.vocab_size / p.tp
    for sa, sb in zip(a, b):
        assert sb.total_bytes <= sa.total_bytes
        if sa.stage == p.pp - 1:
            frag = load_memory_constants().fragmentation_fraction[STACK.cuda_allocator.value]
            fewer = sa.activations_bytes - sb.activations_bytes  # the saved fp32 softmax against bf16 logits
            assert fewer > 0
            assert sa.buffers_bytes - sb.buffers_bytes - frag * fewer == pytest.approx(6 * logits, rel=0.01)
        else:
            assert sa.total_bytes == sb.total_bytes


def test_the_logits_transient_is_per_loss_kernel_or_one_number():
    from importlib import resources

    text = (resources.files("echo_plan") / "data" / "memory.yaml").read_text()
    line = "  logits_transient_bytes_per_element: {unfused: 6, te: 0, torch: 8, torch_compiled: 2}\n"
    assert line in text
    kernels = {"unfused": 6.0, "te": 0.0, "torch": 8.0, "torch_compiled": 2.0}
    assert dict(load_memory_constants().logits_transient_bytes_per_element) == kernels
    one = load_memory_constants(text.replace(line, "  logits_transient_bytes_per_element: 5\n"), "mine.yaml")
    assert dict(one.logits_transient_bytes_per_element) == dict.fromkeys(kernels, 5.0)
    with pytest.raises(FileFormatError, match="te"):
        load_memory_constants(text.replace(line, "  logits_transient_bytes_per_element: {unfused: 6}\n"), "mine.yaml")
    with pytest.raises(FileFormatError, match="fused"):
        load_memory_constants(text.replace(line, line.replace("}", ", x: 1}")), "mine.yaml")
    with pytest.raises(FileFormatError, match="loss_parallel"):
        load_memory_constants(text.replace("loss_parallel_transient_bytes_per_element: 12",
                                           "loss_parallel_transient_bytes_per_element: -1"), "mine.yaml")


def test_what_each_loss_kernel_holds_per_logit_is_ordered():
    """The compiled and Transformer Engine losses hold the least, PyTorch's eager loss more than Megatron-LM's
    unfused one, and its loss_parallel under TP more still; an eager stack cannot run a compiled loss."""
    from echo_plan.cost.activation_memory import loss_saved_bytes_per_logit
    from echo_plan.specs.software import CrossEntropy as CE

    c = load_memory_constants()

    def held(kernel, tp=1):
        p = PlanSpec.build(dict(tp=tp, pp=1, dp=8 // tp, global_batch_size=8))
        return loss_saved_bytes_per_logit(p, kernel) + c.loss_transient_bytes_per_logit(p, kernel)

    assert held(CE.TE) < held(CE.TORCH_COMPILED) < held(CE.UNFUSED) < held(CE.TORCH) < held(CE.TORCH, tp=8)
    assert held(CE.UNFUSED, tp=8) == held(CE.UNFUSED)
    eager = load_stack("torchtitan", {"torch_compile": False})
    assert load_stack("torchtitan").cross_entropy is CE.TORCH_COMPILED and eager.cross_entropy is CE.TORCH


def test_simulate_says_what_the_loss_holds_and_names_the_fused_one():
    from echo_plan.cost.memory_notes import loss_note

    gpt_oss, p = load_model("gpt-oss-120b"), PlanSpec.build(dict(tp=1, pp=4, dp=16, ep=8, global_batch_size=1280))
    unfused = loss_note(gpt_oss, p, STACK)
    assert "unfused" in unfused and "cross_entropy: te" in unfused and "7.7 GiB" in unfused and "1.5 GiB" in unfused
    fused = loss_note(gpt_oss, p, load_stack("megatron-core", {"cross_entropy": "te"}))
    assert fused.startswith("loss: Transformer Engine's") and "1.5 GiB" in fused
    small = load_model("gpt3-175b").replace(vocab_size=256)  # a loss too small to matter says nothing
    assert loss_note(small, plan(), STACK) == ""


def test_the_loss_note_names_pytorchs_eager_and_compiled_losses():
    from echo_plan.cost.memory_notes import loss_note

    llama = load_model("llama3-8b")
    one = PlanSpec.build(dict(tp=1, pp=1, dp=8, micro_batch_size=2, global_batch_size=16))
    eager = loss_note(llama, one, load_stack("torchtitan", {"torch_compile": False}))
    compiled = loss_note(llama, one, load_stack("torchtitan"))
    assert eager.startswith("loss: PyTorch's cross entropy on an fp32 copy") and "cross_entropy torch)" in eager
    assert compiled.startswith("loss: the compiled cross entropy") and "cross_entropy torch_compiled" in compiled
    gib = lambda note: float(note.split(" GiB per micro-batch")[0].split()[-1])  # noqa: E731
    assert gib(eager) > gib(compiled)
    tp8 = PlanSpec.build(dict(tp=8, pp=1, dp=1, micro_batch_size=16, global_batch_size=16))
    assert "loss_parallel" in loss_note(llama, tp8, load_stack("torchtitan", {"torch_compile": False}))
