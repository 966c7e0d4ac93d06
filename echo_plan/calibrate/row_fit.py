"""What the figures fitted on named validation rows share (``fp8_fit``, ``a2a_fit``): each row's log
residual, the geometric bisection that zeroes their mean on the fitted rows, the result record, and
the command line (fit each recipe's figure, print it with every row's residual, and with ``--write``
merge it into the calibration of the recipe's cluster presets)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from echo_plan.calibrate.preset_files import file_block, write_block
from echo_plan.errors import EchoPlanError
from echo_plan.specs import load_cluster
from echo_plan.specs.presets import clusters_dir
from echo_plan.trace.cache import TraceCache
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator


def named_rows(rows: Sequence[Any], fit_labels: Sequence[str], what: str) -> tuple[list, list]:
    """(the modelled rows, those of them named to fit); a name that is not a modelled row is an error."""
    modelled = [r for r in rows if not r.not_modelled]
    fit = [r for r in modelled if r.label in set(fit_labels)]
    missing = sorted(set(fit_labels) - {r.label for r in fit})
    if missing or not fit:
        raise EchoPlanError(f"{what}: no modelled row labelled {', '.join(missing) or 'at all'}")
    return modelled, fit


def simulator_residuals(cluster_with: Callable[[float], Any], stack_name: str, model_settings: Any,
                        cache: Any) -> Callable[[float, Sequence[Any]], list[float]]:
    """``residuals(figure, rows)``: each row's log residual on ``cluster_with(figure)``."""
    def residuals(figure: float, which: Sequence[Any]) -> list[float]:
        sim = RowSimulator(cluster_with(figure), stack_name, cache, model_settings=model_settings)
        return log_residuals(sim.predict, which)
    return residuals


def log_residuals(predict: Callable[[Any], Any], rows: Sequence[Any]) -> list[float]:
    """log(predicted / measured step) of each row; a row the simulator cannot predict is an error."""
    out = []
    for r in rows:
        p = predict(r)
        if p.step_s is None:
            raise EchoPlanError(f"row {r.label!r}: {p.problem}")
        out.append(math.log(p.step_s / r.measured_step_s))
    return out


def bisect_figure(mean_residual: Callable[[float], float], lo: float, hi: float, iterations: int,
                  progress: Callable[[int, str], None] | None, what: str, digits: int) -> float:
    """The figure in [lo, hi] at which the mean log residual is zero, by geometric bisection (a higher
    figure runs faster: a positive mean, too slow, moves up), rounded to ``digits``."""
    for i in range(iterations):
        mid = math.sqrt(lo * hi)
        mean = mean_residual(mid)
        if progress is not None:
            progress(i, f"{what} {mid:.4f}: mean log residual {mean:+.4f}")
        lo, hi = (mid, hi) if mean > 0 else (lo, mid)
    return round(math.sqrt(lo * hi), digits)


def fit_record(key: str, value: float, fit: Sequence[Any], rows: Sequence[Any], residuals: Sequence[float]) -> dict:
    """{key: value, fitted_on, held_out, residuals (predicted / measured - 1 per row)}."""
    fitted = {r.label for r in fit}
    return {key: value, "fitted_on": [r.label for r in fit], "held_out": [r.label for r in rows if r.label not in fitted],
            "residuals": {r.label: round(math.exp(x) - 1, 4) for r, x in zip(rows, residuals)}}


def fit_main(argv: list[str] | None, description: str, recipes: dict[str, dict], fit: Callable[..., Any],
             headline: Callable[[dict], str], section: str, merge: Callable[[dict, dict], dict]) -> int:
    """``fit(recipe, vdir, cluster, cache, progress)`` gives the figure (a dict with ``residuals`` and
    ``fitted_on``) or None; ``headline`` says it in one line; ``merge`` puts it into the presets'
    ``calibration[section]``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--write", action="store_true", help="add the figure to clusters/*.yaml")
    ap.add_argument("--validation-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    vdir = args.validation_dir or validation_dir()
    for name, recipe in recipes.items():
        cluster = load_cluster(recipe["presets"][0])
        got = fit(recipe, vdir, cluster, TraceCache(None), progress=lambda i, m: print(f"  {m}", flush=True))
        if got is None:
            continue
        print(f"{name}: {headline(got)}")
        width = max(map(len, got["residuals"]), default=0)
        for label, err in got["residuals"].items():
            print(f"  {label:{width}s} {err:+.1%} {'fitted' if label in got['fitted_on'] else 'held out'}")
        if args.write:
            for preset in recipe["presets"]:  # the file's own block: a loaded preset's ``from`` is resolved
                path = clusters_dir() / f"{preset}.yaml"
                block = file_block(path)
                block[section] = merge(dict(block.get(section) or {}), got)
                write_block(path, block)
    return 0
