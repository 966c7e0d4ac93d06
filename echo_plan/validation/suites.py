"""Running validation suites: predicted vs measured per row, held-out errors, range coverage.

* Training suites (``registry.training_suite``): each row is simulated with its suite's cluster
  preset and software stack (``predict.py``) exactly as ``simulate`` would for a user. A row is
  *held out* unless the preset's calibration was fitted on it (the preset records those rows in
  ``calibration.compute.fitted_on``, and the all-to-all fit's in
  ``calibration.nccl.provenance.all_to_all_fit``). A suite passes when its held-out rows are
  within the suite's mean and max tolerances. Range coverage is the leave-one-out share of held-out rows
  whose measured time falls inside the range built from the other held-out rows' residuals
  (``cost/ranges.py``), against the nominal 80%.
* Collective suites (``nccl-tests/<cluster>/``): the NCCL model refitted on the logs of one
  server (from the preset's own figures) must predict the larger logs within ``held_out_max``,
  and the shipped preset as it is must be within ``preset_mean`` (mean per log) on every log.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from echo_plan.errors import EchoPlanError
from echo_plan.validation.registry import collective_suite, training_rows, training_suite
from echo_plan.validation.results import PEAK_TOLERANCE, RowResult, SuiteResult
from echo_plan.cost.ranges import loo_coverage
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.rows import TFLOPS_UNIT
from echo_plan.cost.collectives import params_from_calibration
from echo_plan.cost.compute import load_compute_constants
from echo_plan.interop.nccl_tests import parse_nccl_tests
from echo_plan.specs import load_cluster
from echo_plan.cost.expert_exchange import load_exchange_efficiency
from echo_plan.specs.software_kinds import DeepEPRelease
from echo_plan.validation.exchange import CLUSTER as EXCHANGE_CLUSTER, DEEPEP_FILES, predict, read_deepep

NCCL_MIN_SIZE = 1 << 20  # held-out collective rows: 1 MiB and up (below, latency jitter dominates)


@dataclass(frozen=True, slots=True)
class SuiteRef:
    name: str
    kind: str
    path: Path


def discover(dirs: list[Path]) -> list[SuiteRef]:
    """Every suite in the given folders, in a stable order; a suite of the same name in a later
    folder replaces the earlier one (an added folder overrides a shipped suite)."""
    refs: dict[str, SuiteRef] = {}
    for d in dirs:
        for csv_path in sorted(d.glob("*.csv")):
            refs[csv_path.stem] = SuiteRef(csv_path.stem, "training", csv_path)
        for name, (release, _) in EXCHANGE_SUITES.items():  # one suite per DeepEP release, from its own table
            if (d / DEEPEP_FILES[release]).is_file():
                refs[name] = SuiteRef(name, "exchange", d / DEEPEP_FILES[release])
        nccl_root = d / "nccl-tests"
        if nccl_root.is_dir():
            for sub in sorted(p for p in nccl_root.iterdir() if p.is_dir() and any(p.glob("*.log"))):
                refs[f"nccl-tests/{sub.name}"] = SuiteRef(f"nccl-tests/{sub.name}", "collective", sub)
    return list(refs.values())


@dataclass(frozen=True, slots=True)
class HeadroomBound:
    """What the measured runs on one GPU capacity say about the headroom: the least memory a run that ran
    left free beyond its predicted peak. A default headroom above it would have pruned that run."""

    capacity_gib: float
    slack_gib: float  # capacity - predicted peak of the tightest row (negative: predicted over capacity)
    row: str
    suite: str
    rows: int


def headroom_bounds(results: Any, skip_known_gaps: bool = True) -> list[HeadroomBound]:
    """Per GPU capacity, over every simulated training row (of the suites without a known gap)."""
    by: dict[float, list[tuple[float, str, str]]] = {}
    for s in results:
        if s.kind != "training" or (skip_known_gaps and s.open_issue):
            continue
        for r in s.rows:
            if r.memory is not None:
                by.setdefault(r.memory.capacity_gib, []).append((r.memory.capacity_gib - r.memory.peak_gib, r.label,
                                                                 s.name))
    return [HeadroomBound(cap, *min(rows), len(rows)) for cap, rows in sorted(by.items())]


def fitted_rows(cluster: Any, suite_name: str) -> set[str]:
    """Labels of the suite's rows the cluster's calibration was fitted on: its compute figures (those of every kernel
    family it carries included), the
    all-to-all share of its NCCL figures (``calibrate.a2a_fit``) and its host issue time (``calibrate.host_fit``);
    and those the Triton FlashAttention's rate was fitted on (``calibrate.triton_attention_fit``)."""
    cal = cluster.calibration or {}
    fitted = (cal.get("compute") or {}).get("fitted_on") or {}
    by_kernels = [(block or {}).get("fitted_on") or {} for block in (cal.get("compute_by_kernels") or {}).values()]
    a2a = (((cal.get("nccl") or {}).get("provenance") or {}).get("all_to_all_fit") or {}).get("fitted_on") or {}
    host = (((cal.get("host") or {}).get("provenance") or {}).get("fitted_on")) or {}
    library = load_compute_constants().triton_attention_fitted_on.get(suite_name, ())  # compute.yaml flash_attn_triton
    family = [x for f in by_kernels for x in f.get(suite_name, ())]
    return {str(x) for x in (*fitted.get(suite_name, ()), *family, *a2a.get(suite_name, ()), *host.get(suite_name, ()),
                             *library)}


