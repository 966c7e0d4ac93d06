"""Which validation suites exist, which cluster and software stack each was measured on, and what
passing means: ``echo_plan/data/validation_suites.yaml`` for the shipped suites, a
``# echo-plan: key=value ...`` line for a suite of one's own (docs/validation.md)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from echo_plan.files import safe_load

from echo_plan.errors import FileFormatError
from echo_plan.files import read_text
from echo_plan.validation.rows import RowCorrection
from echo_plan.validation.rows import csv_records
from echo_plan.validation.rows import read_step_times
from echo_plan.validation.megatron import TableSettings, read_tflops_table

DIRECTIVE = "# echo-plan:"
FORMATS = ("tflops-table", "step-times")
DIRECTIVE_KEYS = ("format", "cluster", "stack", "seq_length", "vocab_size", "dtype", "recompute", "tolerance",
                  "max_tolerance")
DEFAULT_MEAN, DEFAULT_MAX = 0.10, 0.20  # a suite of one's own that says nothing


class PeakMeasure(str, Enum):
    """What a source's published peak memory measures."""

    DEVICE = "device"  # all the GPU's memory in use
    RESERVED = "reserved"  # PyTorch's caching allocator only (max_memory_reserved): no CUDA context or NCCL buffers


@dataclass(frozen=True, slots=True)
class TrainingSuite:
    name: str
    path: Path
    format: str  # one of FORMATS
    cluster: str
    stack: str
    held_out_mean: float  # pass: mean |error| over held-out rows at most this
    held_out_max: float  # and every held-out row within this
    not_modelled: str = ""  # the whole suite waits for a capability
    open_issue: str = ""  # modelled, but known to miss its target: shown as FAIL, not counted against `validate`
    published_peak: PeakMeasure = PeakMeasure.DEVICE  # what the rows' published peak memory measures
    model_settings: Any = None  # model name -> stack settings from the run's config that the file lacks
    row_defaults: Any = None  # model name -> CSV column values the file's header states for every row
    row_corrections: tuple = ()  # rows.RowCorrection: listed values the runs' own configs contradict
    seq_length: int = 2048  # tflops-table only
    vocab_size: int = 51200
    dtype: str = "fp16"
    recompute: str = "full"
    # precision -> (held-out mean, held-out max) for that precision's rows, judged apart from the others
    by_precision: tuple[tuple[str, float, float], ...] = ()


def _precision_tolerances(d: dict) -> tuple[tuple[str, float, float], ...]:
    out = []
    for precision, tol in (d.get("precision_tolerance") or {}).items():
        out.append((str(precision), float(tol["held_out_mean"]), float(tol["held_out_max"])))
    return tuple(out)


def _corrections(items) -> tuple:
    """The registry's ``row_corrections`` (a list of {match, set, why}) as rows.RowCorrection."""
    from types import MappingProxyType

    out = []
    for item in items:
        if not isinstance(item, dict) or not item.get("match") or not item.get("set") or not item.get("why"):
            raise FileFormatError("validation_suites.yaml", "each row correction needs match, set and why")
        out.append(RowCorrection(MappingProxyType({str(k): str(v) for k, v in dict(item["match"]).items()}),
                                 MappingProxyType({str(k): str(v) for k, v in dict(item["set"]).items()}),
                                 " ".join(str(item["why"]).split())))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CollectiveSuite:
    name: str
    path: Path
    cluster: str
    fit_max_gpus: int
    held_out_max: float
    preset_mean: float


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    text = (resources.files("echo_plan") / "data" / "validation_suites.yaml").read_text(encoding="utf-8")
    return safe_load(text, packaged=True)


