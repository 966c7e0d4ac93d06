"""What every calibration fit shares about the preset files: the recipes that say which rows fit which
figures (``calibration_recipes`` in ``echo_plan/data/validation_suites.yaml``), the rule that picks a
recipe's rows, and the block each preset file carries after ``MARKER``, written in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from echo_plan.errors import EchoPlanError
from echo_plan.files import read_text, write_atomic
from echo_plan.validation.registry import _registry

MARKER = "# --- calibration: written by `python -m echo_plan.calibrate.presets` from echo_plan/data/validation; do not edit ---"


SUITE_KEYS = ("suite", "a2a_suite", "host_suite")  # where a recipe names the suite it is fitted on


def fitted_on(recipe: dict[str, Any], suite: str) -> bool:
    """Whether ``recipe`` is fitted on ``suite`` (its compute, all-to-all or host figures)."""
    return suite in (recipe.get(k) for k in SUITE_KEYS)


def recipes() -> dict[str, Any]:
    return dict(_registry().get("calibration_recipes") or {})


def recipes_without(every: dict[str, Any], suite: str) -> dict[str, Any]:
    """The recipes as they would be if ``suite`` had never been measured (leave-one-suite-out): a recipe
    fitted on it takes its ``stand_in`` (another suite of the same GPU generation, with its own rule) or,
    without one, is dropped, so the presets it feeds get no such figures at all."""
    out: dict[str, Any] = {}
    for name, recipe in every.items():
        if fitted_on(recipe, suite):
            stand_in = recipe.get("stand_in")
            if stand_in and stand_in.get("suite") != suite and "suite" in recipe:
                out[name] = {**recipe, "suite": stand_in["suite"], "fit_rows": stand_in["fit_rows"],
                             "attention_rows": stand_in.get("attention_rows") or []}  # rows of the stand-in's suite
            continue
        out[name] = recipe
    return out


def rule_words(rule) -> str:
    """How a recipe chose its rows, in words (for the provenance a preset records)."""
    return "the named rows" if isinstance(rule, list) else f"rows by rule {rule}"


def fit_labels(rows, rule) -> set[str]:
    """The labels of the rows a recipe fits on: by a rule (even, smallest-two-per-model) or named (a list;
    names that are not among ``rows`` are left to the fit of the other precision, which may have them)."""
    simulable = [r for r in rows if not r.not_modelled]
    if isinstance(rule, list):
        return {r.label for r in simulable if r.label in set(map(str, rule))}
    if rule == "even":
        return {r.label for r in simulable[0::2]}
    if rule == "smallest-two-per-model":
        by: dict[str, list] = {}
        for r in simulable:
            by.setdefault(r.model.name, []).append(r)
        return {r.label for group in by.values() for r in sorted(group, key=lambda r: r.gpus)[:2]}
    raise EchoPlanError(f"unknown fit_rows rule {rule!r}: even, smallest-two-per-model, or a list of row labels")


def file_block(path: Path) -> dict[str, Any]:
    """The calibration block a preset file carries, as written (``from`` still the preset's name)."""
    doc = yaml.safe_load(read_text(path)) or {}
    return dict(doc.get("calibration") or {}) if isinstance(doc, dict) else {}


def write_block(path: Path, block: dict[str, Any]) -> None:
    text = read_text(path)
    head = text.split(MARKER)[0].rstrip("\n")
    body = yaml.safe_dump({"calibration": block}, sort_keys=False, width=110)
    write_atomic(path, f"{head}\n{MARKER}\n{body}")
