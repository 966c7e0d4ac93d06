"""Cold and warm tracing times for GPT-3 175B and Llama-3 70B at TP 8.

    .venv/bin/python benchmarks/trace_bench.py [--repeat 5]

Measures, with a temporary cache folder (the user's cache is never touched):
  * ``echo-plan trace`` in a fresh process, cold (empty cache: Python start, torch import, three
    stage traces) and warm (all three stages from the cache);
  * in one process: the first stage trace (which pays for importing torch's fake-tensor stack),
    then the steady-state time of each stage trace, and a cache hit read from disk.
Numbers depend on the machine and its load; run it on an idle machine for figures to report.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("gpt3-175b", "llama3-70b")
TP = 8


def cli_time(model: str, cache_dir: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``echo-plan trace`` process; CPU time is the figure that
    other processes competing for the cores disturb least."""
    exe = Path(sys.executable).with_name("echo-plan")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "echo_plan.cli"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([*cmd, "trace", "-m", model, "--tp", str(TP), "--json", "--cache-dir", str(cache_dir)],
                   check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def in_process(model_name: str, repeat: int, cache_dir: Path) -> dict[str, float]:
    from echo_plan.specs import DType, Recompute, load_model
    from echo_plan.trace.cache import TraceCache
    from echo_plan.trace.tracer import trace_stage
    from echo_plan.trace.records import StageKind

    model = load_model(model_name)
    args = dict(tp=TP, sequence_parallel=False, micro_batch_size=1, dtype=DType.BF16, recompute=Recompute.NONE)
    out: dict[str, float] = {}
    start = time.perf_counter()
    trace_stage(model, StageKind.BLOCK, **args)
    out["first block trace (s)"] = time.perf_counter() - start
    for stage in StageKind:
        times = []
        for i in range(repeat):
            start = time.perf_counter()
            trace_stage(model, stage, **{**args, "micro_batch_size": 1 + i % 2})
            times.append(time.perf_counter() - start)
        out[f"{stage.value} trace, median (s)"] = statistics.median(times)
    for mode in (Recompute.SELECTIVE, Recompute.FULL):
        start = time.perf_counter()
        trace_stage(model, StageKind.BLOCK, **{**args, "recompute": mode, "sequence_parallel": True})
        out[f"block trace sp {mode.value} (s)"] = time.perf_counter() - start
    trace_stage(model, StageKind.BLOCK, **args, cache=TraceCache(cache_dir))  # fills the cache
    hits = []
    for _ in range(repeat):
        start = time.perf_counter()
        got = trace_stage(model, StageKind.BLOCK, **args, cache=TraceCache(cache_dir))  # new instance: disk read
        hits.append(time.perf_counter() - start)
        assert got.from_cache
    out["block cache hit from disk, median (s)"] = statistics.median(hits)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for model in MODELS:
        tmp = Path(tempfile.mkdtemp(prefix="echo-plan-trace-bench-"))
        try:
            cold = cli_time(model, tmp / "cli")
            warm = cli_time(model, tmp / "cli")
            print(f"\n{model}, TP {TP}, micro-batch 1, bf16")
            print(f"  echo-plan trace, cold (empty cache, 3 stages) : {cold[0]:7.2f} s wall, {cold[1]:6.2f} s CPU")
            print(f"  echo-plan trace, warm (3 stages from cache)   : {warm[0]:7.2f} s wall, {warm[1]:6.2f} s CPU")
            for name, value in in_process(model, opts.repeat, tmp / "lib").items():
                print(f"  {name:<46}: {value:7.3f}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
