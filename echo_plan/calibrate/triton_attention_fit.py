"""The Triton FlashAttention's rate relative to FlashAttention-2 (compute.yaml ``flash_attn_triton``), fitted on named rows.

flash-attn 1.x's Triton kernel (llm-foundry's ``attn_impl: triton``) has no published kernel benchmark that could be
read here, so its share of FlashAttention-2's rate is the one figure fitted on validation rows: the rows compute.yaml
names (``fitted_on``), where attention is most of the step; every other row of their suite is held out. The figure
is the geometric bisection that zeroes the mean log residual of the named rows, each predicted on its suite's
cluster preset with its stack (whose ``attention_library`` must be ``flash-attn-triton``). Leave-one-suite-out
(calibrate/loso.py) fits it the same way on the ``stand_in`` rows when the suite of ``fitted_on`` is left out.

    python -m echo_plan.calibrate.triton_attention_fit [--write]

prints the figure and every row's error at it; ``--write`` puts the figure into echo_plan/data/compute.yaml.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from datetime import date
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from echo_plan.calibrate.row_fit import bisect_figure, log_residuals, named_rows
from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.cost.kernel_db import compute_model_for
from echo_plan.errors import EchoPlanError
from echo_plan.files import write_atomic
from echo_plan.specs.software_kinds import AttentionLibrary
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite

LOW, HIGH, ITERATIONS = 0.2, 1.5, 12
RATE_LINE = re.compile(r"^(  rate_vs_flash_attn_2: )[0-9.]+$", re.MULTILINE)
SOURCE_LINE = re.compile(r'^(  source: "fitted )\d{4}-\d{2}-\d{2}( on the rows above)', re.MULTILINE)


def rated_compute(cluster: Any, rate: float) -> Any:
    """The compute model of ``cluster`` (its calibration applied) with the Triton FlashAttention at ``rate``."""
    base = calibrated_constants(ComputeCalibration.of(cluster), load_compute_constants())
    return compute_model_for(cluster, fallback=AnalyticalComputeModel(dataclasses.replace(base, triton_attention_rate=rate)))


def suite_residuals(suite_name: str, vdir: Path, labels: Sequence[str]) -> tuple[list, list, Callable[[float, list], list[float]]]:
    """(the suite's modelled rows, those named ``labels``, ``residuals(rate, rows)``: each row's log residual at
    that rate)."""
    suite = training_suite(vdir / f"{suite_name}.csv")
    rows, fit = named_rows(training_rows(suite), labels, f"compute.yaml flash_attn_triton, suite {suite_name}")
    # one simulator for every rate: its memo keeps the traces, and keys layer timings by the compute model itself
    sim = RowSimulator(suite.cluster, suite.stack, model_settings=suite.model_settings)
    if sim.stack_for(fit[0]).attention_library is not AttentionLibrary.FLASH_ATTN_TRITON:
        raise EchoPlanError(f"suite {suite_name}: its stack {suite.stack} does not run the Triton FlashAttention")

    def residuals(rate: float, which: list) -> list[float]:
        compute = rated_compute(sim.base, rate)
        return log_residuals(lambda r: sim.predict(r, compute), which)
    return rows, fit, residuals


def fit_rate(vdir: Path, named: Mapping[str, Sequence[str]] | None = None,
             progress: Callable[[int, str], None] | None = None) -> tuple[float, dict]:
    """(the rate fitted on the ``named`` rows per suite, compute.yaml's ``fitted_on`` by default; the suites'
    residual functions, for :func:`row_errors`)."""
    named = load_compute_constants().triton_attention_fitted_on if named is None else named
    if not named:
        raise EchoPlanError("compute.yaml names no rows for flash_attn_triton (fitted_on)")
    suites = {name: suite_residuals(name, vdir, labels) for name, labels in named.items()}

    def mean(rate: float) -> float:
        values = [x for _, fit, res in suites.values() for x in res(rate, fit)]
        return sum(values) / len(values)

    return bisect_figure(mean, LOW, HIGH, ITERATIONS, progress, "Triton FlashAttention rate", 3), suites


def row_errors(rate: float, suites: dict) -> dict[str, float]:
    """Every row's error (predicted / measured - 1) at ``rate``, labelled ``suite: row``."""
    return {f"{name}: {row.label}": math.exp(x) - 1.0
            for name, (rows, _, res) in suites.items() for row, x in zip(rows, res(rate, rows))}


def write_rate(path: Path, rate: float) -> None:
    """Replace the rate (and the fit's date) in compute.yaml, nothing else."""
    text = path.read_text(encoding="utf-8")
    new, n = RATE_LINE.subn(lambda m: f"{m.group(1)}{rate}", text)
    if n != 1:
        raise EchoPlanError(f"{path}: expected one 'rate_vs_flash_attn_2:' line under flash_attn_triton, found {n}")
    new = SOURCE_LINE.sub(lambda m: f"{m.group(1)}{date.today().isoformat()}{m.group(2)}", new)
    write_atomic(path, new)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Fit the Triton FlashAttention's rate relative to FlashAttention-2.")
    ap.add_argument("--write", action="store_true", help="put the figure into echo_plan/data/compute.yaml")
    ap.add_argument("--validation-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        rate, suites = fit_rate(args.validation_dir or validation_dir(),
                                progress=lambda i, msg: print(f"  [{i + 1}/{ITERATIONS}] {msg}", file=sys.stderr))
        errors = row_errors(rate, suites)
        fitted = {f"{s}: {label}" for s, labels in load_compute_constants().triton_attention_fitted_on.items()
                  for label in labels}
        print(f"flash_attn_triton.rate_vs_flash_attn_2: {rate}")
        for label, err in errors.items():
            print(f"  {err:+7.1%}  {label}{'  (fitted)' if label in fitted else ''}")
        if args.write:
            path = Path(__file__).resolve().parents[1] / "data" / "compute.yaml"
            write_rate(path, rate)
            print(f"wrote {path}")
    except EchoPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
