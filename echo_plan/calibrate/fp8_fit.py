"""Fitting the FP8 GEMM efficiency of a cluster preset on part of a suite's fp8 rows.

    python -m echo_plan.calibrate.fp8_fit            # fit and print, per recipe with fp8 rows
    python -m echo_plan.calibrate.fp8_fit --write    # and add the figure to the presets' calibration

The bf16 compute calibration (``calibrate.presets``) is fitted on bf16 rows only and kept as it is.
FP8 GEMMs then get one more figure, ``fp8_gemm_efficiency_scale`` (on top of the bf16 GEMM scale and
compute.yaml's FP8 curve), fitted on the fp8 rows the recipe's rule picks (the same rule as the bf16
fit: each model's two smallest clusters); every other fp8 row stays held out. The figure solves
"mean log residual of the fitted rows = 0" by bisection (the predicted step falls as the scale rises).
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


def is_fp8(row: Any) -> bool:
    return str(row.plan.get("dtype", "bf16")).lower() == "fp8"


def fp8_fit(rows: Sequence[Any], fit_labels: set[str], cluster: Any, stack_name: str, model_settings: Any = None,
            cache: Any = None, progress: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """The fitted scale and each fp8 row's residual: {scale, fitted_on, held_out, residuals}."""
    fp8 = [r for r in rows if is_fp8(r) and not r.not_modelled]
    fit = [r for r in fp8 if r.label in fit_labels]
    if not fit:
        raise EchoPlanError("no fp8 row to fit the FP8 GEMM efficiency on")
    base = ComputeCalibration.of(cluster)
    sim = RowSimulator(cluster, stack_name, cache, model_settings=model_settings)
    consts = load_compute_constants()

    def residuals(scale: float, which: Sequence[Any]) -> list[float]:
        compute = AnalyticalComputeModel(calibrated_constants(replace(base, fp8_gemm_efficiency_scale=scale), consts))
        return log_residuals(lambda r: sim.predict(r, compute=compute), which)

    scale = bisect_figure(lambda s: sum(residuals(s, fit)) / len(fit), *SCALE_RANGE, 24, progress, "fp8 scale", 4)
    return fit_record("scale", scale, fit, fp8, residuals(scale, fp8))


def fp8_block(recipe: dict, vdir: Path, cluster: Any, cache: Any = None, progress=None) -> dict[str, Any] | None:
    """The fp8 part of a compute recipe's calibration, or None when its suite has no fp8 row."""
    suite = training_suite(vdir / f"{recipe['suite']}.csv")
    rows = [r for r in training_rows(suite) if is_fp8(r)]
    if not any(not r.not_modelled for r in rows):
        return None
    labels = fit_labels(rows, recipe["fit_rows"])
    got = fp8_fit(rows, labels, cluster, suite.stack, suite.model_settings, cache, progress)
    return {"suite": suite.name, "rule": recipe["fit_rows"], **got}


def merge(compute: dict[str, Any], fp8: dict[str, Any]) -> dict[str, Any]:
    """A compute calibration block with the fp8 fit added (its fitted rows join ``fitted_on``)."""
    out = dict(compute)
    out["fp8_gemm_efficiency_scale"] = fp8["scale"]
    fitted = {k: list(v) for k, v in (out.get("fitted_on") or {}).items()}
    fitted[fp8["suite"]] = list(dict.fromkeys(fitted.get(fp8["suite"], []) + fp8["fitted_on"]))
    out["fitted_on"] = fitted
    out["fp8_fit"] = {
        "source": f"{fp8['suite']}.csv fp8 {rule_words(fp8['rule'])}; fitted by python -m echo_plan.calibrate.fp8_fit",
        "fitted_on": fp8["fitted_on"], "held_out": fp8["held_out"], "residuals": fp8["residuals"],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    fp8_recipes = {name: r for name, r in recipes().items() if "suite" in r}
    return fit_main(argv, __doc__.splitlines()[0], fp8_recipes, fp8_block,
                    lambda got: f"fp8_gemm_efficiency_scale {got['scale']} fitted on {len(got['fitted_on'])} rows",
                    "compute", merge)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
