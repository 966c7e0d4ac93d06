"""Benchmark: goodput across cluster sizes, and the goodput model against published figures (issue 14).

Prints (1) the goodput model fed the published inputs of Llama 3 405B pre-training and of ByteRobust,
beside the published effective training time ratios; (2) ``compare --gpus 1024,2048,4096,8192,16384``
for GPT-3 175B with goodput on, cold (empty trace cache, no stored study), with its wall time
(target: under 3 minutes on CI's 2 cores).

    python benchmarks/goodput_bench.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

from echo_plan.cost.goodput import FailureModel, ettr


def main() -> None:
    llama, *_ = ettr(16_384, 405e9 * 14, FailureModel())
    print(f"Llama 3 405B, 16,384 GPUs (419 interruptions / 54 days, 2 TB/s storage, detection 5 min and "
          f"restart 10 min assumed): ETTR {llama:.1%} (published: > 90%)")
    byte, *_ = ettr(9_600, 405e9 * 14, FailureModel(detect_min=2, restart_min=5, checkpoint_GBps_per_gpu=10))
    print(f"ByteRobust, 9,600 GPUs (Llama 3's rate, near-zero checkpoint blocking, detection 2 min and restart "
          f"5 min assumed): ETTR {byte:.1%} (published: 97%)")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "echo_plan.cli", "compare", "--model", "gpt3-175b", "--gbs",
                              "1536", "--gpus", "1024,2048,4096,8192,16384", "--storage", "memory", "--cache-dir",
                              f"{tmp}/c", "--no-progress"], check=True, capture_output=True, text=True).stdout
        wall = time.perf_counter() - t0
    print(out)
    print(f"compare over five sizes with goodput, cold: {wall:.1f} s (target < 180 s)")


if __name__ == "__main__":
    main()
