"""Every preset model simulates on every preset cluster (one small valid plan each)."""

from __future__ import annotations

import pytest

from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, cluster_names, load_cluster, load_model, model_names


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    return TraceCache(tmp_path_factory.mktemp("traces")), SimulationMemo()


def small_plan(model, cluster) -> PlanSpec:
    tp = 8 if cluster.gpus_per_node >= 8 and model.kv_heads % 8 == 0 else 1
    pp = 2 if model.num_layers % 2 == 0 and cluster.num_gpus >= 2 * tp else 1
    dp = cluster.num_gpus // (tp * pp)
    return PlanSpec(tp=tp, pp=pp, dp=dp, micro_batch_size=1, global_batch_size=2 * pp * dp,
                    sequence_parallel=tp > 1, recompute="selective", distributed_optimizer=True)


@pytest.mark.parametrize("cluster_name", cluster_names())
@pytest.mark.parametrize("model_name", model_names())
def test_every_preset_pair_simulates(env, model_name, cluster_name):
    cache, memo = env
    model, cluster = load_model(model_name), load_cluster(cluster_name)
    r = simulate(model, cluster, small_plan(model, cluster), cache=cache, memo=memo)
    assert r.step_time_s > 0 and 0 < r.mfu < 1
    assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
    assert len(r.memory) == r.plan["pp"]
