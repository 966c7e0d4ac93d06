"""Validation suites: published or measured figures that predictions are held against.

A suite is found by where it lies in a validation folder (``$ECHO_PLAN_VALIDATION_DIR``, else
``../shared/validation`` beside the project, plus any ``--dir`` the user gives):

* ``*.csv`` - a **training-throughput suite**, one training run per row, in the format of
  ``megatron_weak_scaling_a100.csv``. Required columns: ``params_b, heads, hidden, layers, tp, pp,
  gpus, global_batch, achieved_tflops_per_gpu``; optional: ``micro_batch_size, virtual_stages``
  (else chosen as Megatron-LM would, see megatron.py), other columns are ignored. ``#`` lines are
  comments; one of them may set the suite's settings:
  ``# echo-plan: cluster=dgx-a100 seq_length=2048 vocab_size=51200 dtype=fp16 recompute=full
  attention=unfused tolerance=0.10 fit=even``. Defaults are the SC21 table's (shown). ``fit=even``
  fits one compute-time factor on the even rows and reports the odd rows as held out;
  ``fit=none`` predicts every row with the uncalibrated model. Pass if the mean absolute error
  over all rows, and over the held-out rows, is within ``tolerance``.
* ``nccl-tests/<cluster>/*.log`` - a **collective suite**: nccl-tests logs taken on the cluster
  preset of that name (or on ``cluster.yaml`` in the same folder). The collective model is
  fitted on the logs of at most one server and predicts the larger ones; rows are the held-out
  sizes from 1 MiB up; pass if every such row is within ``tolerance`` (15%).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from echo_plan.errors import FileFormatError

TRAINING_REQUIRED = ("params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "global_batch",
                     "achieved_tflops_per_gpu")
DIRECTIVE = "# echo-plan:"
SETTING_KEYS = ("cluster", "seq_length", "vocab_size", "dtype", "recompute", "attention", "tolerance", "fit")
NCCL_TOLERANCE = 0.15
NCCL_MIN_SIZE = 1 << 20


@dataclass(frozen=True, slots=True)
class RowResult:
    label: str
    predicted: float
    measured: float
    held_out: bool
    detail: str = ""

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


@dataclass(frozen=True, slots=True)
class SuiteResult:
    name: str
    kind: str  # "training" or "collective"
    path: str
    unit: str
    tolerance: float
    rows: tuple[RowResult, ...]
    passed: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def mean_abs_error(self) -> float:
        return sum(abs(r.error) for r in self.rows) / len(self.rows) if self.rows else 0.0

    @property
    def max_abs_error(self) -> float:
        return max((abs(r.error) for r in self.rows), default=0.0)

    def as_json(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "path": self.path, "unit": self.unit,
            "tolerance": self.tolerance, "passed": self.passed,
            "mean_abs_error": self.mean_abs_error, "max_abs_error": self.max_abs_error,
            "rows": [{"label": r.label, "predicted": r.predicted, "measured": r.measured, "error": r.error,
                      "held_out": r.held_out, "detail": r.detail} for r in self.rows],
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class SuiteRef:
    name: str
    kind: str
    path: Path


def discover(dirs: list[Path]) -> list[SuiteRef]:
    """Every suite in the given folders, in a stable order."""
    refs: list[SuiteRef] = []
    for d in dirs:
        for csv_path in sorted(d.glob("*.csv")):
            refs.append(SuiteRef(csv_path.stem, "training", csv_path))
        nccl_root = d / "nccl-tests"
        if nccl_root.is_dir():
            for sub in sorted(p for p in nccl_root.iterdir() if p.is_dir() and any(p.glob("*.log"))):
                refs.append(SuiteRef(f"nccl-tests/{sub.name}", "collective", sub))
    return refs


def read_settings(path: Path):
    """The suite's TableSettings, tolerance and fit mode from its ``# echo-plan:`` line."""
    from echo_plan.validation.megatron import TableSettings

    values: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.startswith(DIRECTIVE):
            for token in shlex.split(line[len(DIRECTIVE):]):
                key, sep, value = token.partition("=")
                if not sep or key not in SETTING_KEYS:
                    raise FileFormatError(str(path), f"setting {token!r} is not key=value with a key among "
                                          f"{', '.join(SETTING_KEYS)}", n)
                values[key] = value
    def number(key: str, default, kind):
        try:
            return kind(values.get(key, default))
        except ValueError:
            raise FileFormatError(str(path), f"setting {key}={values[key]!r} in the '# echo-plan:' line "
                                  f"is not {'an integer' if kind is int else 'a number'}") from None

    settings = TableSettings(
        cluster=values.get("cluster", "dgx-a100"),
        seq_length=number("seq_length", 2048, int),
        vocab_size=number("vocab_size", 51200, int),
        dtype=values.get("dtype", "fp16"),
        recompute=values.get("recompute", "full"),
        unfused_attention=values.get("attention", "unfused") == "unfused",
    )
    tolerance = number("tolerance", 0.10, float)
    fit = values.get("fit", "even")
    if fit not in ("even", "none"):
        raise FileFormatError(str(path), f"fit={fit!r}: valid values are 'even' and 'none'")
    return settings, tolerance, fit


