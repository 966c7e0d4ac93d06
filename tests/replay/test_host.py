"""The host that issues an MoE layer's kernels after the dispatcher's synchronisation (replay/host.py)."""

from __future__ import annotations

import pytest

from echo_plan.replay.host import HostIssue, host_exposed_s, host_issue_for, sync_position
from echo_plan.replay.layer import phase_tasks
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster, load_stack
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.specs.software import CudaGraphScope
from echo_plan.trace.records import Phase
from echo_plan.trace.tracer import StageKind, trace_stage
from echo_plan.cost.collectives import collective_model_for
from echo_plan.cost.kernel_db import compute_model_for

MOE = LayerKind(moe=True)


def tiny(**over) -> ModelSpec:
    return ModelSpec.build(dict(
        name="tiny-moe", num_layers=4, hidden_size=256, num_attention_heads=8, num_kv_heads=2, vocab_size=1000,
        seq_length=256, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=512,
        moe=dict(num_experts=8, top_k=2, expert_ffn_hidden_size=128), **over))


@pytest.fixture(scope="module")
def forward():
    """The forward ops and tasks of one traced MoE layer (EP 2) on an H800."""
    cluster = load_cluster("h800", gpus=16)
    trace = trace_stage(tiny(), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="bf16",
                        recompute="none", kind=MOE, layout=ExpertLayout(2, 1, 1.0), stack=load_stack("megatron-core"))
    ops = [op for op in trace.ops if op.phase is Phase.FORWARD]
    return ops, phase_tasks(ops, compute_model_for(cluster), collective_model_for(cluster), cluster, "bf16")


def test_the_synchronisation_is_the_first_token_permutation(forward):
    ops, tasks = forward
    at = sync_position(tasks)
    assert at is not None and "moe_permute" in tasks[at].name
    assert all("moe_permute" not in t.name for t in tasks[:at])
    assert sync_position([t for t in tasks if "moe_permute" not in t.name]) is None  # a dense layer: no gating


@pytest.mark.parametrize("graphs", [(), (CudaGraphScope.ATTN,), tuple(CudaGraphScope)])
def test_a_slower_host_never_speeds_a_layer_and_a_free_one_adds_nothing(forward, graphs):
    ops, tasks = forward
    times = [host_exposed_s(ops, tasks, HostIssue(us * 1e-6, graphs)) for us in (0.0, 1.0, 50.0, 200.0, 1000.0)]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0.0


def test_cuda_graphs_never_add_host_time(forward):
    ops, tasks = forward
    plain = host_exposed_s(ops, tasks, HostIssue(200e-6))
    attn = host_exposed_s(ops, tasks, HostIssue(200e-6, (CudaGraphScope.ATTN,)))
    both = host_exposed_s(ops, tasks, HostIssue(200e-6, tuple(CudaGraphScope)))
    assert both <= attn <= plain and both < plain


def test_a_host_far_slower_than_the_gpu_sets_the_pace(forward):
    """Every kernel waits for its issue: the cycle is at least the host's issue time of its kernels."""
    ops, tasks = forward
    op_s = 1.0  # a second per kernel: the GPU's work is negligible beside it
    exposed = host_exposed_s(ops, tasks, HostIssue(op_s))
    assert exposed == pytest.approx((len(tasks) - 1) * op_s, rel=1e-3)  # the permutation was issued before the wait


@pytest.mark.parametrize("over", [{"rope_attention_factor": 1.3466}, {"bias": True}])
def test_a_run_of_plain_pytorch_ops_costs_the_host_one_issue_not_one_per_op(over):
    """Megatron-Core's RoPE under a YaRN factor and its per-expert bias loop run as plain PyTorch ops, a few
    microseconds of host time each; the figure stands for a library kernel's call, so a run of such ops that one
    module issues back to back is one issue (and a slower host still never helps)."""
    cluster = load_cluster("h800", gpus=16)
    trace = trace_stage(tiny(**over), StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                        dtype="bf16", recompute="none", kind=MOE, layout=ExpertLayout(2, 1, 1.0),
                        stack=load_stack("megatron-core"))
    ops = [op for op in trace.ops if op.phase is Phase.FORWARD]
    tasks = phase_tasks(ops, compute_model_for(cluster), collective_model_for(cluster), cluster, "bf16")
    by_index = {op.index: op for op in ops}
    at = sync_position(tasks)
    cycle = tasks[at:] + tasks[:at]

    def plain(t):
        op = by_index[t.id]
        return op.module if op.name.startswith("aten.") and op.kind.value in ("elementwise", "copy") else None

    repeats = sum(1 for a, b in zip(cycle, cycle[1:]) if plain(b) is not None and plain(a) == plain(b))
    assert repeats >= 2  # the RoPE's ops or the bias loop's, not one fused kernel each
    assert host_exposed_s(ops, tasks, HostIssue(1.0)) == pytest.approx((len(tasks) - 1 - repeats) * 1.0, rel=1e-3)
    times = [host_exposed_s(ops, tasks, HostIssue(us * 1e-6)) for us in (0.0, 50.0, 500.0)]
    assert times == sorted(times)


def test_only_stacks_that_synchronise_and_calibrated_hosts_get_a_host_model():
    h800 = load_cluster("h800")
    assert host_issue_for(load_stack("megatron-core"), h800, True).op_s > 0
    assert host_issue_for(load_stack("megatron-core"), h800, False) is None  # dense: no dispatcher
    assert host_issue_for(load_stack("deepseek-v3"), h800, True) is None  # its own framework: the host ahead
    assert host_issue_for(load_stack("megatron-core"), load_cluster("gb200-nvl72"), True) is None  # no Grace figure
    graphs = load_stack("megatron-core", {"cuda_graph_scope": ["attn"]})
    assert host_issue_for(graphs, h800, True).graphs == (CudaGraphScope.ATTN,)


def test_the_host_slows_a_small_moe_step_and_the_breakdown_says_where(small_moe):
    plan = PlanSpec(dp=16, ep=8, global_batch_size=32)
    cluster = load_cluster("h800", gpus=16)
    memo = SimulationMemo()
    on = simulate(small_moe, cluster, plan, memo=memo)
    off = simulate(small_moe, cluster, plan, memo=memo, stack=load_stack("megatron-core", {"moe_host_sync": False}))
    assert on.step_time_s > off.step_time_s
    assert on.breakdown.host_exposed_s > 0.0 and off.breakdown.host_exposed_s == 0.0
    assert on.breakdown.total_s == pytest.approx(on.step_time_s, rel=1e-9)
    assert any("waits for the GPU before each token permutation" in n for n in on.notes)
    assert on.as_json()["breakdown"]["host_exposed"] > 0.0
