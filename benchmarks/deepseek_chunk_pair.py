"""Issue 32: one DualPipe chunk pair of DeepSeek-V3 on H800, predicted against DeepSeek's own profile.

Run: .venv/bin/python benchmarks/deepseek_chunk_pair.py

What is compared and how: echo_plan/validation/chunk_pair.py (nothing fitted). Targets (issue 32): the pair
within 10%, each class within 15%; tests/validation/test_chunk_pair.py holds the ones met.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_plan.validation.chunk_pair import CLASSES, compare  # noqa: E402


def main() -> int:
    t0 = time.perf_counter()
    c = compare()
    print(f"{'class':<28} {'profile ms':>11} {'in the pair':>12} {'error':>7} {'alone':>8} {'error':>7}   "
          "(4 MoE layers, fwd + bwd; the profile's kernels ran inside the pair)")
    for cls in CLASSES:
        m, p, a = c.measured_ms.get(cls, 0.0), c.in_pair_ms.get(cls, 0.0), c.alone_ms.get(cls, 0.0)

        def err(x):
            if x == 0 and m > 0:
                return "no kernel"  # the notify kernels' waits: a one-rank replay has none
            return f"{(x - m) / m * 100:+.0f}%" if m > 0 else "-"
        print(f"{cls:<28} {m:>11.1f} {p:>12.1f} {err(p):>7} {a:>8.1f} {err(a):>7}")
    print(f"{'chunk pair (overlapped)':<28} {c.measured_pair_ms:>11.1f} {c.predicted_pair_ms:>13.1f} "
          f"{c.pair_error * 100:>+7.0f}%   (target: within 10%; classes within 15%)")
    print(f"{time.perf_counter() - t0:.1f} s on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
