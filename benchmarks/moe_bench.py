"""Benchmark: MoE simulate and search times (issue 12 targets), printed, not asserted.

Targets: simulate of DeepSeek-V3 on 2,048 H800 with DeepSeek's layout (PP 16, EP 64, no TP, ZeRO-1)
under 2 s warm; search --model deepseek-v3 --gpus 2048 under 60 s cold; search --model mixtral-8x7b
--gpus 64 under 30 s cold (on 2 cores: run with taskset -c 0,1 to reproduce CI's machine). Cold: empty trace cache, no stored study.

    python benchmarks/moe_bench.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time


def run(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "echo_plan.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ds = ["simulate", "--model", "deepseek-v3", "--cluster", "h800", "--gpus", "2048", "--pp", "16",
              "--ep", "64", "--layer-split", "auto", "--distributed-optimizer", "--gbs", "15360",
              "--cache-dir", f"{tmp}/sim"]
        cold = run(ds)
        warm = min(run(ds) for _ in range(3))
        print(f"simulate deepseek-v3 2048 H800 pp16 ep64: cold {cold:.2f} s, warm {warm:.2f} s (target warm < 2 s)")
        t = run(["search", "--model", "deepseek-v3", "--gpus", "2048", "--cache-dir", f"{tmp}/ds", "--storage", "memory"])
        print(f"search deepseek-v3 2048 GPUs cold: {t:.1f} s (target < 60 s)")
        t = run(["search", "--model", "mixtral-8x7b", "--gpus", "64", "--cache-dir", f"{tmp}/mx", "--storage", "memory"])
        print(f"search mixtral-8x7b 64 GPUs cold: {t:.1f} s (target < 30 s)")


if __name__ == "__main__":
    main()
