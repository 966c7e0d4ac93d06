"""FSDP2's copy kernels (stack ``fsdp_copy_kernels``): each gathered unit's copy-out and each reduced unit's
copy-in run on the compute stream, as torch.distributed.fsdp's fully_shard runs them. They never shorten a step,
the breakdown still adds up to the step with them, and a runtime without them (FSDP1's flat parameters, DeepSpeed)
or a step without sharded parameters has none."""

from __future__ import annotations

import pytest

from echo_plan.replay.dp import fsdp_copy_op, fsdp_units
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.trace.records import CommGroup, GroupKind


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    return TraceCache(tmp_path_factory.mktemp("traces")), SimulationMemo()


def run(env, copies: bool, stack="torchtitan", gpus=8, **plan):
    cache, memo = env
    fields = dict(tp=1, pp=1, micro_batch_size=1, sharding="parameters", dp=gpus)
    fields.update(plan)
    fields.setdefault("global_batch_size", 4 * fields["dp"] * fields["micro_batch_size"])
    model = load_model("llama3-8b").replace(seq_length=2048)
    st = load_stack(stack).replace(fsdp_copy_kernels=copies)
    return simulate(model, load_cluster("dgx-h100", gpus=gpus), PlanSpec(**fields), cache=cache, memo=memo, stack=st)


def test_the_fsdp2_stacks_run_the_copies_and_the_others_do_not():
    assert load_stack("torchtitan").fsdp_copy_kernels and load_stack("olmo-core").fsdp_copy_kernels
    for name in ("llm-foundry", "deepspeed-zero3", "megatron-core"):
        assert not load_stack(name).fsdp_copy_kernels, name


@pytest.mark.parametrize("plan", [dict(), dict(micro_batch_size=2), dict(tp=2, dp=4, sequence_parallel=True),
                                  dict(shard_degree=4)])
def test_copies_never_shorten_the_step_and_the_breakdown_adds_up(env, plan):
    without, with_ = run(env, False, **plan), run(env, True, **plan)
    assert with_.step_time_s > without.step_time_s
    b = with_.breakdown
    assert b.total_s == pytest.approx(with_.step_time_s, rel=1e-9)
    assert b.compute_s > without.breakdown.compute_s  # the copies are compute-stream kernels
    assert any("FSDP2 (stack torchtitan) copies" in n for n in with_.notes)  # and simulate says so
    assert not any("FSDP2" in n for n in without.notes)


def test_a_shard_group_of_one_rank_copies_nothing(env):
    """dp 1: nothing is gathered or reduce-scattered, so FSDP2 has no copy-out or copy-in either."""
    assert run(env, True, gpus=1, dp=1).step_time_s == pytest.approx(run(env, False, gpus=1, dp=1).step_time_s)


def test_copy_times_follow_the_bytes_they_move():
    """Copy-out: the gathered bytes read and written again; copy-in: bf16 gradients read, the reduce dtype written."""
    cluster = load_cluster("dgx-h100")
    moved = []

    def copy_time(read, written):
        moved.append((read, written))
        return (read + written) / 3.0e12

    group = CommGroup(GroupKind.DP, size=8, stride=1)
    plan = PlanSpec(tp=1, pp=1, dp=8, micro_batch_size=1, global_batch_size=8, sharding="parameters")
    sharding = DataParallelSharding.of(plan, load_stack("torchtitan"))
    (b,) = fsdp_units([(1_000_000, 0, 1.0, 2.0, False, 2.0)], 4, lambda *a: 0.01, group, group, sharding,
                      copy_time)
    assert moved == [(2.0e6, 2.0e6), (2.0e6, 4.0e6)]
    assert b.copy_out_s == pytest.approx(4.0e6 / 3.0e12) and b.copy_in_s == pytest.approx(6.0e6 / 3.0e12)
    (none,) = fsdp_units([(1_000_000, 0, 1.0, 2.0, False, 2.0)], 4, lambda *a: 0.01, group, group, sharding)
    assert none.copy_out_s == none.copy_in_s == 0.0
    op = fsdp_copy_op(2.0e9, 4.0e9)  # a memory-bound op: more bytes never take less time
    from echo_plan.cost.compute import AnalyticalComputeModel

    compute = AnalyticalComputeModel()
    t1 = compute.op_time(op, cluster.gpu, plan.param_dtype)
    t2 = compute.op_time(fsdp_copy_op(4.0e9, 8.0e9), cluster.gpu, plan.param_dtype)
    assert 0 < t1 < t2
