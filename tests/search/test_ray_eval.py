"""Ray evaluation with the real simulator: the same answer as in-process, each layer traced once."""

from __future__ import annotations

import pytest

from echo_plan.search.evaluator import SimulatorFactory
from echo_plan.search.space import space_from_mapping
from echo_plan.search.study import SamplerKind, SearchConfig, run_search
from echo_plan.specs import load_cluster, load_model

SPACE = space_from_mapping({"knobs": {"tp": [1, 2, 4], "pp": [1, 2, 4], "micro_batch_size": [1, 2],
                                      "recompute": ["none", "selective"]}})


@pytest.mark.slow
def test_ray_workers_rank_like_in_process_and_share_the_trace_cache(tmp_path):
    model, cluster = load_model("llama2-7b"), load_cluster("h800", gpus=16)
    factory = SimulatorFactory(model, cluster, str(tmp_path / "traces"))

    def search(workers):
        config = SearchConfig(model=model, cluster=cluster, global_batch_size=64, space=SPACE,
                              sampler=SamplerKind.TPE, n_trials=12, workers=workers,
                              storage=f"sqlite:///{tmp_path / f'w{workers}.db'}")
        return run_search(config, factory)

    on_ray = search(2)  # cold cache: two workers may want the same new layer at once
    local = search(0)  # same cache, now warm
    assert [(r.plan, r.step_time_s) for r in on_ray.ranked] == [(r.plan, r.step_time_s) for r in local.ranked]
    assert on_ray.traces_made > 0
    assert local.traces_made == 0
    # every distinct layer (one cache file each) was traced exactly once across the workers
    assert on_ray.traces_made == len(list((tmp_path / "traces").glob("*.json")))


@pytest.mark.slow
def test_a_crashed_worker_loses_no_finished_trial(tmp_path):
    import os

    import ray

    from . import toy
    from echo_plan.search.results import TrialState

    class Dying(toy.ToyEvaluator):
        def evaluate(self, plan):
            if plan.tp == 8 and plan.pp == 2:
                os._exit(1)  # the worker process dies mid-plan
            return super().evaluate(plan)

    class DyingFactory(toy.ToyFactory):
        def build(self):
            return Dying(self.model, self.cluster)

    ray.cloudpickle.register_pickle_by_value(toy)  # workers cannot import the tests package
    model, cluster = load_model("gpt-13b"), load_cluster("h800", gpus=64)
    space = space_from_mapping({"knobs": {"tp": [2, 4, 8], "pp": [1, 2, 4], "micro_batch_size": [1, 2]}})
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    config = SearchConfig(model=model, cluster=cluster, global_batch_size=512, space=space, storage=url,
                          sampler=SamplerKind.GRID, workers=2)
    outcome = run_search(config, DyingFactory(model, cluster), memory=toy.toy_memory)
    failed = [t for t in outcome.trials if t.state is TrialState.FAILED]
    assert failed and all(t.plan["tp"] == 8 and t.plan["pp"] == 2 and "worker failed" in t.detail for t in failed)
    done = [t for t in outcome.trials if t.state is TrialState.COMPLETE]
    assert len(done) + len(failed) == len(outcome.trials)
    assert done  # plans after the crash still ran on a new worker
    # and every finished trial is in storage
    again = run_search(config, toy.ToyFactory(model, cluster), memory=toy.toy_memory)
    assert len(again.trials) == len(outcome.trials)


@pytest.mark.slow
def test_compare_keeps_one_ray_for_all_sizes(tmp_path, monkeypatch):
    import ray

    from . import toy
    from echo_plan.search.compare import run_compare

    ray.cloudpickle.register_pickle_by_value(toy)
    model = load_model("gpt-13b")
    space = space_from_mapping({"knobs": {"tp": [2, 4, 8], "pp": [1, 2, 4], "micro_batch_size": [1, 2]}})
    starts = []
    real_init = ray.init
    monkeypatch.setattr(ray, "init", lambda *a, **k: starts.append(k) or real_init(*a, **k))

    def compare(workers):
        base = SearchConfig(model=model, cluster=load_cluster("h800", gpus=32), global_batch_size=512, space=space,
                            sampler=SamplerKind.GRID, workers=workers, storage="memory")
        out = run_compare(base, [32, 64, 128], lambda c: toy.ToyFactory(model, c))
        return [(r.num_gpus, r.outcome.best.plan, r.outcome.best.step_time_s) for r in out.rows]

    on_ray = compare(2)
    assert len(starts) == 1  # one Ray for the three sizes (each size's pool reused it)
    assert not ray.is_initialized()  # and it is down afterwards
    assert on_ray == compare(0)
