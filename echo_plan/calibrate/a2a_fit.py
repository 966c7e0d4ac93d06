"""Fitting the share of the network an all-to-all reaches inside a training step, on named rows.

    python -m echo_plan.calibrate.a2a_fit            # fit and print, per all-to-all recipe
    python -m echo_plan.calibrate.a2a_fit --write    # and add the figure to the presets' calibration

NCCL's own model (and nccl-tests' alltoall_perf) gives an all-to-all one NIC per GPU across
servers. Inside a Megatron-Core MoE step with the all-to-all dispatcher the exchange reaches less,
and no published measurement says how much (``echo_plan/data/nccl.yaml``). A recipe
(``calibration_recipes`` with ``a2a_suite`` in ``validation_suites.yaml``) names the rows that fit
``all_to_all_net_efficiency``; every other row of the suite stays held out. The figure solves
"mean log residual of the fitted rows = 0" by bisection: the predicted step falls as the share
rises. The fit runs after the compute calibration (``calibrate.presets``) and on top of it; it
changes nothing but the all-to-all's network tier, so the dense suites' rows are untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from echo_plan.calibrate.preset_files import recipes
from echo_plan.calibrate.row_fit import bisect_figure, fit_main, fit_record, named_rows, simulator_residuals
from echo_plan.validation.registry import training_rows, training_suite

SHARE_RANGE = (0.2, 1.0)
KEY = "all_to_all_net_efficiency"


def with_share(cluster: Any, share: float) -> Any:
    """``cluster`` with its NCCL calibration's all-to-all network share set to ``share``."""
    cal = dict(cluster.calibration or {})
    nccl = dict(cal.get("nccl") or {})
    nccl["params"] = {**dict(nccl.get("params") or {}), KEY: share}
    cal["nccl"] = nccl
    return cluster.replace(calibration=cal)


def a2a_fit(rows: Sequence[Any], fit_labels: Sequence[str], cluster: Any, stack_name: str,
            model_settings: Any = None, cache: Any = None,
            progress: Callable[[int, str], None] | None = None, iterations: int = 18) -> dict[str, Any]:
    """The fitted share and each modelled row's error: {share, fitted_on, held_out, residuals}."""
    modelled, fit = named_rows(rows, fit_labels, "all-to-all fit")
    residuals = simulator_residuals(lambda share: with_share(cluster, share), stack_name, model_settings, cache)

    lo, hi = SHARE_RANGE
    if sum(residuals(hi, fit)) > 0:  # too slow even at NCCL's own figure: nothing to fit
        share = hi
    else:
        share = bisect_figure(lambda s: sum(residuals(s, fit)) / len(fit), lo, hi, iterations, progress,
                              "all-to-all network share", 3)
    return fit_record("share", share, fit, modelled, residuals(share, modelled))


def a2a_block(recipe: dict, vdir: Path, cluster: Any, cache: Any = None, progress=None) -> dict[str, Any]:
    """The fit of one ``a2a_suite`` recipe on ``cluster`` (its compute calibration already in place)."""
    suite = training_suite(vdir / f"{recipe['a2a_suite']}.csv")
    rows = training_rows(suite)
    got = a2a_fit(rows, [str(x) for x in recipe["fit_rows"]], cluster, suite.stack, suite.model_settings, cache,
                  progress)
    return {"suite": suite.name, "stack": suite.stack, **got}


def merge(nccl: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """An NCCL calibration block with the fitted share and where it comes from."""
    out = dict(nccl)
    out["params"] = {**dict(out.get("params") or {}), KEY: got["share"]}
    prov = dict(out.get("provenance") or {})
    prov["all_to_all_fit"] = {
        "source": f"{got['suite']}.csv, the named rows; fitted by python -m echo_plan.calibrate.a2a_fit",
        "fitted_on": {got["suite"]: list(got["fitted_on"])},
        "held_out": list(got["held_out"]),
        "residuals": dict(got["residuals"]),
    }
    if got.get("stack"):
        prov["all_to_all_fit"]["stack"] = got["stack"]
    out["provenance"] = prov
    return out


def keep_share(record: dict[str, Any], calibration: Any) -> dict[str, Any]:
    """An NCCL calibration record refitted from nccl-tests logs, with the all-to-all shares (and their
    provenance) the cluster already carried: nccl-tests cannot see what a training step gets, so a
    refit of the collectives keeps the share fitted on training steps."""
    old = (calibration or {}).get("nccl") or {}
    keep = {k: v for k, v in (old.get("params") or {}).items() if k.startswith("all_to_all_")}
    if not keep:
        return record
    prov = dict(record.get("provenance") or {})
    fit = (old.get("provenance") or {}).get("all_to_all_fit")
    if fit is not None:
        prov["all_to_all_fit"] = fit
    return {**record, "params": {**dict(record.get("params") or {}), **keep}, "provenance": prov}


def a2a_recipes() -> dict[str, dict]:
    return {name: r for name, r in recipes().items() if "a2a_suite" in r}


def main(argv: list[str] | None = None) -> int:
    return fit_main(argv, __doc__.splitlines()[0], a2a_recipes(), a2a_block,
                    lambda got: f"{KEY} {got['share']} fitted on {', '.join(got['fitted_on'])}", "nccl", merge)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
