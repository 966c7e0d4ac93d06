"""Fitting the low-precision GEMM efficiencies of a cluster preset on part of a suite's fp8 and fp4 rows.

    python -m echo_plan.calibrate.fp8_fit            # fit and print, per recipe with low-precision rows
    python -m echo_plan.calibrate.fp8_fit --write    # and add the figures to the presets' calibration

The bf16 compute calibration (``calibrate.presets``) is fitted on bf16 rows only and kept as it is.
Low-precision GEMMs then get one more figure per kind of row, each on top of the bf16 GEMM scale and
compute.yaml's curves, fitted on the rows the recipe's rule picks (the same rule as the bf16 fit: each
model's two smallest clusters, or named rows); every other row of that kind stays held out:

* ``fp8_gemm_efficiency_scale`` on fp8 rows of the per-tensor and blockwise recipes;
* ``mxfp8_gemm_efficiency_scale`` on MXFP8 rows (on top of the fp8 figure, fitted first);
* ``fp4_gemm_efficiency_scale`` on NVFP4 rows (plan dtype fp4).

Each figure solves "mean log residual of its fitted rows = 0" by bisection (the predicted step falls as
the scale rises). A kind with no row to fit keeps compute.yaml's prior.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from echo_plan.calibrate.preset_files import fit_labels, recipes, rule_words
from echo_plan.calibrate.row_fit import bisect_figure, fit_main, fit_record, log_residuals
from echo_plan.errors import EchoPlanError
from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite

SCALE_RANGE = (0.5, 1.5)
# kind of row -> the calibration figure it fits, in the order they are fitted (MXFP8 builds on FP8)
FIGURES = {"fp8": "fp8_gemm_efficiency_scale", "mxfp8": "mxfp8_gemm_efficiency_scale",
           "fp4": "fp4_gemm_efficiency_scale"}


def precision_of(row: Any) -> str:
    """bf16, fp16, fp8 (per-tensor or blockwise recipes), mxfp8 or fp4: which figure a row can fit."""
    dtype = str(row.plan.get("dtype", "bf16")).lower()
    if dtype == "fp8" and str(row.stack_overrides.get("fp8_recipe", "")).lower() == "mxfp8":
        return "mxfp8"
    return dtype


def is_fp8(row: Any) -> bool:
    """A row with low-precision GEMMs (FP8 of any recipe, or NVFP4): it fits its own figure, not the bf16 ones."""
    return precision_of(row) in FIGURES


def fp8_fit(rows: Sequence[Any], fit_labels: set[str], cluster: Any, stack_name: str, model_settings: Any = None,
            cache: Any = None, progress: Callable[[int, str], None] | None = None, kind: str = "fp8") -> dict[str, Any]:
    """The fitted scale of ``kind``'s figure and each of its rows' residual: {scale, fitted_on, held_out,
    residuals}."""
    mine = [r for r in rows if precision_of(r) == kind and not r.not_modelled]
    fit = [r for r in mine if r.label in fit_labels]
    if not fit:
        raise EchoPlanError(f"no {kind} row to fit {FIGURES[kind]} on")
    base = ComputeCalibration.of(cluster)
    sim = RowSimulator(cluster, stack_name, cache, model_settings=model_settings)
    consts = load_compute_constants()

    def residuals(scale: float, which: Sequence[Any]) -> list[float]:
        compute = AnalyticalComputeModel(calibrated_constants(replace(base, **{FIGURES[kind]: scale}), consts))
        return log_residuals(lambda r: sim.predict(r, compute=compute), which)

    scale = bisect_figure(lambda s: sum(residuals(s, fit)) / len(fit), *SCALE_RANGE, 24, progress, f"{kind} scale", 4)
    return fit_record("scale", scale, fit, mine, residuals(scale, mine))


def fp8_block(recipe: dict, vdir: Path, cluster: Any, cache: Any = None, progress=None) -> dict[str, Any] | None:
    """The low-precision part of a compute recipe's calibration: per kind with a row to fit, its figure (fitted
    in ``FIGURES``' order, each on the calibration the earlier ones made), or None when there is none."""
    suite = training_suite(vdir / f"{recipe['suite']}.csv")
    rows = [r for r in training_rows(suite) if is_fp8(r)]
    labels = fit_labels(rows, recipe["fit_rows"])
    fits: dict[str, dict[str, Any]] = {}
    for kind, figure in FIGURES.items():
        if not any(precision_of(r) == kind and r.label in labels for r in rows):
            continue
        cal = dict(cluster.calibration or {})
        cal["compute"] = {**dict(cal.get("compute") or {}), **{FIGURES[k]: f["scale"] for k, f in fits.items()}}
        fits[kind] = fp8_fit(rows, labels, cluster.replace(calibration=cal), suite.stack, suite.model_settings,
                             cache, progress, kind)
    if not fits:
        return None
    return {"suite": suite.name, "rule": recipe["fit_rows"], "fits": fits,
            "fitted_on": [x for f in fits.values() for x in f["fitted_on"]],
            "residuals": {k: v for f in fits.values() for k, v in f["residuals"].items()}}


def merge(compute: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """A compute calibration block with the low-precision figures added (their fitted rows join ``fitted_on``)."""
    out = dict(compute)
    fitted = {k: list(v) for k, v in (out.get("fitted_on") or {}).items()}
    for kind, fit in got["fits"].items():
        out[FIGURES[kind]] = fit["scale"]
        fitted[got["suite"]] = list(dict.fromkeys(fitted.get(got["suite"], []) + fit["fitted_on"]))
        out[f"{kind}_fit"] = {
            "source": f"{got['suite']}.csv {kind} {rule_words(got['rule'])}; fitted by python -m "
                      "echo_plan.calibrate.fp8_fit",
            "fitted_on": fit["fitted_on"], "held_out": fit["held_out"], "residuals": fit["residuals"],
        }
    out["fitted_on"] = fitted
    return out


def headline(got: dict[str, Any]) -> str:
    return "; ".join(f"{FIGURES[k]} {f['scale']} fitted on {len(f['fitted_on'])} rows" for k, f in got["fits"].items())


def main(argv: list[str] | None = None) -> int:
    fp8_recipes = {name: r for name, r in recipes().items() if "suite" in r}
    return fit_main(argv, __doc__.splitlines()[0], fp8_recipes, fp8_block, headline, "compute", merge)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
