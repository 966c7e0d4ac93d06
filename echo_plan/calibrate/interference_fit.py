"""Fit interference factors from measured (isolated, overlapped) kernel pairs.

CSV format (header required; ``#`` lines are comments; column order is free)::

    compute_kind,comm_kind,isolated_us,overlapped_us,slowed,source
    gemm,all_reduce,1510.2,1795.0,compute,H100 8192^3 bf16 matmul beside NCCL all-reduce 256 MiB
    gemm,all_reduce,402.7,516.1,comm,the all-reduce's own time beside that matmul

* ``compute_kind``: gemm | attention | memory;  ``comm_kind``: all_reduce | all_gather |
  reduce_scatter | all_to_all | broadcast | p2p.
* ``isolated_us`` / ``overlapped_us``: the measured kernel's time alone and while the other kernel
  ran beside it on another stream for the whole measurement (microseconds, > 0).
* ``slowed`` (optional, default ``compute``): which kernel was timed - ``compute`` (the row
  measures the compute slowdown) or ``comm`` (the collective's slowdown).
* ``source`` (optional): where the row comes from (GPU, sizes, paper, tool).

The fit takes, for each (slowed, compute kind, comm kind), the median of ``overlapped/isolated``
(robust to the odd outlier), floors it at 1.0 (a ratio below 1 is noise: overlap cannot speed a
kernel up in this model), and counts the rows. The result is an interference YAML in the
``echo_plan/data/interference.yaml`` format holding only the fitted pairs, with provenance per
pair; the replay loads it over the defaults (``load_interference(path)``), so pairs not measured
keep their published defaults.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from echo_plan.errors import FileFormatError
from echo_plan.files import read_text
from echo_plan.replay.interference import InterferenceModel
from echo_plan.replay.kinds import COMM_KINDS, COMPUTE_KINDS, TaskKind

REQUIRED = ("compute_kind", "comm_kind", "isolated_us", "overlapped_us")
OPTIONAL = ("slowed", "source")


class Slowed(str, Enum):
    COMPUTE = "compute"
    COMM = "comm"


@dataclass(frozen=True, slots=True)
class Measurement:
    compute_kind: TaskKind
    comm_kind: TaskKind
    isolated_us: float
    overlapped_us: float
    slowed: Slowed
    source: str
    line: int

    @property
    def ratio(self) -> float:
        return self.overlapped_us / self.isolated_us


@dataclass(frozen=True, slots=True)
class FittedPair:
    slowed: Slowed
    compute_kind: TaskKind
    comm_kind: TaskKind
    factor: float  # median ratio floored at 1.0
    median_ratio: float
    count: int
    min_ratio: float
    max_ratio: float
    sources: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class InterferenceFit:
    pairs: tuple[FittedPair, ...]
    path: str
    rows: int

    def model(self) -> InterferenceModel:
        """The fitted pairs alone (missing pairs are 1.0); load the YAML to get them over defaults."""
        comp = {(p.compute_kind, p.comm_kind): p.factor for p in self.pairs if p.slowed is Slowed.COMPUTE}
        comm = {(p.comm_kind, p.compute_kind): p.factor for p in self.pairs if p.slowed is Slowed.COMM}
        return InterferenceModel(comp, comm, source=f"fitted from {self.path} ({self.rows} rows)",
                                 provenance=tuple(self.provenance()))

    def stand_in_pairs(self) -> list[FittedPair]:
        """Pairs fitted on rows that say they were stand-ins (``calibrate interference measure`` on one GPU:
        a copy or an elementwise kernel in place of the collective, using every SM, unlike NCCL)."""
        return [p for p in self.pairs if any("STAND-IN" in s.upper() for s in p.sources)]

    def provenance(self) -> list[str]:
        out = []
        for p in self.pairs:
            src = "; ".join(p.sources) if p.sources else "no source given"
            out.append(f"{p.slowed.value} slowdown {p.compute_kind.value}+{p.comm_kind.value}: {p.factor:.4f} = median "
                       f"of {p.count} ratios (min {p.min_ratio:.4f}, max {p.max_ratio:.4f}) from {self.path} [{src}]")
        return out

    def to_yaml(self) -> str:
        import yaml

        data = self.model().to_mapping()
        data.pop("share_compute")  # not measured here: keep whatever the defaults say
        header = (f"# Interference factors fitted by `echo-plan calibrate interference fit` from {self.path}.\n"
                  "# Load with --interference FILE: these pairs override the defaults, the rest stay.\n")
        return header + yaml.safe_dump(data, sort_keys=False, width=120)


def read_measurements(path: str | Path) -> list[Measurement]:
    """Parse the CSV (format in the module docstring); errors name the file and line."""
    p = Path(path)
    text = read_text(p)
    return parse_measurements(text, str(p))


def parse_measurements(text: str, where: str = "<csv>") -> list[Measurement]:
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise FileFormatError(where, f"no header; expected columns {', '.join(REQUIRED)}")
    header_line, header = lines[0]
    columns = [c.strip() for c in next(csv.reader([header]))]
    missing = [c for c in REQUIRED if c not in columns]
    unknown = [c for c in columns if c not in REQUIRED + OPTIONAL]
    if missing or unknown:
        problem = (f"missing column(s) {', '.join(missing)}" if missing else f"unknown column(s) {', '.join(unknown)}")
        raise FileFormatError(where, f"{problem}; columns are {', '.join(REQUIRED)} and optional "
                                     f"{', '.join(OPTIONAL)}", header_line)
    out: list[Measurement] = []
    for n, line in lines[1:]:
        cells = next(csv.reader(io.StringIO(line)))
        if len(cells) > len(columns) or len(cells) < len(REQUIRED):
            raise FileFormatError(where, f"{len(cells)} values for {len(columns)} columns", n)
        row = {c: v.strip() for c, v in zip(columns, cells)}
        out.append(Measurement(
            compute_kind=_kind(row["compute_kind"], COMPUTE_KINDS, "compute_kind", where, n),
            comm_kind=_kind(row["comm_kind"], COMM_KINDS, "comm_kind", where, n),
            isolated_us=_positive(row["isolated_us"], "isolated_us", where, n),
            overlapped_us=_positive(row["overlapped_us"], "overlapped_us", where, n),
            slowed=_slowed(row.get("slowed", ""), where, n),
            source=row.get("source", ""),
            line=n,
        ))
    if not out:
        raise FileFormatError(where, "no measurement rows after the header")
    return out


def fit_interference(measurements: list[Measurement], path: str = "<csv>") -> InterferenceFit:
    groups: dict[tuple[Slowed, TaskKind, TaskKind], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.slowed, m.compute_kind, m.comm_kind), []).append(m)
    pairs = []
    for (slowed, ck, cm), ms in sorted(groups.items(), key=lambda kv: tuple(x.value for x in kv[0])):
        ratios = [m.ratio for m in ms]
        med = statistics.median(ratios)
        pairs.append(FittedPair(slowed, ck, cm, max(1.0, med), med, len(ms), min(ratios), max(ratios),
                                tuple(dict.fromkeys(m.source for m in ms if m.source))))
    return InterferenceFit(tuple(pairs), path, len(measurements))


def _kind(value: str, allowed: frozenset[TaskKind], column: str, where: str, line: int) -> TaskKind:
    try:
        kind = TaskKind(value)
    except ValueError:
        kind = None
    if kind is None or kind not in allowed:
        names = ", ".join(sorted(k.value for k in allowed))
        raise FileFormatError(where, f"{column} {value!r} is not one of: {names}", line)
    return kind


def _positive(value: str, column: str, where: str, line: int) -> float:
    try:
        x = float(value)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise FileFormatError(where, f"{column} {value!r} must be a positive number of microseconds", line)
    return x


def _slowed(value: str, where: str, line: int) -> Slowed:
    if not value:
        return Slowed.COMPUTE
    try:
        return Slowed(value)
    except ValueError:
        raise FileFormatError(where, f"slowed {value!r} must be 'compute' or 'comm'", line) from None