def _directive(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.startswith(DIRECTIVE):
            continue
        try:
            tokens = shlex.split(line[len(DIRECTIVE):])
        except ValueError as exc:
            raise FileFormatError(str(path), f"the '# echo-plan:' line cannot be read: {exc}", n) from None
        for token in tokens:
            key, sep, value = token.partition("=")
            if not sep or key not in DIRECTIVE_KEYS:
                raise FileFormatError(str(path), f"setting {token!r} is not key=value with a key among "
                                      f"{', '.join(DIRECTIVE_KEYS)}", n)
            values[key] = value
    return values


def _infer_format(path: Path) -> str:
    header, _ = csv_records(path)
    if "achieved_tflops_per_gpu" in header:
        return "tflops-table"
    if "step_time_s" in header:
        return "step-times"
    raise FileFormatError(str(path), "not a training suite: it has neither an achieved_tflops_per_gpu column "
                                     "(tflops-table) nor a step_time_s column (step-times); see docs/validation.md")


def _peak_kind(value: Any, path: Path) -> PeakMeasure:
    try:
        return PeakMeasure(value)
    except ValueError:
        raise FileFormatError(str(path), f"published_peak {value!r} is not one of "
                              f"{', '.join(m.value for m in PeakMeasure)}") from None


def training_suite(path: Path) -> TrainingSuite:
    """The suite at ``path``: the registry's entry for a shipped suite, else the file's own settings."""
    known = _registry()["suites"].get(path.stem)
    if known is not None:
        d = dict(known)
        return TrainingSuite(name=path.stem, path=path, format=d["format"], cluster=d["cluster"], stack=d["stack"],
                             held_out_mean=float(d.get("held_out_mean", DEFAULT_MEAN)),
                             held_out_max=float(d.get("held_out_max", DEFAULT_MAX)),
                             not_modelled=str(d.get("not_modelled", "")), open_issue=str(d.get("open_issue", "")),
                             published_peak=_peak_kind(d.get("published_peak", "device"), path),
                             model_settings=dict(d.get("model_settings") or {}),
                             by_precision=_precision_tolerances(d),
                             row_defaults={str(k): {str(c): str(x) for c, x in dict(v).items()}
                                           for k, v in dict(d.get("row_defaults") or {}).items()},
                             row_corrections=_corrections(d.get("row_corrections") or ()),
                             **{k: d[k] for k in ("seq_length", "vocab_size", "dtype", "recompute") if k in d})
    v = _directive(path)

    def number(key: str, default: Any, kind: type) -> Any:
        try:
            return kind(v.get(key, default))
        except ValueError:
            raise FileFormatError(str(path), f"setting {key}={v[key]!r} is not "
                                  f"{'an integer' if kind is int else 'a number'}") from None

    fmt = v.get("format") or _infer_format(path)
    if fmt not in FORMATS:
        raise FileFormatError(str(path), f"format={fmt!r}: valid formats are {', '.join(FORMATS)}")
    mean = number("tolerance", DEFAULT_MEAN, float)
    return TrainingSuite(
        name=path.stem, path=path, format=fmt,
        cluster=v.get("cluster", "dgx-a100" if fmt == "tflops-table" else "dgx-h100"),
        stack=v.get("stack", "megatron-lm-2021" if fmt == "tflops-table" else "megatron-core"),
        held_out_mean=mean, held_out_max=number("max_tolerance", max(mean, 2 * mean), float),
        seq_length=number("seq_length", 2048, int), vocab_size=number("vocab_size", 51200, int),
        dtype=v.get("dtype", "fp16"), recompute=v.get("recompute", "full"),
    )


def collective_suite(path: Path) -> CollectiveSuite:
    name = f"nccl-tests/{path.name}"
    known = _registry()["collective_suites"].get(name, {})
    own = path / "cluster.yaml"
    return CollectiveSuite(name=name, path=path, cluster=str(own) if own.exists() else known.get("cluster", path.name),
                           fit_max_gpus=int(known.get("fit_max_gpus", 8)),
                           held_out_max=float(known.get("held_out_max", 0.15)),
                           preset_mean=float(known.get("preset_mean", 0.10)))


def training_rows(suite: TrainingSuite):
    """The suite's rows, read in its format."""
    if suite.format == "tflops-table":
        return read_tflops_table(suite.path, TableSettings(suite.seq_length, suite.vocab_size, suite.dtype,
                                                           suite.recompute))

    return read_step_times(suite.path, suite.not_modelled, suite.row_defaults, suite.row_corrections)
