"""The calibration blocks the shipped presets carry, made from the public measurements.

The recipes (``calibration_recipes`` in ``echo_plan/data/validation_suites.yaml``) say which
rows fit which figures and which presets receive them. The network recipe runs first, so the
compute fits see the calibrated collectives; the host recipe (``calibrate.host_fit``) runs on top of
the compute calibration, and the all-to-all recipe (``calibrate.a2a_fit``) last, on top of both.
``build_blocks(leave_out=...)`` makes them as they would be had one suite never been measured
(``calibrate/loso.py``).
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any

from echo_plan import __version__
from echo_plan.calibrate.a2a_fit import a2a_block, merge as merge_a2a
from echo_plan.calibrate.fp8_fit import FIGURES, fp8_block, is_fp8, merge
from echo_plan.calibrate.host_fit import host_block, merge as merge_host
from echo_plan.calibrate.preset_files import fit_labels, recipes, recipes_without, rule_words
from echo_plan.cost.calibration import COMPUTE_INFO, ComputeCalibration
from echo_plan.errors import EchoPlanError
from echo_plan.interop.nccl_tests import parse_nccl_tests
from echo_plan.specs import load_cluster
from echo_plan.specs.presets import preset_calibration
from echo_plan.validation.registry import training_rows, training_suite

__all__ = ["build_blocks", "compute_block", "network_block"]


def network_block(recipe: dict, vdir: Path) -> dict[str, Any]:
    from echo_plan.calibrate.nccl_fit import fit_nccl  # deferred: loads numpy

    folder = vdir / recipe["logs"]
    cluster = load_cluster(recipe["cluster"]).replace(calibration={})
    logs = sorted((parse_nccl_tests(p) for p in sorted(folder.glob("*.log"))), key=lambda lg: lg.nranks)
    if not logs:
        raise EchoPlanError(f"no nccl-tests logs in {folder}")
    nvlink = fit_nccl(logs, cluster, fit_max_gpus=cluster.gpus_per_node)
    sizes = recipe["network_fit_sizes"]
    below, above = int(sizes["below_bytes"]), int(sizes["from_bytes"])
    multi = [lg for lg in logs if lg.nranks > cluster.gpus_per_node]
    net = fit_nccl(multi, cluster, base=nvlink.params, network_only=True,
                   size_filter=lambda s: s < below or s >= above)
    # nccl-tests cannot see the all-to-all share a training step reaches (calibrate/a2a_fit.py fits it)
    params = {k: v for k, v in net.values.items() if not k.startswith("all_to_all_")}
    return {"params": params, "provenance": {
        "tool": f"echo-plan {__version__} python -m echo_plan.calibrate.presets",
        "date": _dt.date.today().isoformat(),
        "logs": [f"{recipe['logs']}/{lg.name}" for lg in logs],
        "nvlink_fit_logs": list(nvlink.fit_logs),
        "network_fit": {"logs": [lg.name for lg in multi], "below_bytes": below, "from_bytes": above},
        "held_out": f"{', '.join(lg.name for lg in multi)}: sizes from {below} B to below {above} B",
        "error_per_log": net.log_summary(),
    }}


def compute_block(recipe: dict, vdir: Path, cluster: Any, cache: Any = None, progress=None,
                  low_precision: dict[str, float] | None = None, figures: tuple[str, ...] | None = None,
                  base: ComputeCalibration | None = None) -> dict[str, Any]:
    """The compute figures of ``recipe``, fitted on its bf16 rows (fp8 rows fit their own figure, fp8_fit.py)
    and on its ``attention_rows``: rows of any precision named because their long sequences make the
    fused-attention figure visible (their GEMMs at the low-precision figures ``low_precision``, else the priors).
    ``figures``: those fitted (default: every one with a prior), the others at ``base``'s values."""
    from echo_plan.calibrate.steps import calibrate_rows, calibration_block  # deferred: loads numpy
    from echo_plan.calibrate.steps_fit import DEFAULT_FIT  # deferred: loads numpy

    suite = training_suite(vdir / f"{recipe['suite']}.csv")
    every = training_rows(suite)
    attention = {str(x) for x in recipe.get("attention_rows") or ()}
    unknown = sorted(attention - {r.label for r in every if not r.not_modelled})
    if unknown:
        raise EchoPlanError(f"calibration recipe for {suite.name}: attention_rows names {unknown[0]!r}, which is not "
                            f"a modelled row of {suite.path.name}")
    rows = [r for r in every if not is_fp8(r) or r.label in attention]
    fit = fit_labels(rows, recipe["fit_rows"]) | attention
    held = {r.label for r in rows if not r.not_modelled} - fit
    cal = calibrate_rows(rows, cluster, suite.stack, held, fit=figures or DEFAULT_FIT,
                         model_settings=suite.model_settings, cache=cache, progress=progress,
                         fixed=base if base is not None else ComputeCalibration(**(low_precision or {})))
    words = rule_words(recipe["fit_rows"]) + (f" and {len(attention)} named for attention" if attention else "")
    return calibration_block(cal, suite.name, f"{suite.path.name}, {words}", dict(cluster.calibration or {}))