def check_columns(path: Path) -> None:
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]
    header = [c.strip() for c in lines[0].split(",")] if lines else []
    missing = [c for c in TRAINING_REQUIRED if c not in header]
    if missing:
        raise FileFormatError(str(path), f"not a training suite: missing columns {', '.join(missing)} "
                              f"(required: {', '.join(TRAINING_REQUIRED)})")


def run_training(ref: SuiteRef, cache=None) -> SuiteResult:
    from echo_plan.validation.megatron import Predictor, fit_compute_scale, load_rows, megatron_choice, split_rows

    check_columns(ref.path)
    settings, tolerance, fit = read_settings(ref.path)
    rows = load_rows(ref.path)
    predictor = Predictor(cache=cache, settings=settings)
    notes = [f"cluster {settings.cluster}, seq {settings.seq_length}, vocab {settings.vocab_size}, "
             f"{settings.dtype}, recompute {settings.recompute}, "
             f"{'unfused (2021) attention' if settings.unfused_attention else 'fused attention'}"]
    held: set[int] = set()
    if fit == "even" and len(rows) >= 2:
        fit_rows, held_rows = split_rows(rows)
        scale, _ = fit_compute_scale(predictor, fit_rows)
        held = {id(r) for r in held_rows}
        notes.append(f"one compute-time factor fitted on the even rows: {scale:.3f}; odd rows held out")
    else:
        scale = 1.0
    preds = predictor.table(rows, scale=scale)
    results = tuple(
        RowResult(f"{p.row.params_b:g}B tp{p.row.tp} pp{p.row.pp} {p.row.gpus} GPUs", p.predicted_tflops,
                  p.row.published_tflops, id(p.row) in held,
                  f"mbs {megatron_choice(p.row)[0]} vpp {megatron_choice(p.row)[1]}{'' if p.fits else ' (does not fit)'}")
        for p in preds)
    held_results = [r for r in results if r.held_out]
    mean_all = sum(abs(r.error) for r in results) / len(results)
    mean_held = sum(abs(r.error) for r in held_results) / len(held_results) if held_results else mean_all
    return SuiteResult(ref.name, "training", str(ref.path), "TFLOP/s per GPU", tolerance, results,
                       mean_all <= tolerance and mean_held <= tolerance, tuple(notes))


def run_collective(ref: SuiteRef) -> SuiteResult:
    from echo_plan.calibrate.nccl_fit import fit_nccl
    from echo_plan.interop.nccl_tests import parse_nccl_tests
    from echo_plan.specs import load_cluster

    own = ref.path / "cluster.yaml"
    cluster = load_cluster(str(own) if own.exists() else ref.path.name)
    logs = sorted((parse_nccl_tests(p) for p in sorted(ref.path.glob("*.log"))), key=lambda lg: lg.nranks)
    fit = fit_nccl(logs, cluster, fit_max_gpus=cluster.gpus_per_node)
    rows = tuple(
        RowResult(f"{r.nranks} GPUs {r.size_bytes / 2**20:g} MiB", r.predicted_us, r.measured_us, True,
                  f"{r.algorithm}/{r.protocol}")
        for r in sorted(fit.rows, key=lambda r: (r.nranks, r.size_bytes))
        if not r.in_fit and r.placement == "out-of-place" and r.size_bytes >= NCCL_MIN_SIZE and not r.outlier)
    notes = (f"fitted on {', '.join(fit.fit_logs)} (one server); held out {', '.join(fit.holdout_logs) or 'none'}",
             "rows: held-out out-of-place times from 1 MiB up (microseconds)")
    passed = bool(rows) and all(abs(r.error) <= NCCL_TOLERANCE for r in rows)
    return SuiteResult(ref.name, "collective", str(ref.path), "us", NCCL_TOLERANCE, rows, passed, notes)


def run_suite(ref: SuiteRef, cache=None) -> SuiteResult:
    return run_training(ref, cache) if ref.kind == "training" else run_collective(ref)
