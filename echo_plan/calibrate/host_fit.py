"""Fitting the host's issue time after an MoE dispatcher's synchronisation, on named rows.

    python -m echo_plan.calibrate.host_fit            # fit and print, per host recipe
    python -m echo_plan.calibrate.host_fit --write    # and add the figure to the presets' calibration

After Megatron-Core's dropless dispatcher waits for the token counts, the GPU runs only what the host
issues (``replay/host.py``). How long the host takes per kernel depends on the host CPU, on Python
and PyTorch's eager dispatch and on how many small ops the framework launches around each kernel the
trace records; no published measurement says. A recipe (``calibration_recipes`` with ``host_suite``
in ``validation_suites.yaml``) names the rows that fit ``calibration.host.op_us`` (microseconds per
traced kernel); every other row stays held out. The figure solves "mean log residual of the fitted
rows = 0" by bisection: the predicted step grows with it. The fit runs on top of the compute and
network calibration, before the all-to-all share (``calibrate.blocks``); it changes nothing but the MoE
layers' forward after the synchronisation, so dense models are untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from echo_plan.calibrate.preset_files import recipes
from echo_plan.calibrate.row_fit import bisect_figure, fit_main, fit_record, named_rows, simulator_residuals
from echo_plan.validation.registry import training_rows, training_suite

OP_US_RANGE = (5.0, 2000.0)
KEY = "op_us"


def with_host(cluster: Any, op_us: float) -> Any:
    """``cluster`` with its host issue time set to ``op_us`` microseconds per traced kernel."""
    cal = dict(cluster.calibration or {})
    cal["host"] = {**dict(cal.get("host") or {}), KEY: op_us}
    return cluster.replace(calibration=cal)


def host_fit(rows: Sequence[Any], fit_labels: Sequence[str], cluster: Any, stack_name: str,
             model_settings: Any = None, cache: Any = None,
             progress: Callable[[int, str], None] | None = None, iterations: int = 16) -> dict[str, Any]:
    """The fitted issue time and each modelled row's error: {op_us, fitted_on, held_out, residuals}."""
    modelled, fit = named_rows(rows, fit_labels, "host fit")
    residuals = simulator_residuals(lambda op_us: with_host(cluster, op_us), stack_name, model_settings, cache)

    lo, hi = OP_US_RANGE
    if sum(residuals(lo, fit)) > 0:  # too slow even with the host nearly free: nothing to fit
        op_us = lo
    else:  # bisect on the host's rate (1 / op_us): a higher rate runs faster, as bisect_figure expects
        rate = bisect_figure(lambda r: sum(residuals(1.0 / r, fit)) / len(fit), 1.0 / hi, 1.0 / lo, iterations,
                             progress, "host issue rate (1/us)", 6)
        op_us = round(1.0 / rate, 1)
    return fit_record(KEY, op_us, fit, modelled, residuals(op_us, modelled))


def host_block(recipe: dict, vdir: Path, cluster: Any, cache: Any = None, progress=None) -> dict[str, Any]:
    """The fit of one ``host_suite`` recipe on ``cluster`` (its compute and network calibration in place)."""
    suite = training_suite(vdir / f"{recipe['host_suite']}.csv")
    got = host_fit(training_rows(suite), [str(x) for x in recipe["fit_rows"]], cluster, suite.stack,
                   suite.model_settings, cache, progress)
    return {"suite": suite.name, "stack": suite.stack, **got}


def merge(host: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """A host calibration block with the fitted issue time and where it comes from."""
    return {**dict(host), KEY: got[KEY], "provenance": {
        "source": f"{got['suite']}.csv, the named rows; fitted by python -m echo_plan.calibrate.host_fit",
        "stack": got.get("stack", ""),
        "fitted_on": {got["suite"]: list(got["fitted_on"])},
        "held_out": list(got["held_out"]),
        "residuals": dict(got["residuals"]),
    }}


def host_recipes() -> dict[str, dict]:
    return {name: r for name, r in recipes().items() if "host_suite" in r}


def main(argv: list[str] | None = None) -> int:
    return fit_main(argv, __doc__.splitlines()[0], host_recipes(), host_block,
                    lambda got: f"host {KEY} {got[KEY]} fitted on {', '.join(got['fitted_on'])}", "host", merge)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
