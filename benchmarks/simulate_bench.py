"""How long simulate() takes per plan: cold (empty trace cache), warm (traces on disk, fresh memo)
and hot (the memo a search keeps), and how the time grows with GPUs, micro-batches and virtual
stages. Targets (issue 3): GPT-3 175B on 1,024 H800 (TP 8, PP 8, DP 16, mbs 1, gbs 1536) <= 1 s
warm and <= 10 s cold, with and without interleaving; <= 2 s warm on 16,384 GPUs.

Run: .venv/bin/python benchmarks/simulate_bench.py
"""

from __future__ import annotations

import tempfile
import time


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    from echo_plan.simulate import SimulationMemo, simulate
    from echo_plan.specs import PlanSpec, load_cluster, load_model
    from echo_plan.trace.cache import TraceCache

    model = load_model("gpt3-175b")
    t0 = time.perf_counter()
    import torch  # noqa: F401  (the tracer's dependency; a fresh process pays this once)

    print(f"importing torch: {time.perf_counter() - t0:.2f} s (paid once per process, inside the first cold run "
          f"of a fresh CLI call)")
    with tempfile.TemporaryDirectory() as tmp:
        print("GPT-3 175B, TP 8, PP 8, mbs 1, SP + selective recompute, distributed optimizer; seconds per plan")
        print("cold: empty trace cache; warm: traces on disk, fresh memo; hot: the memo a search keeps")
        print(f"{'GPUs':>6} {'gbs':>5} {'vpp':>3} {'micro-b.':>8} {'tasks':>7} {'cold':>7} {'warm':>7} {'hot':>7} "
              f"{'step s':>7} {'MFU':>6}")
        cases = [(1024, 1536, 1), (1024, 1536, 2), (1024, 1536, 3), (1024, 1536, 4), (16384, 1536, 1),
                 (16384, 2048, 2)]
        for gpus, gbs, vpp in cases:
            cluster = load_cluster("h800", gpus=gpus)
            plan = PlanSpec(tp=8, pp=8, dp=gpus // 64, micro_batch_size=1, global_batch_size=gbs, virtual_stages=vpp,
                            sequence_parallel=True, recompute="selective", distributed_optimizer=True)
            cold_cache = TraceCache(f"{tmp}/cold-{gpus}-{vpp}")  # empty: traces from scratch
            cold, _ = timed(lambda: simulate(model, cluster, plan, cache=cold_cache))
            warm, _ = timed(lambda: simulate(model, cluster, plan, cache=TraceCache(f"{tmp}/cold-{gpus}-{vpp}")))
            memo = SimulationMemo()
            simulate(model, cluster, plan, cache=cold_cache, memo=memo)
            hot, r = timed(lambda: simulate(model, cluster, plan, cache=cold_cache, memo=memo))
            tasks = next(n for n in r.notes if n.startswith("level-2 tasks")).split(": ")[1]
            print(f"{gpus:>6} {gbs:>5} {vpp:>3} {plan.num_microbatches:>8} {tasks:>7} {cold:>7.2f} {warm:>7.2f} "
                  f"{hot:>7.3f} {r.step_time_s:>7.2f} {r.mfu * 100:>5.1f}%")

        print("\nGrowth with micro-batches (1,024 GPUs, vpp 1, hot memo): time grows roughly with level-2 tasks")
        cache = TraceCache(f"{tmp}/growth")
        memo = SimulationMemo()
        cluster = load_cluster("h800", gpus=1024)
        for gbs in (256, 512, 1024, 2048, 4096):
            plan = PlanSpec(tp=8, pp=8, dp=16, global_batch_size=gbs, sequence_parallel=True, recompute="selective")
            simulate(model, cluster, plan, cache=cache, memo=memo)
            t, r = timed(lambda: simulate(model, cluster, plan, cache=cache, memo=memo))
            print(f"  micro-batches {plan.num_microbatches:>4}: {t:.3f} s  ({r.notes[-1]})")
        print("\nGrowth with GPUs at a fixed global batch 1536 (DP grows, micro-batches shrink):")
        for gpus in (512, 1024, 2048, 4096, 8192, 16384):
            cluster = load_cluster("h800", gpus=gpus)
            plan = PlanSpec(tp=8, pp=8, dp=gpus // 64, global_batch_size=1536, sequence_parallel=True,
                            recompute="selective")
            simulate(model, cluster, plan, cache=cache, memo=memo)
            t, r = timed(lambda: simulate(model, cluster, plan, cache=cache, memo=memo))
            print(f"  {gpus:>5} GPUs, {plan.num_microbatches:>3} micro-batches: {t:.3f} s  ({r.notes[-1]})")


if __name__ == "__main__":
    main()