def run_training(ref: SuiteRef, cache: Any = None, progress: Callable[[int, int, str], None] | None = None) -> SuiteResult:
    suite = training_suite(ref.path)
    rows = training_rows(suite)
    sim = RowSimulator(suite.cluster, suite.stack, cache, model_settings=suite.model_settings)
    fit = fitted_rows(sim.base, suite.name)
    preds = sim.predict_all(rows, progress=progress)
    results = tuple(
        RowResult(p.row.label, p.figure, p.row.measured, p.row.label not in fit,
                  "; ".join(x for x in (p.row.detail, "" if p.fits else "does not fit", p.problem) if x),
                  p.in_range, p.row.not_modelled, row_group(p.row, suite.by_precision), p.memory,
                  p.row.measured_peak_gib, suite.published_peak)
        for p in preds)
    held = [p.log_residual for p in preds if p.log_residual is not None and p.row.label not in fit]
    unit = rows[0].unit if rows else ""
    notes = [f"cluster {suite.cluster}, stack {suite.stack}; "
             f"{len(fit)} rows fitted the preset's calibration, {len(held)} held out"]
    own = {m: ms["stack"] for m, ms in sorted((suite.model_settings or {}).items()) if ms.get("stack")}
    if own:  # a model whose runs used another stack preset (model_settings ``stack:``)
        notes.append("; ".join(f"{m} rows with stack {name}" for m, name in own.items()))
    peaks = [abs(r.peak_error) for r in results if r.peak_error is not None]
    if peaks:
        within = sum(1 for e in peaks if e <= PEAK_TOLERANCE)
        notes.append(f"peak memory against the published figure: {within} of {len(peaks)} rows within "
                     f"{PEAK_TOLERANCE:.0%} (mean |error| {sum(peaks) / len(peaks):.1%})")
    waiting = sorted({r.not_modelled for r in rows if r.not_modelled})
    if waiting:
        notes.append(f"{sum(1 for r in rows if r.not_modelled)} rows not modelled yet: " + "; ".join(waiting))
    for precision, mean_tol, max_tol in suite.by_precision:
        notes.append(f"{precision} rows are judged apart: held-out mean within {mean_tol:.0%}, max {max_tol:.0%}")
    return SuiteResult(suite.name, "training", str(ref.path), unit, suite.stack, suite.cluster, suite.held_out_mean,
                       suite.held_out_max, results, loo_coverage(held), tuple(notes), suite.open_issue,
                       suite.by_precision)


def row_group(row: Any, groups: tuple[tuple[str, float, float], ...]) -> str:
    """The tolerance group a row is judged in: its precision ("fp8"), or "fp8 TFLOP/s" for a TFLOP/s row
    when the suite gives that group a tolerance of its own (a sweep judged per row, say)."""
    dtype = str(row.plan.get("dtype", ""))
    own = f"{dtype} TFLOP/s"
    return own if row.unit == TFLOPS_UNIT and any(g == own for g, _, _ in groups) else dtype


@dataclass(frozen=True, slots=True)
class NcclFitter:
    """The collective model's fitter and its evaluation (``calibrate/nccl_fit.py``: ``fit_nccl`` and
    ``evaluate``), handed down by the caller: calibration sits above validation, which it reads."""

    fit: Callable[..., Any]  # (logs, cluster, fit_max_gpus=, base=) -> a fit with rows, fit_logs, holdout_logs
    evaluate: Callable[..., Any]  # (logs, cluster, params) -> rows with predicted and measured times