COMPUTE_FIGURES = ("gemm_efficiency_scale", "attention_efficiency_scale", "memory_bandwidth_scale", "kernel_overhead_us")


def inherited_compute(preset: str, fitted: dict[str, Any] | None = None) -> dict[str, Any]:
    """The compute figures of ``preset`` as another preset's starting point (an fp8-only recipe's): those just
    ``fitted`` for it in the same run where there are any, else the ones its file ships."""
    got = (fitted or {}).get("compute") or preset_calibration(preset).get("compute") or {}
    out: dict[str, Any] = {k: got[k] for k in COMPUTE_FIGURES if k in got}
    out["source"] = f"the {preset} preset's compute figures (fitted on its own suites: {preset}.yaml says which)"
    out["fitted_on"] = {}
    return out


def kernels_block(recipe: dict, vdir: Path, blocks: dict[str, dict[str, Any]], cache: Any = None,
                  progress=None) -> dict[str, Any]:
    """A ``compute_by_kernels`` entry: the figures ``fit_figures`` of ``recipe`` fitted on its rows (a suite run
    with a stack of the recipe's kernel family), the others at the compute figures ``blocks`` gives the suite's
    cluster in this run; only the fitted figures and their provenance are kept (the rest follow the compute block)."""
    from echo_plan.calibrate.steps_fit import DEFAULT_FIT  # deferred: loads numpy

    suite = training_suite(vdir / f"{recipe['suite']}.csv")
    name = suite.cluster if suite.cluster in blocks else recipe["presets"][0]
    cluster = load_cluster(name).replace(calibration=blocks.get(name, {}))
    figures = tuple(recipe.get("fit_figures") or DEFAULT_FIT)
    got = compute_block(recipe, vdir, cluster, cache, progress, figures=figures,
                        base=ComputeCalibration.of(cluster))["compute"]
    return {k: v for k, v in got.items() if k in figures or k in COMPUTE_INFO}


