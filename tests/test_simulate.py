"""simulate(): the properties a predicted step must keep, and what practitioners know."""

from __future__ import annotations

import pytest

from echo_plan.errors import SpecError
from echo_plan.replay.interference import InterferenceModel
from echo_plan.replay.metrics import megatron_gpt_flops, model_flops_per_iteration, hardware_flops_per_iteration
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model
from echo_plan.specs.plan import Recompute


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    return TraceCache(tmp_path_factory.mktemp("traces")), SimulationMemo()


def run(env, model="gpt-13b", gpus=64, interference=None, **plan):
    cache, memo = env
    cluster = load_cluster("h800", gpus=gpus)
    fields = dict(tp=8, pp=2, micro_batch_size=1)
    fields.update(plan)
    fields.setdefault("dp", gpus // (fields["tp"] * fields["pp"]))
    fields.setdefault("global_batch_size", 16 * fields["dp"])
    return simulate(load_model(model), cluster, PlanSpec(**fields), cache=cache, memo=memo,
                    interference=interference)


PLANS = [
    {},
    {"virtual_stages": 2, "schedule": "interleaved"},
    {"schedule": "gpipe", "recompute": "full"},
    {"distributed_optimizer": True, "sequence_parallel": True, "recompute": "selective"},
    {"distributed_optimizer": True, "overlap_grad_reduce": False, "overlap_param_gather": False},
    {"pp": 4, "layer_split": (11, 9, 10, 10)},
    {"schedule": "zb-h1"},
    {"schedule": "zb-v"},
    {"schedule": "dualpipe", "sequence_parallel": True},
]


@pytest.mark.parametrize("plan", PLANS)
def test_breakdown_adds_up_to_the_step_time(env, plan):
    r = run(env, **plan)
    assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
    assert all(v >= -1e-12 for v in r.breakdown.as_json().values())
    assert r.breakdown.compute_s > 0 and r.step_time_s > 0


def test_throughput_figures_are_consistent(env):
    r = run(env, recompute="full")
    model = load_model("gpt-13b")
    gbs = r.plan["global_batch_size"]
    assert r.tokens_per_s == pytest.approx(gbs * model.seq_length / r.step_time_s)
    assert r.mfu == pytest.approx(r.model_tflops_per_gpu / 989.4, rel=1e-6)  # H800 bf16 dense peak
    assert r.hardware_tflops_per_gpu > r.model_tflops_per_gpu
    assert 0 < r.mfu < 1


def test_gpt_flops_equal_megatron_formula():
    m = load_model("gpt3-175b")
    for full in (False, True):
        ours = (hardware_flops_per_iteration(m, 1536, Recompute.FULL) if full
                else model_flops_per_iteration(m, 1536))
        assert ours == pytest.approx(megatron_gpt_flops(1536, m.seq_length, m.num_layers, m.hidden_size,
                                                        m.vocab_size, full), rel=1e-12)


def test_llama_flops_count_gqa_and_swiglu():
    m = load_model("llama2-70b")  # 8 kv heads, SwiGLU: fewer QKV weights, three FFN matrices
    h, f, kv = m.hidden_size, m.ffn_size, m.kv_heads * m.head_dim
    per_token = 3 * (2 * m.num_layers * (h * (h + 2 * kv) + h * h + 3 * h * f)
                     + 4 * m.num_layers * m.seq_length * h + 2 * m.vocab_size * h)
    assert model_flops_per_iteration(m, 8) == pytest.approx(per_token * 8 * m.seq_length)


def test_sp_with_selective_recompute_beats_full_recompute_at_tp8(env):
    sel = run(env, sequence_parallel=True, recompute="selective")
    full = run(env, recompute="full")
    assert sel.step_time_s < full.step_time_s


def test_interleaving_shrinks_the_bubble_with_few_microbatches(env):
    plain = run(env, pp=4, global_batch_size=8)  # dp 2, 4 micro-batches = pp
    inter = run(env, pp=4, global_batch_size=8, virtual_stages=2, schedule="interleaved")
    assert inter.breakdown.bubble_s < plain.breakdown.bubble_s


def test_larger_dp_on_the_same_batch_raises_the_bubble_fraction(env):
    small = run(env, gpus=64, pp=4, global_batch_size=64)  # dp 2 -> 32 micro-batches
    large = run(env, gpus=256, pp=4, global_batch_size=64)  # dp 8 -> 8 micro-batches
    assert (large.breakdown.bubble_s / large.step_time_s) > (small.breakdown.bubble_s / small.step_time_s)


def test_more_microbatches_never_raise_the_1f1b_bubble_fraction(env):
    fractions = []
    for m in (1, 2, 4, 8, 16, 32):
        r = run(env, gpus=32, pp=4, global_batch_size=m)
        fractions.append(r.breakdown.bubble_s / r.step_time_s)
    assert all(b <= a + 1e-9 for a, b in zip(fractions, fractions[1:]))


@pytest.mark.parametrize("plan", PLANS[:4])
def test_removing_interference_never_slows_a_step(env, plan):
    with_ = run(env, **plan)
    without = run(env, interference=InterferenceModel.none(), **plan)
    assert without.step_time_s <= with_.step_time_s + 1e-12


def test_a_plan_that_does_not_fit_is_flagged(env):
    r = run(env, model="gpt3-175b", gpus=8, tp=8, pp=1, dp=1, global_batch_size=1)
    assert not r.fits
    stage, gib = r.overflow
    assert stage == 0 and gib > 100  # 175B / 8 x 16+ bytes per parameter is far beyond 80 GiB
    assert r.as_json()["fits"] is False and any("does not fit" in n for n in r.notes)


def test_invalid_plan_raises_spec_error(env):
    cache, memo = env
    with pytest.raises(SpecError):
        simulate(load_model("gpt-13b"), load_cluster("h800", gpus=64), PlanSpec(tp=8, pp=2, dp=2, global_batch_size=2), cache=cache)
    with pytest.raises(SpecError):
        run(env, pp=3)  # 3 does not divide 40 layers


def test_a_slow_stage_slows_the_step(env):
    cache, memo = env
    cluster, model = load_cluster("h800", gpus=64), load_model("gpt-13b")
    plan = PlanSpec(tp=8, pp=2, dp=4, global_batch_size=64)
    base = simulate(model, cluster, plan, cache=cache, memo=memo)
    slow = simulate(model, cluster, plan, cache=cache, memo=memo, work_scale=(1.0, 1.3))
    assert slow.step_time_s > base.step_time_s * 1.1


def test_memo_reuse_gives_the_same_answer(env):
    cache, memo = env
    first = run(env, global_batch_size=32)
    hits = memo.layer_hits
    again = run(env, global_batch_size=32)
    assert again.step_time_s == first.step_time_s and memo.layer_hits > hits


def test_timeline_names_say_microbatch_and_layers(env):
    cache, memo = env
    from echo_plan.replay.timeline import chrome_trace

    r = simulate(load_model("gpt-13b"), load_cluster("h800", gpus=64),
                 PlanSpec(tp=8, pp=2, dp=4, global_batch_size=16, distributed_optimizer=True),
                 cache=cache, memo=memo, timeline=True)
    names = {e.name for e in r.timeline}
    assert "F mb3 chunk0 layers 0-19 +embedding" in names
    assert "B mb2 chunk0 layers 20-39 +output" in names
    assert "send act mb3 -> stage 1" in names and "optimizer" in names
    assert any(n.startswith("DP reduce-scatter") for n in names)
    trace = chrome_trace(r)
    procs = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert [p["args"]["name"] for p in procs] == ["stage 0 (rank 0)", "stage 1 (rank 32)"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(r.timeline) and all(e["dur"] >= 0 for e in spans)
    end = max(e["ts"] + e["dur"] for e in spans)
    assert end == pytest.approx(r.step_time_s * 1e6)


def test_uneven_interleaving_with_equal_splits_equals_interleaving(env):
    # gpt-13b: 40 layers; pp 2 x vpp 2 = 4 virtual stages of 10 layers
    even = run(env, virtual_stages=2, schedule="interleaved")
    per_virtual = run(env, virtual_stages=2, schedule="interleaved", layer_split=(10, 10, 10, 10))
    assert per_virtual.step_time_s == pytest.approx(even.step_time_s, rel=1e-12)
    uneven = run(env, virtual_stages=2, schedule="interleaved", layer_split=(9, 11, 11, 9))
    assert uneven.breakdown.total_s == pytest.approx(uneven.step_time_s, rel=1e-9)
    assert uneven.step_time_s != even.step_time_s


def test_layer_split_per_virtual_stage_rules(env):
    from echo_plan.errors import SpecError

    with pytest.raises(SpecError, match=r"one entry per pipeline stage \(2\) or one per virtual stage \(4\)"):
        run(env, virtual_stages=2, schedule="interleaved", layer_split=(20, 10, 10))
    with pytest.raises(SpecError, match="add up to num_layers 40"):
        run(env, virtual_stages=2, schedule="interleaved", layer_split=(10, 10, 10, 11))


def test_flash_attention_2_slows_long_sequences_more_and_never_speeds_a_step(env):
    """The stack's attention library changes only attention kernels: slower on Hopper, more so where
    attention dominates (long sequence), and the same traced work (the same trace is reused)."""
    from echo_plan.specs import load_stack

    cache, memo = env
    cudnn, fa2 = load_stack(), load_stack("megatron-core", {"attention_library": "flash-attn-2"})
    slowdown = []
    for seq, cp in ((2048, 1), (32768, 2)):
        model = load_model("llama2-7b").replace(seq_length=seq)
        cluster = load_cluster("h800", gpus=16)
        plan = PlanSpec(tp=2, pp=1, cp=cp, dp=8 // cp, micro_batch_size=1, global_batch_size=16,
                        sequence_parallel=True, distributed_optimizer=True)
        a, b = (simulate(model, cluster, plan, stack=s, cache=cache, memo=memo) for s in (cudnn, fa2))
        assert b.step_time_s > a.step_time_s
        assert b.memory == a.memory
        slowdown.append(b.step_time_s / a.step_time_s)
    assert slowdown[1] > slowdown[0]


def test_a_yarn_rope_that_megatron_core_runs_unfused_is_named_and_never_speeds_the_step(env):
    """GPT-OSS-like RoPE factor on the megatron-core stack: the unfused RoPE is said and costs time; a stack whose
    fused kernel takes the factor (or a model without one) says nothing."""
    from echo_plan.specs import ModelSpec, load_stack

    cache, memo = env
    base = load_model("llama3-8b").model_dump()
    yarn = ModelSpec(**{**base, "name": "llama3-8b-yarn", "rope_attention_factor": 1.3466})
    cluster, plan = load_cluster("h800", gpus=8), PlanSpec(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=16)
    core, scaling = load_stack("megatron-core"), load_stack("megatron-core").replace(fused_rope_scales=True)
    runs = {(m.name, s.fused_rope_scales): simulate(m, cluster, plan, stack=s, cache=cache, memo=memo)
            for m in (ModelSpec(**base), yarn) for s in (core, scaling)}
    said = {k: any("RoPE" in n and "unfused" in n for n in r.notes) for k, r in runs.items()}
    assert said == {("llama3-8b", False): False, ("llama3-8b", True): False,
                    ("llama3-8b-yarn", False): True, ("llama3-8b-yarn", True): False}
    assert runs[("llama3-8b-yarn", False)].step_time_s > runs[("llama3-8b-yarn", True)].step_time_s
    assert runs[("llama3-8b-yarn", True)].step_time_s == pytest.approx(runs[("llama3-8b", True)].step_time_s)