def run_collective(ref: SuiteRef, nccl: NcclFitter) -> SuiteResult:
    suite = collective_suite(ref.path)
    cluster = load_cluster(suite.cluster)
    logs = sorted((parse_nccl_tests(p) for p in sorted(ref.path.glob("*.log"))), key=lambda lg: lg.nranks)
    shipped = params_from_calibration(cluster.calibration, context=cluster.name)
    fit = nccl.fit(logs, cluster, fit_max_gpus=suite.fit_max_gpus, base=shipped)
    net_fit = (((cluster.calibration or {}).get("nccl") or {}).get("provenance") or {}).get("network_fit") or {}

    def in_network_fit(log: str, size: int) -> bool:
        """Rows the preset's network figures were fitted on (not held out from the preset)."""
        if log not in net_fit.get("logs", ()):
            return False
        return size < int(net_fit.get("below_bytes", 0)) or size >= int(net_fit.get("from_bytes", 1 << 62))

    rows = tuple(
        RowResult(f"{r.nranks} GPUs {r.size_bytes / 2**20:g} MiB", r.predicted_us, r.measured_us,
                  not in_network_fit(r.log, r.size_bytes),
                  f"{r.algorithm}/{r.protocol}" + ("  (the preset's network fit)" if in_network_fit(r.log, r.size_bytes)
                                                   else ""))
        for r in sorted(fit.rows, key=lambda r: (r.nranks, r.size_bytes))
        if not r.in_fit and r.placement == "out-of-place" and r.size_bytes >= NCCL_MIN_SIZE and not r.outlier)
    worst = max((abs(r.error) for r in rows if r.held_out), default=None)
    notes = [f"refitted on {', '.join(fit.fit_logs)} from the preset's figures; held out "
             f"{', '.join(fit.holdout_logs) or 'none'} (rows: held-out out-of-place times from 1 MiB up, us)",
             ("ok" if rows and worst <= suite.held_out_max else "FAIL") +
             f": held-out max |error| {worst * 100 if worst is not None else float('nan'):.1f}% "
             f"(allowed {suite.held_out_max * 100:.0f}%)"]
    for lg in logs:
        if lg.nranks < 2:
            continue
        rows_lg = [r for r in nccl.evaluate([lg], cluster, shipped) if r.placement == "out-of-place" and not r.outlier]
        big = [abs(r.error_pct) / 100 for r in rows_lg if r.size_bytes >= NCCL_MIN_SIZE]
        every = [abs(r.error_pct) / 100 for r in rows_lg]
        mean = sum(big) / len(big)
        notes.append(("ok" if mean <= suite.preset_mean else "FAIL") +
                     f": shipped preset on {lg.name}: mean |error| {mean * 100:.1f}%, max {max(big) * 100:.1f}% over "
                     f"its {len(big)} sizes from 1 MiB (mean allowed {suite.preset_mean * 100:.0f}%); all "
                     f"{len(every)} sizes: mean {sum(every) / len(every) * 100:.1f}%, max {max(every) * 100:.1f}%")
    return SuiteResult(suite.name, "collective", str(ref.path), "us", "-", cluster.name, suite.held_out_max,
                       suite.held_out_max, rows, None, tuple(notes))


EXCHANGE_MAX = 0.15  # issue 32: DeepEP's normal-kernel bandwidths within 15% each
# the exchange suites: the rows of one DeepEP release each, and a gap known to an open issue ("" when none)
EXCHANGE_SUITES = {"deepep/h800": (DeepEPRelease.APR_2025, ""),
                   "deepep/h800-2025-02": (DeepEPRelease.FEB_2025, "issue 32: the first release's EP 32 dispatch "
                                           "(44 GB/s) is no faster than its EP 64 (46), where the model, like the "
                                           "2025-04 release (58, 51), is faster at EP 32: that row 21% off")}


def run_exchange(ref: SuiteRef) -> SuiteResult:
    """DeepEP's published bandwidths of one release against the expert-exchange model (``validation/exchange.py``),
    at that release's shares."""
    release, gap = EXCHANGE_SUITES.get(ref.name, (DeepEPRelease.APR_2025, ""))
    eff = load_exchange_efficiency(release=release)
    cluster = load_cluster(EXCHANGE_CLUSTER)
    rows = []
    for r in read_deepep(ref.path):
        if r.release != release.value:
            continue
        if r.kernel != "normal":
            rows.append(RowResult(r.label, None, r.measured_GBps, True, not_modelled="low-latency (decoding) kernels"))
            continue
        c = predict(r, cluster, eff, ref.path)
        rows.append(RowResult(r.label, c.reported_GBps, r.measured_GBps, r.label not in eff.fitted_on,
                              f"{c.bottleneck}-bound; DeepEP prints its {r.bottleneck} figure"))
    notes = (f"DeepEP {release.value}'s normal kernels in DeepSeek-V3's setting on the {EXCHANGE_CLUSTER} preset: "
             f"NVLink share {eff.nvlink:g}, network share {eff.network:g} fitted on {', '.join(eff.fitted_on)}; the "
             f"others held out (each within {EXCHANGE_MAX:.0%})" if rows else
             f"no rows of DeepEP release {release.value} in this file (its release column)",)
    return SuiteResult(ref.name, "exchange", str(ref.path), "GB/s", "deepep", EXCHANGE_CLUSTER, EXCHANGE_MAX,
                       EXCHANGE_MAX, tuple(rows), None, notes, gap)


def run_suite(ref: SuiteRef, cache: Any = None, progress: Callable[[int, int, str], None] | None = None,
              nccl: NcclFitter | None = None) -> SuiteResult:
    """One suite's result; a collective suite needs ``nccl`` (``calibrate.nccl_fit.nccl_fitter()``)."""
    if ref.kind == "training":
        return run_training(ref, cache, progress)
    if ref.kind == "exchange":
        return run_exchange(ref)
    if nccl is None:
        raise EchoPlanError(f"suite {ref.name}: a collective suite is refitted, and no NCCL fitter was given")
    return run_collective(ref, nccl)
