"""The NCCL collective model against the real nccl-tests logs, per size and GPU count.

Prints predicted vs measured time and busbw with the error, for (1) the uncalibrated preset model
(NCCL's published constants, cluster NIC/NVLink figures) and (2) the model calibrated on the logs
with at most --fit-max-gpus GPUs (default 8: one server), the larger logs held out.

    .venv/bin/python benchmarks/nccl_accuracy.py [--logs DIR] [--cluster C] [--fit-max-gpus N] [--min-size BYTES]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from echo_plan.calibrate.nccl_fit import evaluate, fit_nccl
from echo_plan.cost.nccl_params import load_default_params
from echo_plan.interop.nccl_tests import parse_nccl_tests
from echo_plan.specs import load_cluster

DEFAULT_LOGS = Path(__file__).resolve().parents[2] / "shared" / "validation" / "nccl-tests" / "azure-nd-a100-v4"


def table(title: str, rows, min_size: int, fitted: bool = True) -> None:
    print(f"\n== {title}")
    print(f"{'GPUs':>4} {'role':<8} {'size':>12} {'meas us':>10} {'pred us':>10} {'err %':>7} "
          f"{'meas busbw':>10} {'pred busbw':>10}  choice")
    for r in sorted(rows, key=lambda r: (r.nranks, r.size_bytes)):
        if r.placement != "out-of-place" or r.size_bytes < min_size:
            continue
        role = "fit" if r.in_fit else ("holdout" if fitted else "-")
        print(f"{r.nranks:>4} {role:<8} {r.size_bytes:>12} {r.measured_us:>10.1f} {r.predicted_us:>10.1f} "
              f"{r.error_pct:>+7.1f} {r.measured_busbw:>10.2f} {r.predicted_busbw:>10.2f}  "
              f"{r.algorithm}/{r.protocol}{'  (outlier)' if r.outlier else ''}")
    by_n: dict[int, list] = {}
    for r in rows:
        if r.placement == "out-of-place" and r.size_bytes >= min_size and not r.outlier:
            by_n.setdefault(r.nranks, []).append(r)
    for n, rs in sorted(by_n.items()):
        errs = sorted(abs(r.error_pct) for r in rs)
        big = [abs(r.error_pct) for r in rs if r.size_bytes >= 1 << 20]
        print(f"  {n:>3} GPUs: median |err| {errs[len(errs) // 2]:.1f}%, max {errs[-1]:.1f}%; "
              f">= 1 MiB within 15%: {sum(e <= 15 for e in big)}/{len(big)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--logs", default=str(DEFAULT_LOGS))
    ap.add_argument("--cluster", default="azure-nd-a100-v4")
    ap.add_argument("--fit-max-gpus", type=int, default=8, help="0: fit on every log (in-sample)")
    ap.add_argument("--min-size", type=int, default=0)
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    logs = sorted((parse_nccl_tests(p) for p in sorted(Path(args.logs).glob("*.log"))), key=lambda lg: lg.nranks)
    table("uncalibrated (NCCL tuning.cc constants, preset NVLink/NIC figures)",
          evaluate(logs, cluster, load_default_params()), args.min_size, fitted=False)
    fit = fit_nccl(logs, cluster, fit_max_gpus=args.fit_max_gpus or None)
    print(f"\nfitted on {', '.join(fit.fit_logs)}; held out {', '.join(fit.holdout_logs) or 'none'}")
    for name, value in fit.values.items():
        print(f"  {name:<22} {value}")
    table(f"calibrated on {', '.join(fit.fit_logs)}", fit.rows, args.min_size)


if __name__ == "__main__":
    main()
