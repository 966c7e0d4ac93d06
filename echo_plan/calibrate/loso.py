"""Leave-one-suite-out: how wrong a prediction is on runs unlike the calibration (issue 31).

A suite's held-out rows are siblings of the rows that fitted the calibration: the same team, recipe,
release and scale range. A user's run is none of those, so the error they meet is the error of a suite
the calibration never saw. Here every validation suite is predicted by the calibration the shipped
recipes (``calibration_recipes`` in ``validation_suites.yaml``) would make had that suite never been
measured (``preset_files.recipes_without``): a recipe fitted on it takes its ``stand_in`` suite, or is
dropped. A suite that fed no recipe is predicted by the presets as shipped.

Each row's residual log(predicted / measured step time) then serves twice:

* the shipped ranges (``calibration.ranges`` with ``method: leave-one-suite-out``) pool the residuals of
  every suite on the presets' GPU generation, dense and mixture-of-experts models apart, by the stack
  each row was predicted with (``cost/ranges.py`` builds the interval);
* a suite's coverage is the share of its rows whose measured time falls inside the range the same rule
  builds from the *other* suites' residuals: the coverage a user on an unseen recipe gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from echo_plan.calibrate.blocks import build_blocks
from echo_plan.calibrate.preset_files import fitted_on, recipes, recipes_without
from echo_plan.calibrate.triton_attention_fit import fit_rate, rated_compute
from echo_plan.cost.compute import load_compute_constants
from echo_plan.cost.ranges import NOMINAL_COVERAGE, RangeMethod, RangeTable, prediction_range
from echo_plan.specs.software_kinds import AttentionLibrary
from echo_plan.specs import load_cluster, load_stack
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite


@dataclass(frozen=True, slots=True)
class LosoRow:
    label: str
    stack: Any  # the SoftwareSpec the row was predicted with
    moe: bool
    error: float  # (predicted - measured) / measured, in the suite's unit
    residual: float  # log(predicted / measured step time)
    in_range: bool | None = None  # inside the range made from the other suites' rows

    @property
    def group(self) -> tuple[bool, str]:
        return self.moe, self.stack.name


@dataclass(frozen=True, slots=True)
class LosoSuite:
    name: str
    cluster: str  # the suite's preset
    family: frozenset[str]  # the presets that share its calibration (one GPU generation)
    how: str  # how the suite was predicted: which calibration, made without it
    rows: tuple[LosoRow, ...]

    @property
    def mean_abs_error(self) -> float | None:
        return sum(abs(r.error) for r in self.rows) / len(self.rows) if self.rows else None

    @property
    def coverage(self) -> float | None:
        known = [r.in_range for r in self.rows if r.in_range is not None]
        return sum(known) / len(known) if known else None

    def as_json(self) -> dict[str, Any]:
        return {"suite": self.name, "calibration": self.how, "mean_abs_error": self.mean_abs_error,
                "coverage": self.coverage,
                "rows": [{"label": r.label, "error": r.error, "log_residual": r.residual, "in_range": r.in_range,
                          "stack": r.stack.name, "moe": r.moe} for r in self.rows]}


def family(preset: str) -> frozenset[str]:
    """The presets that receive the same compute calibration as ``preset`` (its GPU generation)."""
    for recipe in recipes().values():
        if "suite" in recipe and preset in recipe["presets"]:
            return frozenset(recipe["presets"])
    return frozenset({preset})


def fed_by(suite: str) -> list[str]:
    """The recipes fitted on ``suite``."""
    return [name for name, r in recipes().items() if fitted_on(r, suite)]


def predict_without(path: Path, vdir: Path, cache: Any = None,
                    progress: Callable[[str], None] | None = None) -> LosoSuite:
    """The suite at ``path`` predicted by the calibration made without it (from the suites in ``vdir``)."""
    suite = training_suite(path)
    cluster = load_cluster(suite.cluster)
    feeds = fed_by(suite.name)
    if feeds:
        if progress is not None:
            progress(f"{suite.name}: refitting {', '.join(feeds)} without it")
        blocks = build_blocks(vdir, cache, leave_out=suite.name, presets={suite.cluster})
        cal = blocks.get(suite.cluster, {})
        cluster = cluster.replace(calibration=cal)
        kept = recipes_without(recipes(), suite.name)
        how = "; ".join(f"{name} refitted on its stand-in {kept[name]['suite']}" if name in kept
                        else f"{name} dropped" for name in feeds)
        how += ": " + (_compute_words(cal) if "compute" in cal else "no compute calibration for this GPU (priors)")
    else:
        how = "the presets as shipped (no recipe was fitted on this suite)"
    transform, compute = None, None
    constants = load_compute_constants()
    if suite.name in constants.triton_attention_fitted_on:  # the Triton FlashAttention's rate was fitted on it
        stand_in = {k: v for k, v in constants.triton_attention_stand_in.items() if k != suite.name}
        if stand_in:
            rate, _ = fit_rate(vdir, stand_in)
            compute = rated_compute(cluster, rate)
            how += (f"; the Triton FlashAttention's rate refitted on its stand-in "
                    f"{', '.join(f'{len(v)} rows of {k}' for k, v in stand_in.items())}: {rate}")
        else:
            transform = _triton_prior
            how += "; the Triton FlashAttention at FlashAttention-2's rate (its fitted share dropped)"
    sim = RowSimulator(cluster, suite.stack, cache, model_settings=suite.model_settings, stack_transform=transform)
    rows = []
    for row in training_rows(suite):
        p = sim.predict(row, compute)
        if p.step_s is None:
            continue
        rows.append(LosoRow(row.label, sim.stack_for(row), sim.model_for(row).is_moe, p.error, p.log_residual))
    return LosoSuite(suite.name, suite.cluster, family(suite.cluster), how, tuple(rows))


def _triton_prior(stack: Any) -> Any:
    """``stack`` as it would be had the Triton FlashAttention's rate never been fitted: FlashAttention-2's kernels'
    rate, the prior of the share in compute.yaml (when no other suite ran this kernel: no stand-in)."""
    if stack.attention_library is AttentionLibrary.FLASH_ATTN_TRITON:
        return stack.replace(attention_library=AttentionLibrary.FLASH_ATTN_2)
    return stack


def shipped_loso(path: Path) -> LosoSuite:
    """The suite at ``path`` as the shipped ranges hold it: its rows' leave-one-suite-out residuals, which
    ``calibrate.presets --write`` stored in its preset's ``calibration.ranges`` (a test holds them equal to a fresh
    :func:`predict_without`), read back instead of predicted again. Its errors are in step time."""
    suite = training_suite(path)
    table = (load_cluster(suite.cluster).calibration or {}).get("ranges") or {}
    prefix, rows = f"{suite.name}: ", []
    for key, moe in (("by_stack", False), ("moe_by_stack", True)):
        for stack_name, pool in (table.get(key) or {}).items():
            stack = None
            for label, residual in zip(pool.get("rows") or (), pool.get("residuals") or ()):
                if label.startswith(prefix):
                    stack = stack if stack is not None else load_stack(stack_name)
                    rows.append(LosoRow(label[len(prefix):], stack, moe, math.exp(residual) - 1.0, residual))
    return LosoSuite(suite.name, suite.cluster, family(suite.cluster), "the shipped ranges (not predicted again)",
                     tuple(rows))


def _compute_words(cal: dict) -> str:
    def rows(block: dict) -> str:
        return ", ".join(f"{len(v)} rows of {k}" for k, v in (block.get("fitted_on") or {}).items())

    words = "compute fitted on " + rows(cal.get("compute") or {})
    for family, block in (cal.get("compute_by_kernels") or {}).items():
        words += f", {family} kernels' figures on {rows(block)}"
    return words


def _dense(s: LosoSuite) -> bool:
    return any(not r.moe for r in s.rows)


def carried(suites: Sequence[LosoSuite], keys: dict[str, str], leave_out: str | None = None) -> list[LosoSuite]:
    """The suites (but ``leave_out``) whose dense runs ran on a GPU (``keys``: preset -> ``GPUSpec.compute_key``) that
    no other suite of their calibration's presets ran dense rows on: left out, each was predicted by a calibration
    carried from another GPU and had a range made of other GPUs' rows, as a user's GPU of their own has."""
    return [t for t in suites if t.name != leave_out and _dense(t) and not any(
        u.name not in (t.name, leave_out) and u.cluster in t.family and _dense(u) and keys[u.cluster] == keys[t.cluster]
        for u in suites)]


def transfer_group(suites: Sequence[LosoSuite], keys: dict[str, str], leave_out: str | None = None) -> dict | None:
    """The dense rows of the :func:`carried` suites, as a range table's ``transfer`` group (None if there are none)."""
    dense = {s.name: [r for r in s.rows if not r.moe] for s in carried(suites, keys, leave_out)}
    if not dense:
        return None
    return {"residuals": [round(r.residual, 5) for rows in dense.values() for r in rows],
            "rows": [f"{name}: {r.label}" for name, rows in dense.items() for r in rows],
            "source": "leave-one-suite-out rows of suites whose GPU no other suite of their calibration ran: "
                      + "; ".join(f"{k} {len(v)}" for k, v in sorted(dense.items()))}


