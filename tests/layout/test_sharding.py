"""The data-parallel sharding is decided once (layout/sharding.py) and every stage reads it: memory,
the DP collectives and the optimizer step."""

from __future__ import annotations

import pytest

from echo_plan.cost.memory import estimate_memory
from echo_plan.layout.sharding import DataParallelSharding, ShardLevel
from echo_plan.replay.dp import chunk_buckets, optimizer_op
from echo_plan.replay.kinds import TaskKind
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.software import OptimizerSharding


def plan(dist_opt: bool, cp: int = 1) -> PlanSpec:
    return PlanSpec.build(dict(tp=2, pp=2, cp=cp, dp=4, micro_batch_size=1, global_batch_size=32,
                               distributed_optimizer=dist_opt, sequence_parallel=True), "plan")


def stack(sharding: OptimizerSharding):
    return load_stack("megatron-core").replace(optimizer_sharding=sharding)


def test_levels_and_degrees():
    none = DataParallelSharding.of(plan(False), stack(OptimizerSharding.STATES))
    assert (none.level, none.optimizer_shards(), none.gradient_shards(), none.sharded) == (ShardLevel.NONE, 1, 1, False)
    opt = DataParallelSharding.of(plan(True, cp=2), stack(OptimizerSharding.STATES))
    assert opt.level is ShardLevel.OPTIMIZER and opt.sharded
    assert opt.optimizer_shards() == 8 and opt.gradient_shards() == 1  # dp x cp ranks share the states
    grads = DataParallelSharding.of(plan(True), stack(OptimizerSharding.STATES_AND_GRADS))
    assert grads.level is ShardLevel.GRADIENTS and grads.gradient_shards() == grads.optimizer_shards() == 4
    assert DataParallelSharding.of(plan(True), None).level is ShardLevel.OPTIMIZER  # states, whatever the stack


def test_more_sharding_never_needs_more_memory():
    model, cluster = load_model("llama2-7b"), load_cluster("h800", gpus=16)
    peaks = []
    for p, s in ((plan(False), OptimizerSharding.STATES), (plan(True), OptimizerSharding.STATES),
                 (plan(True), OptimizerSharding.STATES_AND_GRADS)):
        mem = estimate_memory(model, p, cluster, stack(s))
        peaks.append((sum(m.optimizer_bytes for m in mem), sum(m.gradients_bytes for m in mem)))
    assert peaks[0][0] > peaks[1][0] == peaks[2][0]  # the optimizer states shard
    assert peaks[0][1] == peaks[1][1] > peaks[2][1]  # the gradients shard at the gradients level only


@pytest.mark.parametrize("dist_opt,kind", [(False, TaskKind.ALL_REDUCE), (True, TaskKind.REDUCE_SCATTER)])
def test_the_dp_exchange_and_the_optimizer_step_follow_the_sharding(dist_opt, kind):
    p = plan(dist_opt)
    sharding = DataParallelSharding.of(p, stack(OptimizerSharding.STATES))
    buckets = chunk_buckets(10**8, p, lambda k, n, g: 1e-9 * n, 2, True, sharding)
    assert buckets and all(b.reduce_kind is kind for b in buckets)
    assert all((b.gather_s > 0) == dist_opt for b in buckets)  # parameters gathered after a sharded step
    assert optimizer_op(10**8, sharding).flops == 12.0 * (10**8 // sharding.optimizer_shards())
