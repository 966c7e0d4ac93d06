"""Benchmark: dense vs sparse data-parallel exchanges for GPT-3 175B and a 7B model on H800 (issue 16).

Prints, for 64-1,024 GPUs, the step time of the dense reduction and of each sparse method at
densities 0.001-0.1, and each method's break-even density for that plan. Per-step figures:
convergence is not modelled. Plans: GPT-3 175B tp8 pp8 (tp8 pp4 at 64 GPUs), 7B tp2 pp1, micro-batch 1.

    python benchmarks/sparsify_bench.py
"""

from __future__ import annotations

import time

from echo_plan.search.sparsify import analyse
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model

DENSITIES = (0.001, 0.01, 0.1)
SIZES = (64, 128, 256, 512, 1024)


def plan_for(model: str, gpus: int) -> PlanSpec:
    if model == "gpt3-175b":
        tp, pp = (8, 4) if gpus == 64 else (8, 8)
        gbs = 1536
    else:
        tp, pp, gbs = 2, 1, 1024
    return PlanSpec(tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch_size=gbs, sequence_parallel=tp > 1)


def main() -> None:
    t0 = time.perf_counter()
    for name in ("gpt3-175b", "llama2-7b"):
        model, memo = load_model(name), SimulationMemo()
        print(f"\n{name} on H800 (h800 preset): step seconds; break-even density per method")
        print(f"{'GPUs':>5} {'plan':<22} {'dense':>9}  " + "  ".join(
            f"{m:>14}" for m in ("topk", "cltk", "hard-threshold", "exdyna")))
        for gpus in SIZES:
            cluster = load_cluster("h800", gpus=gpus)
            plan = plan_for(name, gpus)
            dense, curves = analyse(plan, lambda p: simulate(model, cluster, p, memo=memo), DENSITIES)
            label = f"tp{plan.tp} pp{plan.pp} dp{plan.dp}"
            for d in DENSITIES:
                cells = "  ".join(f"{next(t for x, t, _ in c.points if x == d):>14.3f}" for c in curves)
                print(f"{gpus:>5} {label:<22} {dense.step_time_s:>9.3f}  {cells}   density {d:g}")
            cells = "  ".join(f"{'never' if c.break_even_density is None else f'{c.break_even_density:.3g}':>14}"
                              for c in curves)
            print(f"{gpus:>5} {label:<22} {'':>9}  {cells}   break-even")
    print(f"\n{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
