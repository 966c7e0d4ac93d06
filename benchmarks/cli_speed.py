"""Benchmark: the CLI as a user feels it (issue 20). Prints, each as a whole process:

* ``echo-plan simulate`` warm (traces on disk) for GPT-3 175B on the default H800 cluster
  (target < 0.5 s), with Python's bytecode cache as a user has it (this benchmark lifts
  ``PYTHONDONTWRITEBYTECODE`` for it: compiling echo_plan's modules from source on every run, as a
  shell with that variable and no ``__pycache__`` does, adds ~0.08 s);
* the README's main search, cold (empty trace cache, no stored study; target < 20 s);
* ``compare`` over its five default sizes, cold (target < 30 s).

The searches run as a user runs them (default ``--processes``: one worker per CPU, at most 4) and, for
the before/after of the pool, in one process (``--processes 1``). Beside each wall time the CPU time
(user + system) of the whole process tree, polled from ``/proc`` (Linux; 0 elsewhere): on a shared
machine the wall time depends on the load, the CPU time much less.

Before the compiled level-2 build (``replay/compiled/level2.py``), the shared memo, the checks ahead and
the ordered rounds, on the same 2-core machine unloaded: compare 67.3 s (default processes) and 89 s
in one process (91 s CPU); simulate 0.44-0.55 s, median 0.48 s (measured with PYTHONDONTWRITEBYTECODE
set; 0.42 s so now); README search 18.1-18.4 s.

    python benchmarks/cli_speed.py [--skip-compare]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


def _tree_cpu(root: int, seen: dict[int, float]) -> None:
    """CPU seconds so far of ``root`` and its descendants (the pool's workers are the fork server's
    children, which ``getrusage`` of this process never counts), kept per pid in ``seen``."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / tick
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += [p for p, pp in parent.items() if pp == pid and p not in tree]
    for pid in tree:
        if pid in cpu:
            seen[pid] = max(seen.get(pid, 0.0), cpu[pid])


def run_quick(args: list[str], env: dict[str, str] | None = None) -> float:
    """Wall seconds of ``echo-plan ARGS`` (no polling, for a sub-second command)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo_plan.cli", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t0


def run(args: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process tree) of ``echo-plan ARGS``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "echo_plan.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    seen: dict[int, float] = {}
    polled = os.path.isdir("/proc")
    while proc.poll() is None:
        if polled:
            _tree_cpu(proc.pid, seen)
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"echo-plan {' '.join(args)} failed ({proc.returncode})")
    return wall, sum(seen.values())


def machine() -> str:
    """The CPU model, its count and the memory, for the figures' caption (Linux; what is known elsewhere)."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    try:
        mem = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        mem = ""
    return f"{len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores of {model}{mem}"


def main() -> None:
    from echo_plan.search.process_pool import auto_processes

    print(f"machine: {machine()}")
    print(f"default --processes on this machine: {auto_processes(100)}; load average now "
          f"{os.getloadavg()[0]:.2f} (other processes share the CPUs: compare CPU times)")
    with tempfile.TemporaryDirectory() as tmp:
        sim = ["simulate", "--tp", "8", "--pp", "4", "--gbs", "1536", "--cache-dir", f"{tmp}/sim"]
        user_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        run_quick(sim, user_env)  # fills the trace cache (and Python's bytecode cache)
        run_quick(sim, user_env)
        warm = sorted(run_quick(sim, user_env) for _ in range(7))
        print(f"simulate warm, whole process: median {warm[3]:.2f} s, best {warm[0]:.2f} s, worst {warm[-1]:.2f} s "
              "(target < 0.5 s)")
        for procs in ([], ["--processes", "1"]):
            label = "default processes" if not procs else "one process"
            wall, cpu = run(["search", "--storage", "memory", "--cache-dir", f"{tmp}/search{len(procs)}",
                             "--no-progress", *procs])
            print(f"README search, cold, {label}: {wall:.1f} s, CPU {cpu:.1f} s (target < 20 s)")
        if "--skip-compare" in sys.argv:
            return
        for procs in ([], ["--processes", "1"]):
            label = "default processes" if not procs else "one process"
            wall, cpu = run(["compare", "--storage", "memory", "--cache-dir", f"{tmp}/compare{len(procs)}",
                             "--no-progress", *procs])
            print(f"compare over five sizes (64-512 GPUs), cold, {label}: {wall:.1f} s, CPU {cpu:.1f} s "
                  "(target < 30 s)")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
