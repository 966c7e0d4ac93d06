"""The search's memory estimate for low-precision and zero-bubble plans, made from traced reference layers: it
agrees with the simulator's memory, so a plan that fits is not pruned before it is simulated (issue 31: an
overestimate hides the best plan; issue 32: DeepSeek's recipe was pruned at 97 GiB estimated, 70.6 simulated),
and one that does not is not simulated."""

from __future__ import annotations

import pytest

from echo_plan.cost.activation_memory import layer_activation_bytes
from echo_plan.cost.memory import estimate_memory
from echo_plan.search.activation_scale import RETAINED, TracedActivationScale
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.plan import Recompute
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.tracer import trace_model



def _plan(**kw):
    base = {"tp": 2, "pp": 2, "dp": 4, "micro_batch_size": 1, "global_batch_size": 16, "dtype": "fp8",
            "recompute": "selective", "sequence_parallel": True, "distributed_optimizer": True}
    return PlanSpec.build({**base, **kw})


@pytest.mark.parametrize("model_name,stack_name,extra", [
    ("small-dense", "megatron-core", {}),
    ("small-dense", "megatron-core", {"recompute": "none", "tp": 1, "sequence_parallel": False, "dp": 8}),
    ("small-dense", "megatron-core", {"schedule": "zb-h1"}),
    ("small-dense", "megatron-core", {"schedule": "zb-h1", "dtype": "bf16", "recompute": "none"}),
    ("small-moe", "megatron-core", {"ep": 4}),
])
def test_the_estimate_of_a_low_precision_plan_is_the_simulated_memory(model_name, stack_name, extra, small_moe,
                                                                       small_dense, tmp_path):
    model = small_moe if model_name == "small-moe" else small_dense
    cluster, stack = load_cluster("dgx-h100").resized(gpus=16), load_stack(stack_name)
    plan = _plan(**extra)
    cache = TraceCache(tmp_path)
    scale = TracedActivationScale(model, cluster, stack, cache)
    est = estimate_memory(model, plan, cluster, stack, activation_scale=scale(plan))
    sim = simulate(model, cluster, plan, stack=stack, cache=cache, memo=SimulationMemo()).memory
    closed = estimate_memory(model, plan, cluster, stack)
    for e, s, c in zip(est, sim, closed):
        assert e.activations_bytes == pytest.approx(s.activations_bytes, rel=0.03)
        if plan.dtype.low_precision:
            assert c.activations_bytes > s.activations_bytes  # the closed form alone keeps every tensor in bf16


def test_bf16_plans_need_no_trace_without_a_split_backward(small_dense, tmp_path):
    model, cluster = small_dense, load_cluster("dgx-h100").resized(gpus=16)
    scale = TracedActivationScale(model, cluster, load_stack("megatron-core"), TraceCache(tmp_path))
    assert scale(_plan(dtype="bf16")) is None
    assert not list(tmp_path.iterdir())  # nothing traced
    assert scale(_plan(dtype="bf16", schedule="zb-h1")) is not None  # what W keeps is measured in any precision


def test_the_ratios_are_the_traced_bytes_over_the_closed_form(small_dense, tmp_path):
    model, cluster, stack = small_dense, load_cluster("dgx-h100").resized(gpus=16), load_stack()
    plan = _plan(tp=1, sequence_parallel=False, dp=8)
    cache = TraceCache(tmp_path)
    ratio = TracedActivationScale(model, cluster, stack, cache)(plan)
    ref = PlanSpec.build({"tp": 1, "micro_batch_size": 1, "global_batch_size": 1, "dtype": "fp8",
                          "recompute": "selective"})
    run = stack.as_run(ref, cluster.gpu.sm_arch)
    kind, trace = trace_model(model, ref, cache, run).blocks[0]
    for mode in Recompute:
        closed = layer_activation_bytes(model, ref, mode, run, kind)
        assert ratio(kind, mode) * closed == pytest.approx(trace.saved_bytes_by_mode[mode.value], rel=1e-9)
    assert 0.5 <= ratio(kind, Recompute.SELECTIVE) < 1.0  # FP8 copies of the linears' inputs: fewer bytes
    assert 0.0 < ratio(kind, RETAINED) <= 1.0


@pytest.mark.slow
def test_a_search_with_the_deepseek_stack_keeps_deepseeks_recipe(tmp_path):
    """The recipe (PP 16, EP 64, DualPipe, FP8, 2,048 H800) fits at 66.9 GiB in the simulator: the search's
    estimate must not prune it."""
    from echo_plan.search.config import SearchConfig, prune_for
    from echo_plan.search.space import load_space, default_space_path_for

    model, cluster, stack = load_model("deepseek-v3"), load_cluster("h800").resized(gpus=2048), load_stack("deepseek-v3")
    space = load_space(default_space_path_for(model, stack)).with_values(
        {"dtype": ("fp8",), "tp": (1,), "pp": (16,), "ep": (64,), "schedule": ("dualpipe",),
         "recompute": ("selective",), "micro_batch_size": (1,), "virtual_stages": (1,)})
    config = SearchConfig(model=model, cluster=cluster, global_batch_size=15360, space=space, stack=stack,
                          cache_dir=str(tmp_path))
    pruned = prune_for(config)
    assert len(pruned.valid) == 1, pruned.counts()
