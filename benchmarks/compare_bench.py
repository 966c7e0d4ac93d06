"""Benchmark: ``compare`` for GPT-3 175B over five H800 cluster sizes from a cold trace cache
(issue 4's target: <= 3 minutes on the 2-core development machine).

Prints the comparison table, the wall time per size and in total, and the simulations and traces
each size needed (the trace cache is shared by the sizes: a layer's trace does not depend on the
cluster size, so later sizes mostly hit it).

    .venv/bin/python benchmarks/compare_bench.py [--gpus 64,96,128,256,512] [--trials N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    from echo_plan.search.compare import parse_gpu_list, parse_tokens, run_compare
    from echo_plan.search.evaluator import SimulatorFactory
    from echo_plan.search.space import load_space
    from echo_plan.search.study import SearchConfig
    from echo_plan.search.table import format_compare
    from echo_plan.specs import load_cluster, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="h800")
    ap.add_argument("--gpus", default="64,96,128,256,512")
    ap.add_argument("--gbs", type=int, default=1536)
    ap.add_argument("--trials", type=int, default=None, help="default: the search's default budget")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="echo-plan-bench-") as tmp:
        model, cluster = load_model(args.model), load_cluster(args.cluster)
        base = SearchConfig(model=model, cluster=cluster, global_batch_size=args.gbs, space=load_space(),
                            n_trials=args.trials, storage=f"sqlite:///{Path(tmp) / 'studies.db'}",
                            tokens_budget=parse_tokens("300B"))
        cache = str(Path(tmp) / "traces")
        t0 = time.perf_counter()
        outcome = run_compare(base, parse_gpu_list(args.gpus), lambda c: SimulatorFactory(model, c, cache))
        wall = time.perf_counter() - t0
        for line in format_compare(outcome):
            print(line)
        for row in outcome.rows:
            o = row.outcome
            sims = [t.wall_s for t in o.trials if t.wall_s > 0]
            print(f"{row.num_gpus:5d} GPUs: {o.wall_s:6.1f} s, {len(sims)} plans simulated "
                  f"({sum(sims) / max(1, len(sims)):.2f} s/plan), traces made {o.traces_made}, "
                  f"cache hits {o.trace_cache_hits}")
        print(f"total {wall:.1f} s for {len(outcome.rows)} sizes (cold trace cache)")


if __name__ == "__main__":
    main()
