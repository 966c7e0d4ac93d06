"""The command line shared by the figures fitted on named validation rows (``fp8_fit``, ``a2a_fit``):
fit each recipe's figure, print it with every row's residual (fitted or held out), and with
``--write`` merge it into the calibration of the recipe's cluster presets."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


def fit_main(argv: list[str] | None, description: str, recipes: dict[str, dict], fit: Callable[..., Any],
             headline: Callable[[dict], str], section: str, merge: Callable[[dict, dict], dict]) -> int:
    """``fit(recipe, vdir, cluster, cache, progress)`` gives the figure (a dict with ``residuals`` and
    ``fitted_on``) or None; ``headline`` says it in one line; ``merge`` puts it into the presets'
    ``calibration[section]``."""
    from echo_plan.calibrate.presets import write_block
    from echo_plan.specs import load_cluster
    from echo_plan.specs.presets import clusters_dir
    from echo_plan.trace.cache import TraceCache
    from echo_plan.validation.megatron import validation_dir

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
            for preset in recipe["presets"]:
                block = dict(load_cluster(preset).calibration or {})
                block[section] = merge(dict(block.get(section) or {}), got)
                write_block(clusters_dir() / f"{preset}.yaml", block)
    return 0
