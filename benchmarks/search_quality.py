"""Benchmark: how close the sampler's best plan is to the exhaustive optimum, per trial budget.

For each model/cluster pair, every valid candidate of the default space is simulated once (grid);
then TPE searches are replayed for several budgets and seeds against those stored results (the
simulator is deterministic, so a lookup gives exactly what a fresh simulation would), and the gap
between each search's best step time and the exhaustive optimum is printed.

    .venv/bin/python benchmarks/search_quality.py [--pairs gpt3-175b:1024:1536,gpt-13b:64:512]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


class Recorded:
    """Evaluator over results simulated earlier; counts lookups like a simulator counts plans."""

    def __init__(self, results):
        self.results = results
        self.calls = 0

    def evaluate(self, plan):
        self.calls += 1
        return self.results[plan.model_dump_json()]

    traces_made = 0
    cache_hits = 0


class Recording:
    def __init__(self, inner, results):
        self.inner, self.results = inner, results

    def evaluate(self, plan):
        r = self.inner.evaluate(plan)
        self.results[plan.model_dump_json()] = r
        return r

    @property
    def traces_made(self):
        return self.inner.traces_made

    @property
    def cache_hits(self):
        return self.inner.cache_hits


class Fixed:
    def __init__(self, evaluator):
        self.evaluator = evaluator

    def build(self):
        return self.evaluator


def main() -> None:
    from echo_plan.search.evaluator import SimulatorFactory
    from echo_plan.search.space import load_space
    from echo_plan.search.study import SamplerKind, SearchConfig, prune_for, run_search
    from echo_plan.specs import load_cluster, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="gpt3-175b:1024:1536,gpt-13b:64:512", help="model:gpus:gbs,...")
    ap.add_argument("--budgets", default="25,50,100")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-plan-quality-") as tmp:
        for pair in args.pairs.split(","):
            name, gpus, gbs = pair.split(":")
            model, cluster = load_model(name), load_cluster("h800", gpus=int(gpus))
            base = SearchConfig(model=model, cluster=cluster, global_batch_size=int(gbs), space=load_space(),
                                storage="memory")
            pruned = prune_for(base)
            results: dict = {}
            t0 = time.perf_counter()
            inner = SimulatorFactory(model, cluster, str(Path(tmp) / "traces")).build()
            grid = run_search(_with(base, sampler=SamplerKind.GRID), Fixed(Recording(inner, results)), pruned=pruned)
            optimum = grid.best.step_time_s
            print(f"{name} on {gpus} GPUs, gbs {gbs}: {len(pruned.valid)} valid candidates simulated in "
                  f"{time.perf_counter() - t0:.0f} s; optimum {optimum:.3f} s/step")
            for budget in (int(b) for b in args.budgets.split(",")):
                gaps = []
                for seed in range(args.seeds):
                    ev = Recorded(results)
                    o = run_search(_with(base, sampler=SamplerKind.TPE, n_trials=budget, seed=seed), Fixed(ev),
                                   pruned=pruned)
                    gaps.append(o.best.step_time_s / optimum - 1)
                print(f"  TPE budget {budget:4d}: gap to optimum per seed " + ", ".join(f"{g:.2%}" for g in gaps))


def _with(config, **changes):
    from dataclasses import replace

    return replace(config, **changes)


if __name__ == "__main__":
    main()
