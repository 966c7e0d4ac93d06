"""Benchmark (issue 19): the searches with zero-bubble and DualPipe schedules in the default space.

Prints, each as a whole process with an empty trace cache and no stored study (cold):

* the README's main command, ``echo-plan search`` (GPT-3 175B on 96 H800s; target < 60 s on 2 cores);
* the 1,024-GPU GPT-3 search, ``echo-plan search --gpus 1024 --gbs 1536`` (target < 30 s on 2 cores);
* with ``--baseline``, the same two searches with the schedule knob fixed to 1F1B, for the cost of the
  new schedules (the default space minus its ``schedule`` list).

Wall-clock and CPU (user + system of the child) seconds; on a shared machine the CPU figure is the
steadier one.

    python benchmarks/schedule_search_speed.py [--baseline]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo_plan.cli", *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    baseline = "--baseline" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        spaces = [("default space", None)]
        if baseline:
            text = (ROOT / "search_spaces" / "default.yaml").read_text()
            fixed = text.replace("  schedule: [1f1b, zb-h1, zb-v, dualpipe]\n", "")
            path = Path(tmp) / "no-new-schedules.yaml"
            path.write_text(fixed)
            spaces.append(("1F1B/interleaved only", str(path)))
        for label, space in spaces:
            extra = ["--space", space] if space else []
            for name, args, target in (
                    ("README search", [], 60),
                    ("1,024-GPU GPT-3 search", ["--gpus", "1024", "--gbs", "1536"], 30)):
                cache = tempfile.mkdtemp(dir=tmp)
                wall, cpu = run(["search", "--storage", "memory", "--cache-dir", cache, "--no-progress",
                                 *args, *extra])
                print(f"{name}, cold, {label}: {wall:.1f} s wall, {cpu:.1f} s CPU (target < {target} s)")


if __name__ == "__main__":
    main()