def gpu_keys(suites: Iterable[LosoSuite]) -> dict[str, str]:
    """Preset name -> its GPU's compute key, for the presets of ``suites``."""
    return {c: load_cluster(c).gpu.compute_key for c in sorted({s.cluster for s in suites})}


def pooled_ranges(suites: Sequence[LosoSuite], fam: frozenset[str], leave_out: str | None = None,
                  keys: dict[str, str] | None = None) -> RangeTable:
    """The range table of the presets in ``fam`` from the rows of every suite on them but ``leave_out``, with the GPUs
    its dense rows ran on and the rows of calibrations carried to another GPU (``transfer``, cost/ranges.py)."""
    keys = gpu_keys(suites) if keys is None else keys
    pools: dict[tuple[bool, str], list[tuple[str, float]]] = {}
    names: dict[tuple[bool, str], dict[str, int]] = {}
    gpus: set[str] = set()
    for s in suites:
        if s.name == leave_out or s.cluster not in fam:
            continue
        if _dense(s):
            gpus.add(keys[s.cluster])
        for r in s.rows:
            pools.setdefault(r.group, []).append((f"{s.name}: {r.label}", r.residual))
            count = names.setdefault(r.group, {})
            count[s.name] = count.get(s.name, 0) + 1
    data: dict[str, Any] = {"nominal_coverage": NOMINAL_COVERAGE, "method": RangeMethod.LEAVE_ONE_SUITE_OUT.value,
                            "gpus": sorted(gpus), "transfer": transfer_group(suites, keys, leave_out)}
    for (moe, stack), pool in sorted(pools.items()):
        source = "; ".join(f"{k} {n}" for k, n in sorted(names[(moe, stack)].items()))
        data.setdefault("moe_by_stack" if moe else "by_stack", {})[stack] = {
            "residuals": [round(x, 5) for _, x in pool], "rows": [label for label, _ in pool],
            "source": f"leave-one-suite-out rows: {source}"}
    return RangeTable.from_mapping(data)


