"""Interference between compute and communication kernels that share a GPU.

A compute kernel that runs while a collective runs on another stream of the same GPU is slower:
the NCCL kernel holds some SMs (its channels) and competes for HBM bandwidth and L2. The
collective is slower too, because its SMs are shared and its memory traffic competes. The factors
here say by how much: ``compute_slowdown[(compute kind, comm kind)] = f`` means the compute kernel
takes ``f`` times its isolated duration while that collective runs beside it the whole time, and
``comm_slowdown[(comm kind, compute kind)]`` the same for the collective.

Combination rules (what the replay engine uses, see ``task_factor``):

* Several collectives beside one compute kernel add their excess slowdowns:
  ``1 + sum(f_i - 1)`` (two NCCL kernels hold two sets of SMs and both move memory). The same for
  a collective beside several compute kernels.
* A task whose work is a mix of kernel kinds (an aggregated forward chunk) slows by the
  work-weighted blend of its kinds' factors; a mixed compute task beside a collective contributes
  the work-weighted blend of excesses to the collective's factor.
* With ``share_compute`` on, compute tasks that run at once on different streams of one GPU share
  its SMs: each runs ``n`` times slower for ``n`` concurrent compute tasks (time slicing).
* DELAY tasks neither suffer nor cause interference.
* Two collectives beside each other on one GPU do not slow each other here (sharing of NVLink or
  NIC bandwidth between, say, a DP all-reduce and a pipeline send is not modelled).

Every factor is at least 1, so removing interference (``InterferenceModel.none()``) never makes a
replayed step slower. The defaults live in ``echo_plan/data/interference.yaml`` with their
sources; a user file in the same format overrides them entry by entry (``load_interference``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from echo_plan.errors import FileFormatError
from echo_plan.files import read_text
from echo_plan.replay.kinds import COMM_KINDS, COMPUTE_KINDS, TaskKind

FORMAT = "echo-plan-interference/1"
DEFAULT_FILE = "interference.yaml"

Mix = tuple[tuple[TaskKind, float], ...]
Profile = tuple[TaskKind, "Mix | None"]  # (kind, mix) of a running task


def _frozen(d: Mapping[tuple[TaskKind, TaskKind], float]) -> Mapping[tuple[TaskKind, TaskKind], float]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True, eq=False)
class InterferenceModel:
    """Slowdown factors (>= 1) of kernels that overlap on one GPU. Missing pairs mean 1.0."""

    compute_slowdown: Mapping[tuple[TaskKind, TaskKind], float] = field(default_factory=dict)
    comm_slowdown: Mapping[tuple[TaskKind, TaskKind], float] = field(default_factory=dict)
    share_compute: bool = True
    source: str = ""  # where the numbers come from (file and its stated source)
    provenance: tuple[str, ...] = ()  # per-entry notes: "gemm+all_reduce: 1.10 (Echo paper ...)"

    def __post_init__(self) -> None:
        for name, table, first, second in (
            ("compute_slowdown", self.compute_slowdown, COMPUTE_KINDS, COMM_KINDS),
            ("comm_slowdown", self.comm_slowdown, COMM_KINDS, COMPUTE_KINDS),
        ):
            for (a, b), f in table.items():
                if a not in first or b not in second:
                    raise ValueError(f"{name}: ({a}, {b}) is not a (compute, comm) / (comm, compute) pair")
                if not (isinstance(f, (int, float)) and math.isfinite(f) and f >= 1.0):
                    raise ValueError(f"{name}[{a.value}, {b.value}] = {f!r}: a slowdown factor must be >= 1")
            object.__setattr__(self, name, _frozen(table))

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def none(cls) -> "InterferenceModel":
        """No interference at all: every task runs at its isolated speed, whatever overlaps it."""
        return cls({}, {}, share_compute=False, source="none (interference disabled)")

    def scaled(self, s: float) -> "InterferenceModel":
        """The same model with every excess slowdown multiplied by ``s`` (0 removes it, 2 doubles it)."""
        if not (math.isfinite(s) and s >= 0):
            raise ValueError(f"scale must be a finite number >= 0, got {s!r}")
        return InterferenceModel(
            {k: 1.0 + s * (f - 1.0) for k, f in self.compute_slowdown.items()},
            {k: 1.0 + s * (f - 1.0) for k, f in self.comm_slowdown.items()},
            share_compute=self.share_compute,
            source=f"{self.source} (excess scaled x{s:g})",
            provenance=self.provenance,
        )

    def with_factors(self, compute: Mapping[tuple[TaskKind, TaskKind], float] | None = None,
                     comm: Mapping[tuple[TaskKind, TaskKind], float] | None = None,
                     source: str = "", provenance: Iterable[str] = ()) -> "InterferenceModel":
        """This model with some factors replaced (the rest kept)."""
        return InterferenceModel(
            {**self.compute_slowdown, **(compute or {})},
            {**self.comm_slowdown, **(comm or {})},
            share_compute=self.share_compute,
            source=source or self.source,
            provenance=tuple(self.provenance) + tuple(provenance),
        )

    def with_sm_share(self, comm: TaskKind, total_sms: int, comm_sms: int,
                      kinds: tuple[TaskKind, ...] = (TaskKind.GEMM, TaskKind.ATTENTION)) -> "InterferenceModel":
        """This model where collectives of ``comm`` hold ``comm_sms`` of the GPU's ``total_sms`` while they run:
        a tensor-core-bound kernel beside them (``kinds``: GEMM, fused attention) gets the rest, so it takes at
        least total / (total - comm) times as long; memory-bound kernels keep their factors (HBM, not SMs,
        bounds them), and so do kernels already sized to the rest."""
        if not 0 < comm_sms < total_sms:
            raise ValueError(f"comm_sms {comm_sms}: must be between 1 and {total_sms - 1} (the GPU's SMs less one)")
        floor = total_sms / (total_sms - comm_sms)
        factors = {(k, comm): max(self.compute_slowdown.get((k, comm), 1.0), floor)
                   for k in kinds}
        return self.with_factors(compute=factors, provenance=(
            f"{comm.value}: {comm_sms} of {total_sms} SMs held by the exchange "
            f"({' and '.join(k.value for k in kinds)} beside it at least {floor:.3f}x)",))

    # -- queries --------------------------------------------------------------------------------
    @property
    def is_none(self) -> bool:
        """True when no task can ever be slowed (the engine then takes its fast path)."""
        return (not self.share_compute
                and all(f == 1.0 for f in self.compute_slowdown.values())
                and all(f == 1.0 for f in self.comm_slowdown.values()))

    def compute_factor(self, kind: TaskKind, comm_kinds: Iterable[TaskKind]) -> float:
        """Slowdown of a compute kernel of ``kind`` while the collectives ``comm_kinds`` run beside it."""
        table = self.compute_slowdown
        return 1.0 + sum(table.get((kind, c), 1.0) - 1.0 for c in comm_kinds if c in COMM_KINDS)

    def comm_factor(self, comm_kind: TaskKind, compute_kinds: Iterable[TaskKind]) -> float:
        """Slowdown of a collective of ``comm_kind`` while compute kernels of ``compute_kinds`` run beside it."""
        table = self.comm_slowdown
        return 1.0 + sum(table.get((comm_kind, k), 1.0) - 1.0 for k in compute_kinds if k in COMPUTE_KINDS)

    def task_factor(self, kind: TaskKind, mix: Mix | None, others: Sequence[Profile]) -> float:
        """Slowdown of a task (``kind``, work ``mix``) while the tasks ``others`` run on other
        streams of its GPU. Rules in the module docstring."""
        if kind is TaskKind.DELAY or not others:
            return 1.0
        if kind in COMM_KINDS:
            table = self.comm_slowdown
            excess = 0.0
            for okind, omix in others:
                if omix is not None:
                    excess += sum(w * (table.get((kind, k), 1.0) - 1.0) for k, w in omix)
                elif okind in COMPUTE_KINDS:
                    excess += table.get((kind, okind), 1.0) - 1.0
            return 1.0 + excess
        comms = [okind for okind, _ in others if okind in COMM_KINDS]
        n_compute = 1 + sum(1 for okind, _ in others if okind in COMPUTE_KINDS)
        if mix is None:
            f = self.compute_factor(kind, comms) if comms else 1.0
        else:
            f = sum(w * self.compute_factor(k, comms) for k, w in mix) if comms else 1.0
        return f * n_compute if self.share_compute else f

    # -- serialisation --------------------------------------------------------------------------
    def to_mapping(self) -> dict[str, Any]:
        """The YAML/JSON form ``load_interference`` reads back."""
        comp: dict[str, dict[str, float]] = {}
        for (k, c), f in sorted(self.compute_slowdown.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
            comp.setdefault(k.value, {})[c.value] = round(float(f), 6)
        comm: dict[str, dict[str, float]] = {}
        for (c, k), f in sorted(self.comm_slowdown.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value)):
            comm.setdefault(c.value, {})[k.value] = round(float(f), 6)
        return {"format": FORMAT, "source": self.source, "share_compute": self.share_compute,
                "compute_slowdown": comp, "comm_slowdown": comm, "provenance": list(self.provenance)}


# ---------------------------------------------------------------------------------------------
# Loading


def load_interference(path: str | Path | None = None) -> InterferenceModel:
    """The default factors (``echo_plan/data/interference.yaml``), overridden entry by entry by the
    user file at ``path`` when given. Malformed files raise FileFormatError naming the line."""
    text = resources.files("echo_plan.data").joinpath(DEFAULT_FILE).read_text(encoding="utf-8")
    model = _parse(text, f"echo_plan/data/{DEFAULT_FILE}", base=None)
    if path is None:
        return model
    p = Path(path)
    user_text = read_text(p)
    return _parse(user_text, str(p), base=model)


def _parse(text: str, where: str, base: InterferenceModel | None) -> InterferenceModel:
    import yaml

    try:
        root = yaml.compose(text)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise FileFormatError(where, f"malformed YAML: {exc.problem}", line) from None
    except yaml.YAMLError as exc:
        raise FileFormatError(where, "malformed YAML: " + " ".join(str(exc).split())) from None
    except RecursionError:
        raise FileFormatError(where, "nested too deep; the file is a flat mapping of tables") from None
    if not isinstance(root, yaml.MappingNode):
        raise FileFormatError(where, "expected a mapping with compute_slowdown / comm_slowdown tables",
                              _line(root))
    known = {"format", "source", "share_compute", "compute_slowdown", "comm_slowdown", "provenance", "sources",
             "notes"}
    compute: dict[tuple[TaskKind, TaskKind], float] = {}
    comm: dict[tuple[TaskKind, TaskKind], float] = {}
    share = base.share_compute if base is not None else True
    source = ""
    provenance: list[str] = []
    for knode, vnode in root.value:
        key = _scalar(knode, where)
        if key not in known:
            raise FileFormatError(where, f"unknown key {key!r}; known: {', '.join(sorted(known))}", _line(knode))
        if key == "format":
            if _scalar(vnode, where) != FORMAT:
                raise FileFormatError(where, f"format must be {FORMAT!r}", _line(vnode))
        elif key == "source":
            source = _scalar(vnode, where)
        elif key == "share_compute":
            value = yaml.safe_load(yaml.serialize(vnode))
            if not isinstance(value, bool):
                raise FileFormatError(where, "share_compute must be true or false", _line(vnode))
            share = value
        elif key in ("compute_slowdown", "comm_slowdown"):
            rows, cols = (COMPUTE_KINDS, COMM_KINDS) if key == "compute_slowdown" else (COMM_KINDS, COMPUTE_KINDS)
            _table(vnode, where, key, rows, cols, compute if key == "compute_slowdown" else comm)
        elif key == "provenance":
            if not isinstance(vnode, yaml.SequenceNode):
                raise FileFormatError(where, "provenance must be a list of strings", _line(vnode))
            provenance.extend(_scalar(n, where) for n in vnode.value)
    if not source:
        raise FileFormatError(where, "a 'source' saying where the factors come from is required", _line(root))
    if base is None:
        return InterferenceModel(compute, comm, share_compute=share, source=f"{where}: {source}",
                                 provenance=tuple(provenance))
    merged = InterferenceModel(
        {**base.compute_slowdown, **compute}, {**base.comm_slowdown, **comm}, share_compute=share,
        source=f"{where}: {source} (over defaults: {base.source})",
        provenance=tuple(base.provenance) + tuple(provenance),
    )
    return merged


def _line(node: Any) -> int | None:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def _scalar(node: Any, where: str) -> str:
    import yaml

    if not isinstance(node, yaml.ScalarNode):
        raise FileFormatError(where, "expected a single value here", _line(node))
    return str(node.value)


def _kind(node: Any, where: str, allowed: frozenset[TaskKind], what: str) -> TaskKind:
    name = _scalar(node, where)
    try:
        kind = TaskKind(name)
    except ValueError:
        kind = None
    if kind is None or kind not in allowed:
        names = ", ".join(sorted(k.value for k in allowed))
        raise FileFormatError(where, f"{name!r} is not a {what} kind; use one of: {names}", _line(node))
    return kind


def _table(node: Any, where: str, key: str, rows: frozenset[TaskKind], cols: frozenset[TaskKind],
           out: dict[tuple[TaskKind, TaskKind], float]) -> None:
    import yaml

    what_rows, what_cols = ("compute", "communication") if key == "compute_slowdown" else ("communication", "compute")
    if not isinstance(node, yaml.MappingNode):
        raise FileFormatError(where, f"{key} must map {what_rows} kinds to tables", _line(node))
    for rnode, rvalue in node.value:
        row = _kind(rnode, where, rows, what_rows)
        if not isinstance(rvalue, yaml.MappingNode):
            raise FileFormatError(where, f"{key}.{row.value} must map {what_cols} kinds to factors", _line(rvalue))
        for cnode, fnode in rvalue.value:
            col = _kind(cnode, where, cols, what_cols)
            raw = _scalar(fnode, where)
            try:
                f = float(raw)
            except ValueError:
                f = float("nan")
            if not (math.isfinite(f) and f >= 1.0):
                raise FileFormatError(
                    where, f"{key}.{row.value}.{col.value} = {raw!r}: a slowdown factor must be a number >= 1",
                    _line(fnode))
            out[(row, col)] = f
