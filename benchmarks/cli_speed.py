"""Benchmark: the CLI as a user feels it (issue 20). Prints, each as a whole process:

* ``echo-plan simulate`` warm (traces on disk) for GPT-3 175B on the default H800 cluster
  (target < 0.5 s; 0.93-0.96 s before the compiled loop became opt-in and libyaml read the data);
* the README's main search, cold (empty trace cache, no stored study; target < 20 s);
* ``compare`` over its five default sizes, cold (target < 30 s).

The searches run as a user runs them (default ``--processes``: one worker per CPU, at most 4) and, for
the before/after, in one process (``--processes 1``, what every search did before the pool).

    python benchmarks/cli_speed.py [--skip-compare]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def run(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo_plan.cli", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    from echo_plan.search.process_pool import auto_processes

    print(f"default --processes on this machine: {auto_processes(100)}")
    with tempfile.TemporaryDirectory() as tmp:
        sim = ["simulate", "--tp", "8", "--pp", "4", "--gbs", "1536", "--cache-dir", f"{tmp}/sim"]
        run(sim)  # fills the trace cache
        warm = sorted(run(sim) for _ in range(5))
        print(f"simulate warm, whole process: median {warm[2]:.2f} s, best {warm[0]:.2f} s (target < 0.5 s)")
        for procs in ([], ["--processes", "1"]):
            label = "default processes" if not procs else "one process"
            cold = run(["search", "--storage", "memory", "--cache-dir", f"{tmp}/search{len(procs)}", "--no-progress",
                        *procs])
            print(f"README search, cold, {label}: {cold:.1f} s (target < 20 s)")
        if "--skip-compare" in sys.argv:
            return
        for procs in ([], ["--processes", "1"]):
            label = "default processes" if not procs else "one process"
            cold = run(["compare", "--storage", "memory", "--cache-dir", f"{tmp}/compare{len(procs)}", "--no-progress",
                        *procs])
            print(f"compare over five sizes (64-512 GPUs), cold, {label}: {cold:.1f} s (target < 30 s)")


if __name__ == "__main__":
    main()
