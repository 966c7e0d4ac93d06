"""Megatron-LM's weak-scaling table (Narayanan et al. 2021, Table 1): predicted vs published
TFLOP/s per GPU with the shipped dgx-a100 preset and the megatron-lm-2021 stack, and how
sensitive the error is to what the table leaves open (micro-batch size and interleaving).

Run: .venv/bin/python benchmarks/accuracy_sensitivity.py   (the table ships with the package:
echo_plan/data/validation/)
"""

from __future__ import annotations

import tempfile


def main() -> None:
    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.megatron import TABLE, read_tflops_table, validation_dir
    from echo_plan.validation.predict import RowSimulator
    from echo_plan.validation.suites import fitted_rows

    path = validation_dir() / TABLE
    rows = read_tflops_table(path)
    with tempfile.TemporaryDirectory() as tmp:
        sim = RowSimulator("dgx-a100", "megatron-lm-2021", TraceCache(tmp))
        fit = fitted_rows(sim.base, "megatron_weak_scaling_a100")
        print("1. The choice rule of echo_plan/validation/megatron.py (mbs 4 without a pipeline, else mbs 1 and "
              "2 chunks when allowed):")
        print(f"   {'row':<26} {'mbs/vpp':>8} {'published':>9} {'predicted':>9} {'error':>7}")
        for p in sim.predict_all(rows):
            role = "fit" if p.row.label in fit else "held out"
            print(f"   {p.row.label:<26} {p.row.detail:>8} {p.row.measured:>9.0f} {p.figure:>9.1f} "
                  f"{p.error * 100:>+6.1f}%  {role}")
        print("\n2. Every allowed (micro-batch, interleaving) for four rows:")
        for index in (0, 4, 6, 7):
            base = rows[index]
            print(f"   {base.label} (published {base.measured:g}):")
            for mbs in (1, 2, 4, 8):
                for vpp in (1, 2, 4):
                    try:
                        (row,) = [r for r in read_tflops_table(path, choice=(mbs, vpp)) if r.label == base.label]
                    except Exception:
                        continue
                    p = sim.predict(row)
                    if p.step_s is None:
                        continue
                    flag = "" if p.fits else "  (does not fit)"
                    print(f"     mbs {mbs} vpp {vpp}: {p.figure:6.1f} TFLOP/s ({p.error * 100:+.1f}%){flag}")


if __name__ == "__main__":
    main()
