"""The plan's layout is derived once from (model, plan, stack) and agrees with itself and the plan."""

from __future__ import annotations

import pytest

from echo_plan.layout.plan_layout import PlanLayout, step_schedule
from echo_plan.specs import PlanSpec, load_model, load_stack
from echo_plan.specs.plan import Schedule
from echo_plan.trace.records import GroupKind


@pytest.mark.parametrize("model_name,fields", [
    ("llama2-7b", dict(tp=2, pp=4, dp=2, virtual_stages=2, schedule="interleaved")),
    ("llama2-7b", dict(tp=1, pp=4, dp=4, schedule="zb-v")),
    ("mixtral-8x7b", dict(tp=2, pp=2, dp=4, ep=4, distributed_optimizer=True)),
    ("gpt-oss-120b", dict(tp=1, pp=4, dp=4, ep=4, layer_split=(8, 10, 10, 8))),
])
def test_the_layout_accounts_for_every_layer_and_rank(model_name, fields):
    model = load_model(model_name)
    plan = PlanSpec.build(dict(micro_batch_size=1, global_batch_size=64, **fields), "plan")
    lay = PlanLayout.of(model, plan, load_stack())
    assert sum(lay.layers_per_virtual_stage) == model.num_layers
    assert lay.first_layer[0] == 0 and all(
        b - a == n for a, b, n in zip(lay.first_layer, lay.first_layer[1:], lay.layers_per_virtual_stage))
    for kinds, n in zip(lay.kinds_per_virtual_stage, lay.layers_per_virtual_stage):
        assert sum(c for _, c in kinds) == n
    assert len(lay.kinds_per_rank) == plan.pp
    assert sum(sum(k.values()) for k in lay.kinds_per_rank) == model.num_layers
    assert (lay.dp_group.kind, lay.dp_group.size, lay.dp_group.stride) == (GroupKind.DP, plan.grad_dp, plan.tp)
    assert (lay.edp_group.size, lay.edp_group.stride) == (plan.edp, plan.expert_tp * plan.ep)
    assert lay.sharding.sharded == plan.distributed_optimizer


def test_interleaved_with_one_chunk_runs_1f1b():
    plan = PlanSpec.build(dict(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=16), "plan")
    assert step_schedule(plan) is Schedule.ONE_F_ONE_B
    # a plan made without the checks (a stored result's) may say interleaved with one chunk: that is 1F1B
    assert step_schedule(plan.model_copy(update={"schedule": Schedule.INTERLEAVED})) is Schedule.ONE_F_ONE_B
    two = PlanSpec.build(dict(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=16, virtual_stages=2,
                              schedule="interleaved"), "plan")
    assert step_schedule(two) is Schedule.INTERLEAVED


def test_the_stage_costs_are_the_same_with_the_layout_given_or_derived(tmp_path):
    """simulate derives the layout once and hands it down; the stage costs must not depend on who did."""
    from echo_plan.replay.step_costs import step_costs
    from echo_plan.simulate import SimulationMemo
    from echo_plan.specs import load_cluster
    from echo_plan.trace.cache import TraceCache

    model, cluster, stack = load_model("llama2-7b"), load_cluster("h800", gpus=16), load_stack()
    plan = PlanSpec.build(dict(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=32, virtual_stages=2,
                               schedule="interleaved", distributed_optimizer=True), "plan")
    memo = SimulationMemo()
    key = cluster.model_dump_json()
    compute, comm = memo.default_compute(cluster, key), memo.default_comm(cluster, key)
    traces = memo.traces(model, plan, TraceCache(tmp_path), stack)
    timing = memo.timings(traces, compute, comm, cluster, key, plan, memo.default_interference())
    ct = memo.comm_times(comm, key, cluster)
    derived = step_costs(model, cluster, plan, timing, compute, ct, stack=stack)
    given = step_costs(model, cluster, plan, timing, compute, ct, stack=stack,
                       layout=PlanLayout.of(model, plan, stack))
    assert derived == given
