"""Predicted vs published TFLOP/s per GPU for Megatron-LM's weak-scaling table (Narayanan et al.
2021, Table 1), and how sensitive the error is to what the table leaves open.

Prints: (1) the raw model (no fitted factor) with today's kernels and with the 2021 kernels;
(2) one compute-time factor fitted on the even rows, with the error on the held-out odd rows;
(3) for a few rows, every allowed micro-batch size and interleaving depth at that factor.

Run: .venv/bin/python benchmarks/accuracy_sensitivity.py   (needs ../shared/validation or
ECHO_PLAN_VALIDATION_DIR)
"""

from __future__ import annotations

import tempfile


def main() -> None:
    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.megatron import (Predictor, fit_compute_scale, format_table, load_rows,
                                               mean_abs_error, split_rows)

    rows = load_rows()
    with tempfile.TemporaryDirectory() as tmp:
        cache = TraceCache(tmp)
        fused = Predictor(cache=cache, unfused_attention=False)
        print("1a. No fitted factor, fused (flash) attention as the tracer records it:")
        print(format_table(fused.table(rows)))
        p = Predictor(cache=cache, memo=fused.memo)
        print("\n1b. No fitted factor, 2021 kernels (unfused attention), gradients reduced after backward:")
        print(format_table(p.table(rows)))

        fit_rows, held_rows = split_rows(rows)
        scale, fit_preds = fit_compute_scale(p, fit_rows)
        held = p.table(held_rows, scale=scale)
        preds = sorted(fit_preds + held, key=lambda x: x.row.gpus)
        print(f"\n2. Compute-time factor fitted on the even rows: {scale:.3f} "
              f"(compute kernels run at {1 / scale * 100:.0f}% of the roofline model's speed)")
        print(format_table(preds))
        print(f"held-out (odd rows) mean absolute error: {mean_abs_error(held) * 100:.1f}%; "
              f"fit rows: {mean_abs_error(fit_preds) * 100:.1f}%")

        print("\n3. Sensitivity to micro-batch size and interleaving (at the fitted factor):")
        fitted = Predictor(cache=cache, memo=p.memo, compute_scale=scale)
        for index in (0, 4, 6, 7):
            row = rows[index]
            print(f"  {row.params_b:g}B (tp {row.tp}, pp {row.pp}, {row.gpus} GPUs, published "
                  f"{row.published_tflops:g}):")
            for pred in fitted.sensitivity(row, mbs_options=(1, 2, 4, 8), vpp_options=(1, 2, 4)):
                flag = "" if pred.fits else "  (does not fit in 80 GiB)"
                print(f"    mbs {pred.mbs} vpp {pred.vpp}: {pred.predicted_tflops:6.1f} TFLOP/s "
                      f"({pred.error * 100:+.1f}%){flag}")


if __name__ == "__main__":
    main()