def build_blocks(vdir: Path, cache: Any = None, progress=None, leave_out: str | None = None,
                 presets: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Preset name -> its whole calibration block; with ``leave_out``, as if that suite had never been
    measured (``preset_files.recipes_without``); with ``presets``, only the recipes that feed those."""
    every = recipes() if leave_out is None else recipes_without(recipes(), leave_out)
    if presets is not None:
        every = {n: r for n, r in every.items() if set(r["presets"]) & presets}
    blocks: dict[str, dict[str, Any]] = {}
    for name, recipe in recipes().items():  # a recipe left out with its suite: its presets keep what they inherit
        if name not in every and recipe.get("inherit") and (presets is None or set(recipe["presets"]) & presets):
            for preset in recipe["presets"]:
                blocks[preset] = dict(preset_calibration(recipe["inherit"]))
    for name, recipe in every.items():
        if "logs" in recipe:
            nccl = network_block(recipe, vdir)
            for preset in recipe["presets"]:
                blocks.setdefault(preset, {})["nccl"] = nccl
    # an fp8-only recipe starts from the figures another recipe fits in this run: those first
    for name, recipe in sorted(every.items(), key=lambda item: bool(item[1].get("fp8_only"))):
        if "suite" not in recipe or "kernels" in recipe:
            continue
        first = recipe["presets"][0]
        cluster = load_cluster(first).replace(calibration=blocks.get(first, {}))
        if recipe.get("fp8_only"):  # no bf16 run to fit on: the inherited compute figures, the fp8 rate fitted
            block = {"compute": inherited_compute(recipe["inherit"], blocks.get(recipe["inherit"]))}
        else:
            block = compute_block(recipe, vdir, cluster, cache, progress)

        fp8 = fp8_block(recipe, vdir, cluster.replace(calibration={**blocks.get(first, {}), **block}), cache, progress)
        if recipe.get("attention_rows") and fp8 is not None and not recipe.get("fp8_only"):
            # the attention rows' GEMMs ran at the low-precision figures, which the first fit took at their priors:
            # once more with the figures just fitted (one round; the GEMM figures hardly move the attention rows)
            scales = {FIGURES[k]: f["scale"] for k, f in fp8["fits"].items()}
            block = compute_block(recipe, vdir, cluster, cache, progress, low_precision=scales)
            fp8 = fp8_block(recipe, vdir, cluster.replace(calibration={**blocks.get(first, {}), **block}), cache,
                            progress)
        if fp8 is not None:
            block = {**block, "compute": merge(block["compute"], fp8)}
        for preset in recipe["presets"]:
            merged = dict(blocks.get(preset, {}))
            merged["compute"] = block["compute"]
            if "ranges" in block:
                merged["ranges"] = block["ranges"]
            if recipe.get("inherit"):  # what the recipe does not fit (ranges, collectives) from that preset
                merged = {"from": recipe["inherit"], **merged}
            blocks[preset] = merged

    # a kernel family's figures, fitted on runs of its stacks on top of the compute figures just fitted
    for name, recipe in every.items():
        if "kernels" in recipe:
            got = kernels_block(recipe, vdir, blocks, cache, progress)
            for preset in recipe["presets"]:
                merged = dict(blocks.get(preset, {}))
                merged["compute_by_kernels"] = {**(merged.get("compute_by_kernels") or {}), recipe["kernels"]: got}
                blocks[preset] = merged
    # the figures fitted on named rows, each on top of what its presets already carry: the host's issue time on the
    # compute calibration, then the all-to-all share on both
    _named_fits(blocks, every, "host_suite", host_block, "host", merge_host, vdir, cache, progress)
    _named_fits(blocks, every, "a2a_suite", a2a_block, "nccl", merge_a2a, vdir, cache, progress)
    return blocks


def _named_fits(blocks: dict[str, dict[str, Any]], every: dict[str, Any], suite_key: str, fit_block, section: str,
                merge_fn, vdir: Path, cache: Any, progress) -> None:
    """Each recipe with ``suite_key``: its figure fitted on the first preset it feeds (the cluster of its suite) as
    ``blocks`` has it, merged into ``section`` of every preset it feeds."""
    for recipe in every.values():
        if suite_key not in recipe:
            continue
        first = recipe["presets"][0]
        got = fit_block(recipe, vdir, load_cluster(first).replace(calibration=blocks.get(first, {})), cache, progress)
        for preset in recipe["presets"]:
            merged = dict(blocks.get(preset, {}))
            merged[section] = merge_fn(dict(merged.get(section) or {}), got)
            blocks[preset] = merged
