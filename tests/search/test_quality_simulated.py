"""Quality with the real simulator: within the default budget, TPE finds the exhaustive optimum or a
plan within 1% of its step time, on two model/cluster pairs.

Each pair's space is enumerated once (grid, every valid plan simulated); the TPE search then reads
those results instead of simulating again (``simulate`` is deterministic, so a lookup is exactly
what a fresh simulation would give), which keeps the test to seconds.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from echo_plan.search.evaluator import SimulatorFactory
from echo_plan.search.space import space_from_mapping
from echo_plan.search.study import DEFAULT_TRIALS, SamplerKind, SearchConfig, prune_for, run_search
from echo_plan.specs import load_cluster, load_model

# the default space with sequence parallelism and the distributed optimizer fixed on, to keep the
# exhaustive reference quick; still more than twice the default budget of valid plans
SPACE = space_from_mapping({
    "knobs": {"tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8], "micro_batch_size": [1, 2, 4],
              "virtual_stages": [1, 2], "recompute": ["none", "selective", "full"]},
    "fixed": {"sequence_parallel": True, "distributed_optimizer": True},
})


class Recording:
    def __init__(self, inner, results):
        self.inner, self.results = inner, results

    def evaluate(self, plan):
        self.results[plan.model_dump_json()] = r = self.inner.evaluate(plan)
        return r

    traces_made = property(lambda self: self.inner.traces_made)
    cache_hits = property(lambda self: self.inner.cache_hits)


class Lookup:
    def __init__(self, results):
        self.results, self.calls = results, 0

    def evaluate(self, plan):
        self.calls += 1
        return self.results[plan.model_dump_json()]

    traces_made = cache_hits = 0


class Fixed:
    def __init__(self, evaluator):
        self.evaluator = evaluator

    def build(self):
        return self.evaluator


@pytest.mark.slow
@pytest.mark.parametrize("model, gpus, gbs", [("gpt-13b", 64, 128), ("llama2-7b", 32, 64)])
def test_default_budget_reaches_the_exhaustive_optimum_within_1pct(tmp_path, model, gpus, gbs):
    m, c = load_model(model), load_cluster("h800", gpus=gpus)
    config = SearchConfig(model=m, cluster=c, global_batch_size=gbs, space=SPACE, storage="memory")
    pruned = prune_for(config)
    assert len(pruned.valid) > 2 * DEFAULT_TRIALS
    results: dict = {}
    inner = SimulatorFactory(m, c, str(tmp_path / "traces")).build()
    grid = run_search(replace(config, sampler=SamplerKind.GRID), Fixed(Recording(inner, results)), pruned=pruned)
    assert len(results) == len(pruned.valid)
    optimum = grid.best.step_time_s
    lookup = Lookup(results)
    tpe = run_search(replace(config, sampler=SamplerKind.TPE), Fixed(lookup), pruned=pruned)
    assert lookup.calls == DEFAULT_TRIALS
    assert tpe.best.step_time_s <= optimum * 1.01
