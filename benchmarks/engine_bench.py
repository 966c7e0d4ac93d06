"""Replay engine throughput: tasks per second on a pipeline-shaped workload.

Builds a GPipe-like step: ``stages`` devices, ``micro`` micro-batches, ``layers`` per stage, each
layer a compute task followed by a TP all-reduce on the tp_comm stream (the next layer waits on
it), point-to-point transfers between stages, and DP all-reduces overlapping the backward. Then
times ``replay`` with no interference (fast path) and with the default factors (rate tracking),
the latter with the compiled loop (``replay/compiled/``, Numba) and with the Python loop.

Run: ``.venv/bin/python benchmarks/engine_bench.py [--stages 8 --micro 16 --layers 8]``
"""

from __future__ import annotations

import argparse
import time

from echo_plan.replay.engine import Task, TaskKind, replay
from echo_plan.replay.interference import InterferenceModel, load_interference


def build(stages: int, micro: int, layers: int) -> list[Task]:
    tasks: list[Task] = []
    tid = 0
    last_on: dict[int, int] = {}  # device -> last compute-chain task

    def add(device: int, stream: str, work: float, kind: TaskKind, deps: tuple[int, ...]) -> int:
        nonlocal tid
        tasks.append(Task(tid, device, stream, work, kind, deps=deps))
        tid += 1
        return tid - 1

    fwd_out: dict[tuple[int, int], int] = {}
    for mb in range(micro):  # forward
        for s in range(stages):
            dep = fwd_out.get((s - 1, mb))
            prev = (dep,) if dep is not None else ()
            for _ in range(layers):
                c = add(s, "compute", 1e-3, TaskKind.GEMM, prev)
                prev = (add(s, "tp_comm", 2e-4, TaskKind.ALL_REDUCE, (c,)),)
            fwd_out[(s, mb)] = add(s, "pp_comm", 1e-4, TaskKind.P2P, prev)
    bwd_out: dict[tuple[int, int], int] = {}
    for mb in range(micro):  # backward
        for s in reversed(range(stages)):
            dep = bwd_out.get((s + 1, mb), fwd_out[(s, mb)])
            prev = (dep,)
            for _ in range(layers):
                c = add(s, "compute", 2e-3, TaskKind.GEMM, prev)
                prev = (add(s, "tp_comm", 2e-4, TaskKind.ALL_REDUCE, (c,)),)
                if mb == micro - 1:
                    add(s, "dp_comm", 5e-4, TaskKind.REDUCE_SCATTER, (c,))
            bwd_out[(s, mb)] = add(s, "pp_comm", 1e-4, TaskKind.P2P, prev)
            last_on[s] = bwd_out[(s, mb)]
    return tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--micro", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tasks = build(args.stages, args.micro, args.layers)
    from echo_plan.replay.compiled.switch import CompiledSwitch, JitMode

    runs = [("no interference (fast path)", InterferenceModel.none(), JitMode.ON),
            ("interference, compiled loop", load_interference(None), JitMode.ON),
            ("interference, Python loop", load_interference(None), JitMode.OFF)]
    for label, model, mode in runs:
        switch = CompiledSwitch(mode)
        if mode is JitMode.ON and switch.kernels().rates is None:
            print(f"{label:30s} skipped: Numba is not installed")
            continue
        replay(tasks[:100], model, switch)  # compile (or load the compiled loop) outside the timing
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            r = replay(tasks, model, switch)
            best = min(best, time.perf_counter() - t0)
        print(f"{label:30s} {len(tasks):7d} tasks  {best * 1e3:8.1f} ms  {len(tasks) / best:10,.0f} tasks/s  "
              f"makespan {r.makespan_s * 1e3:.2f} ms")

if __name__ == "__main__":
    main()
