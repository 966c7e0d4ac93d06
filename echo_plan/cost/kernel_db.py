"""Measured kernel times: the database file, the model that uses it, and choosing one for a cluster.

A database (``kernels/<GPU>.json``, written by ``echo-plan calibrate kernels``) holds the median
time of each traced op measured on one GPU, keyed by the op's aten name and its input and output
shapes and dtypes. ``DatabaseComputeModel`` answers from it where it has the key and asks its
fallback (the analytical model) otherwise, op by op, and keeps count of how much it measured.
The format is described in ``kernels/README.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from echo_plan.errors import FileFormatError, SpecError
from echo_plan.specs.cluster import ClusterSpec, DType, GPUSpec
from echo_plan.trace.records import OpKind, OpRecord, TensorMeta
from echo_plan.cost.calibration import ComputeCalibration, calibrated_constants
from echo_plan.cost.compute import AnalyticalComputeModel, load_compute_constants
from echo_plan.files import parse_json, read_text

FORMAT = "echo-plan-kernels/1"

# GPUs that share their compute silicon and HBM: a database measured on the first serves the
# second. H800 is the H100 SXM5 die with NVLink cut to 400 GB/s and FP64 cut; compute and HBM are
# the same (../shared/reference/hardware.md, "GPUs"; NVIDIA H100 datasheet).
COMPUTE_ALIASES: dict[str, str] = {"H800": "H100"}

KernelKey = tuple[str, tuple[tuple[tuple[int, ...], str], ...], tuple[tuple[tuple[int, ...], str], ...]]


def _metas_key(metas: Iterable[TensorMeta]) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((tuple(int(d) for d in t.shape), t.dtype) for t in metas)


def kernel_key(op: OpRecord) -> KernelKey:
    """What identifies a measured kernel: aten name, input and output (shape, dtype)s.

    The outputs are part of the key because the trace does not record an op's non-tensor
    arguments; two calls with the same inputs and different arguments (a sum over another dim)
    differ in their outputs.
    """
    return (op.name, _metas_key(op.inputs), _metas_key(op.outputs))


@dataclass(frozen=True, slots=True)
class KernelEntry:
    median_us: float
    count: int
    p10_us: float
    p90_us: float


@dataclass(frozen=True, slots=True)
class GPUIdentity:
    """The GPU a database was measured on, as torch reports it."""

    name: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"
    sm_count: int | None = None
    sm_arch: int | None = None  # compute capability x10
    memory_GiB: float | None = None

    @property
    def family(self) -> str | None:
        return gpu_family(self.name)


@dataclass(frozen=True)
class KernelDatabase:
    gpu: GPUIdentity
    provenance: Mapping[str, Any]
    entries: Mapping[KernelKey, KernelEntry]
    skipped: tuple[Mapping[str, Any], ...] = ()
    path: str = ""

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, op: OpRecord) -> KernelEntry | None:
        """The measured entry of ``op``'s key; none for a sliding-window attention launch, whose key
        (shapes only) it shares with the full-attention launch of those shapes."""
        if op.kind is OpKind.ATTENTION:
            from echo_plan.trace.kernels import windowed_attention  # deferred: loads numpy, torch

            if windowed_attention(op):
                return None
        return self.entries.get(kernel_key(op))

    @staticmethod
    def load(path: str | Path) -> "KernelDatabase":
        p = Path(path)

        data = parse_json(read_text(p), str(p))
        return KernelDatabase.from_json(data, str(p))

    @staticmethod
    def from_json(data: Any, origin: str = "kernel database") -> "KernelDatabase":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise FileFormatError(origin, f"not a kernel database: format must be {FORMAT!r}, found {found!r}")
        try:
            g = data["gpu"]
            gpu = GPUIdentity(
                name=str(g["name"]),
                sm_count=None if g.get("sm_count") is None else int(g["sm_count"]),
                sm_arch=None if g.get("sm_arch") is None else int(g["sm_arch"]),
                memory_GiB=None if g.get("memory_GiB") is None else float(g["memory_GiB"]),
            )
            provenance = dict(data["provenance"])
            entries: dict[KernelKey, KernelEntry] = {}
            for i, e in enumerate(data["entries"]):
                key = (str(e["op"]), _parse_metas(e["inputs"]), _parse_metas(e["outputs"]))
                entry = KernelEntry(float(e["median_us"]), int(e["count"]),
                                    float(e.get("p10_us", e["median_us"])), float(e.get("p90_us", e["median_us"])))
                if not entry.median_us >= 0 or entry.count < 1:
                    raise ValueError(f"entry {i}: median_us must be >= 0 and count >= 1")
                entries[key] = entry
            skipped = tuple(MappingProxyType(dict(s)) for s in data.get("skipped", []))
        except (KeyError, TypeError, ValueError) as exc:
            raise FileFormatError(origin, f"invalid kernel database: {exc!r}") from None
        return KernelDatabase(gpu, MappingProxyType(provenance), MappingProxyType(entries), skipped, origin)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "gpu": {"name": self.gpu.name, "sm_count": self.gpu.sm_count, "sm_arch": self.gpu.sm_arch,
                    "memory_GiB": self.gpu.memory_GiB},
            "provenance": dict(self.provenance),
            "entries": [
                {"op": k[0], "inputs": [[list(s), d] for s, d in k[1]], "outputs": [[list(s), d] for s, d in k[2]],
                 "median_us": e.median_us, "count": e.count, "p10_us": e.p10_us, "p90_us": e.p90_us}
                for k, e in self.entries.items()
            ],
            "skipped": [dict(s) for s in self.skipped],
        }

    def serves(self, gpu: GPUSpec) -> bool:
        return gpu_matches(self.gpu, gpu)


def _parse_metas(items: Any) -> tuple[tuple[tuple[int, ...], str], ...]:
    out = []
    for item in items:
        shape, dtype = item
        out.append((tuple(int(d) for d in shape), str(dtype)))
    return tuple(out)


_FAMILY = re.compile(r"\b([ABHLV]\d{2,3}[A-Z]?|GH\d{3}|GB\d{3}|B\d{3})", re.IGNORECASE)


def gpu_family(name: str) -> str | None:
    """The product family in a GPU name: "NVIDIA H100 80GB HBM3" -> "H100", "H800-SXM5-80GB" -> "H800"."""
    m = _FAMILY.search(name.replace("_", " ").replace("-", " "))
    return m.group(1).upper() if m else None


def _form_factor(name: str) -> str | None:
    up = name.upper()
    for ff in ("PCIE", "NVL", "SXM"):
        if ff in up:
            return ff
    return None


def _name_memory_GB(name: str) -> int | None:
    m = re.search(r"(\d+)\s*GB", name, re.IGNORECASE)
    return int(m.group(1)) if m else None


def gpu_matches(measured: GPUIdentity, gpu: GPUSpec) -> bool:
    """Whether kernel times measured on ``measured`` stand for ``gpu``'s.

    Same compute family (H800 counts as H100, see COMPUTE_ALIASES), and where both sides say so,
    the same SM count, compute capability, form factor and memory size (within 10%: torch reports
    usable memory, datasheets the nominal size). A100 40GB and 80GB differ in HBM bandwidth, so
    they do not serve each other.
    """
    fam_db, fam_gpu = measured.family, gpu_family(gpu.name)
    if fam_db is None or fam_gpu is None:
        return False
    if COMPUTE_ALIASES.get(fam_db, fam_db) != COMPUTE_ALIASES.get(fam_gpu, fam_gpu):
        return False
    if measured.sm_count is not None and measured.sm_count != gpu.sm_count:
        return False
    if measured.sm_arch is not None and measured.sm_arch != gpu.sm_arch:
        return False
    ff_db, ff_gpu = _form_factor(measured.name), _form_factor(gpu.name)
    if ff_db is not None and ff_gpu is not None and ff_db != ff_gpu:
        return False
    if measured.memory_GiB is not None and abs(measured.memory_GiB - gpu.hbm_GiB) > 0.1 * gpu.hbm_GiB:
        return False
    mem_db, mem_gpu = _name_memory_GB(measured.name), _name_memory_GB(gpu.name)
    return mem_db is None or mem_gpu is None or mem_db == mem_gpu


@dataclass(frozen=True, slots=True)
class Coverage:
    """How much of a set of ops the database answered (VIEW ops, which cost nothing, are left out)."""

    ops_measured: int
    ops_modelled: int
    time_measured_s: float
    time_modelled_s: float
    missing: tuple[str, ...] = ()  # op names the database lacked (distinct, sorted)

    @property
    def op_share(self) -> float:
        n = self.ops_measured + self.ops_modelled
        return self.ops_measured / n if n else 0.0

    @property
    def time_share(self) -> float:
        t = self.time_measured_s + self.time_modelled_s
        return self.time_measured_s / t if t else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"ops_measured": self.ops_measured, "ops_modelled": self.ops_modelled,
                "op_share": self.op_share, "time_share": self.time_share, "missing": list(self.missing)}


@dataclass(eq=False)  # compared and hashed by identity, as the analytical model: simulate memoises replays by it
class DatabaseComputeModel:
    """Measured times where the database has the op, the fallback model elsewhere; counts coverage."""

    db: KernelDatabase
    fallback: Any  # a ComputeModel
    _tally: dict[str, Any] = field(default_factory=lambda: {"m": 0, "f": 0, "tm": 0.0, "tf": 0.0, "miss": set()})
    _memo: dict[tuple[int, int, DType], tuple[OpRecord, GPUSpec, tuple[float, bool]]] = field(default_factory=dict)
    _siblings: dict[int, "DatabaseComputeModel"] = field(default_factory=dict)  # by the fallback (kept alive by it)

    def with_attention_library(self, library: str) -> "DatabaseComputeModel":
        """The fallback model with ``library``'s fused-attention kernels; measured entries stay measured
        (a database times the kernels its own run used)."""
        inner = getattr(self.fallback, "with_attention_library", None)
        return self._with_fallback(inner(library) if inner is not None else self.fallback)

    def with_kernels(self, library: str, grouped_fp8_blockwise: bool,
                     fp8_gemm_sms_held: int = 0) -> "DatabaseComputeModel":
        """The fallback model timing a stack's kernels (``AnalyticalComputeModel.with_kernels``); measured
        entries stay measured."""
        inner = getattr(self.fallback, "with_kernels", None)
        if inner is None:
            return self.with_attention_library(library)
        return self._with_fallback(inner(library, grouped_fp8_blockwise, fp8_gemm_sms_held) if fp8_gemm_sms_held
                                   else inner(library, grouped_fp8_blockwise))

    def _with_fallback(self, fallback: Any) -> "DatabaseComputeModel":
        if fallback is self.fallback:
            return self
        sib = self._siblings.get(id(fallback))
        if sib is None:
            sib = self._siblings[id(fallback)] = DatabaseComputeModel(self.db, fallback)
        return sib

    def op_time(self, op: OpRecord, gpu: GPUSpec, dtype: DType) -> float:
        t, measured = self._time(op, gpu, dtype)
        if op.kind is not OpKind.VIEW:
            tally = self._tally
            if measured:
                tally["m"] += 1
                tally["tm"] += t
            else:
                tally["f"] += 1
                tally["tf"] += t
                tally["miss"].add(op.name)
        return t

    def _time(self, op: OpRecord, gpu: GPUSpec, dtype: DType) -> tuple[float, bool]:
        hit = self._memo.get((id(op), id(gpu), dtype))  # identity cache, as in AnalyticalComputeModel
        if hit is not None and hit[0] is op and hit[1] is gpu:
            return hit[2]
        entry = None if op.kind is OpKind.VIEW else self.db.lookup(op)
        if entry is not None:
            result = (entry.median_us * 1e-6, True)
        else:
            result = (self.fallback.op_time(op, gpu, dtype), False)
        self._memo[(id(op), id(gpu), dtype)] = (op, gpu, result)
        return result

    def coverage(self, ops: Iterable[OpRecord], gpu: GPUSpec, dtype: DType) -> Coverage:
        """Coverage of ``ops`` (each counted once per occurrence), without touching the running tally."""
        m = f = 0
        tm = tf = 0.0
        miss: set[str] = set()
        for op in ops:
            if op.kind in (OpKind.VIEW, OpKind.COLLECTIVE):
                continue
            t, measured = self._time(op, gpu, dtype)
            if measured:
                m, tm = m + 1, tm + t
            else:
                f, tf = f + 1, tf + t
                miss.add(op.name)
        return Coverage(m, f, tm, tf, tuple(sorted(miss)))

    def usage(self) -> Coverage:
        """Coverage of every op timed through this model so far."""
        t = self._tally
        return Coverage(t["m"], t["f"], t["tm"], t["tf"], tuple(sorted(t["miss"])))


KERNELS_ENV = "ECHO_PLAN_KERNELS_DIR"


def kernels_dir() -> Path | None:
    """``$ECHO_PLAN_KERNELS_DIR`` when set (a folder of kernel databases; SpecError when it is not a folder),
    else ``kernels/`` at the project root (next to ``clusters/``), if there is one."""
    env = os.environ.get(KERNELS_ENV)
    if env:
        root = Path(env).expanduser()
        if not root.is_dir():
            raise SpecError(KERNELS_ENV, env, "a folder of kernel databases (*.json, kernels/README.md)")
        return root
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "kernels"
        if candidate.is_dir() and (parent / "clusters").is_dir():
            return candidate
    return None


def find_database(gpu: GPUSpec, folder: str | Path | None = None) -> KernelDatabase | None:
    """The database in ``folder`` (default: the project's ``kernels/``) that serves ``gpu``.

    Several matches: one measured on the same family (not through an alias) wins, then the one
    with most entries. A corrupt ``*.json`` in the folder raises FileFormatError.
    """
    root = Path(folder) if folder is not None else kernels_dir()
    if root is None or not root.is_dir():
        return None
    fam = gpu_family(gpu.name)
    matches = [db for db in (KernelDatabase.load(p) for p in sorted(root.glob("*.json"))) if db.serves(gpu)]
    if not matches:
        return None
    return max(matches, key=lambda db: (db.gpu.family == fam, len(db)))


def database_digest(gpu: GPUSpec, folder: str | Path | None = None) -> str:
    """A short hash of the database that serves ``gpu`` ("" when none does): what a stored search study's
    name includes, so a database added or changed starts a new study instead of reading the old times."""
    db = find_database(gpu, folder)
    if db is None:
        return ""
    text = json.dumps(db.to_json(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def database_note(compute: Any, traces: Any, cluster: ClusterSpec, dtype: DType) -> str | None:
    """For a database-backed compute model, how much of the traced kernel time it measured (in words)."""
    if not isinstance(compute, DatabaseComputeModel):
        return None
    stages = [traces.embedding, traces.output, *([t for _, t in traces.blocks] or [traces.block])]
    cov = compute.coverage([op for t in stages for op in t.ops], cluster.gpu, dtype)
    name = Path(compute.db.path).name or "a kernel database"
    return (f"compute: {cov.time_share:.0%} of the traced kernel time ({cov.ops_measured} of "
            f"{cov.ops_measured + cov.ops_modelled} ops) from the measured database {name} ({compute.db.gpu.name}), "
            "the rest from the analytical model")


def compute_model_for(cluster: ClusterSpec, kernels_dir: str | Path | None = None, *, fallback: Any = None,
                      kernels: Any = None) -> Any:
    """The compute model for ``cluster``: database-backed when a database serves its GPU, else the
    analytical model with the cluster's compute calibration applied (``calibration.compute``, or its
    ``compute_by_kernels`` block for the stack's kernel family ``kernels`` where it carries one)."""
    if fallback is None:
        fallback = AnalyticalComputeModel(calibrated_constants(ComputeCalibration.of(cluster, kernels),
                                                               load_compute_constants()))
    base = fallback
    db = find_database(cluster.gpu, kernels_dir)
    return DatabaseComputeModel(db, base) if db is not None else base
