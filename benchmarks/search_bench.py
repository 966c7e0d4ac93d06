"""Benchmark: a default-space search for GPT-3 175B on 1,024 H800 (issue 4's speed target).

Runs the search twice, from a cold trace cache and then warm (a new study each time, so every
plan is simulated both times), and prints wall time, trials, pruned candidates, traces made and
cache hits, and where the time went. Targets on the 2-core development machine: <= 60 s cold,
<= 20 s warm.

    .venv/bin/python benchmarks/search_bench.py [--gpus 1024] [--model gpt3-175b] [--trials N] [--workers N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def run(model: str, cluster: str, gpus: int, gbs: int, trials: int | None, workers: int, cache: Path,
        storage: str, label: str) -> None:
    from echo_plan.search.evaluator import SimulatorFactory
    from echo_plan.search.space import load_space
    from echo_plan.search.study import SearchConfig, prune_for, run_search
    from echo_plan.specs import load_cluster, load_model

    t0 = time.perf_counter()
    m, c = load_model(model), load_cluster(cluster, gpus=gpus)
    config = SearchConfig(model=m, cluster=c, global_batch_size=gbs, space=load_space(), n_trials=trials,
                          storage=storage, study_name=f"bench-{label}-{time.time_ns()}", workers=workers)
    t1 = time.perf_counter()
    pruned = prune_for(config)
    t2 = time.perf_counter()
    outcome = run_search(config, SimulatorFactory(m, c, str(cache)), pruned=pruned)
    t3 = time.perf_counter()
    sim_s = sum(t.wall_s for t in outcome.trials)
    simulated = sum(1 for t in outcome.trials if t.wall_s > 0)
    best = outcome.best
    print(f"[{label}] {model} on {gpus} x {c.gpu.name}: wall {t3 - t0:.1f} s "
          f"(specs {t1 - t0:.1f} s, pruning {t2 - t1:.1f} s, search {t3 - t2:.1f} s, of which simulate "
          f"{sim_s:.1f} s for {simulated} plans = {sim_s / max(1, simulated):.2f} s/plan)")
    print(f"[{label}] trials {len(outcome.trials)}, candidates {outcome.candidates_total}, pruned before "
          f"simulation {sum(outcome.pruned_counts.values())}, traces made {outcome.traces_made}, "
          f"trace cache hits {outcome.trace_cache_hits}")
    if best is not None:
        from echo_plan.search.table import plan_label

        print(f"[{label}] best {plan_label(best.plan)}: {best.step_time_s:.3f} s/step, MFU {best.mfu:.1%}, "
              f"{best.memory_peak_gib:.1f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="h800")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--gbs", type=int, default=1536)
    ap.add_argument("--trials", type=int, default=None, help="default: the search's default budget")
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-plan-bench-") as tmp:
        cache = Path(tmp) / "traces"
        storage = f"sqlite:///{Path(tmp) / 'studies.db'}"
        for label in ("cold", "warm"):
            run(args.model, args.cluster, args.gpus, args.gbs, args.trials, args.workers, cache, storage, label)


if __name__ == "__main__":
    main()