def with_coverage(suites: Sequence[LosoSuite]) -> tuple[LosoSuite, ...]:
    """Each row marked inside or outside the range made from the other suites of its GPU generation."""
    out, keys = [], gpu_keys(suites)
    for s in suites:
        table = pooled_ranges(suites, s.family, leave_out=s.name, keys=keys).as_json()
        cluster = load_cluster(s.cluster)
        cluster = cluster.replace(calibration={**dict(cluster.calibration or {}), "ranges": table})
        rows = []
        for r in s.rows:
            rng = prediction_range(cluster, r.stack, r.moe)
            ratio = math.exp(-r.residual)  # measured / predicted
            rows.append(LosoRow(r.label, r.stack, r.moe, r.error, r.residual,
                                rng.low_factor <= ratio <= rng.high_factor))
        out.append(LosoSuite(s.name, s.cluster, s.family, s.how, tuple(rows)))
    return tuple(out)


def leave_one_suite_out(paths: Sequence[Path], vdir: Path, cache: Any = None,
                        progress: Callable[[str], None] | None = None,
                        shipped: Sequence[Path] = ()) -> tuple[LosoSuite, ...]:
    """Every training suite at ``paths`` predicted without itself, each row marked against the range made from the
    other suites, those at ``shipped`` included as the shipped ranges hold them (:func:`shipped_loso`)."""
    return with_coverage([predict_without(p, vdir, cache, progress) for p in paths]
                         + [shipped_loso(p) for p in shipped])


@dataclass(frozen=True, slots=True)
class Overall:
    rows: int
    mean_abs_error: float | None
    coverage: float | None


def overall(suites: Iterable[LosoSuite], skip: Iterable[str] = ()) -> Overall:
    """Pooled over every row of the suites (but ``skip``)."""
    skip = set(skip)
    rows = [r for s in suites if s.name not in skip for r in s.rows]
    known = [r.in_range for r in rows if r.in_range is not None]
    return Overall(len(rows), sum(abs(r.error) for r in rows) / len(rows) if rows else None,
                   sum(known) / len(known) if known else None)
