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
