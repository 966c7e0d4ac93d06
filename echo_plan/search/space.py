"""Search spaces: which values each plan knob may take, loaded from YAML and enumerated.

The file format is documented in ``search_spaces/README.md``. A space has ``knobs`` (a list of
values per knob), ``fixed`` settings (one value, applied to every candidate) and ``constraints``.
The data-parallel degree is never a knob: it is implied by ``gpus / (tp x cp x pp)``; the global batch
comes from the command line (``--gbs``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

from echo_plan.errors import FileFormatError, SpecError
from echo_plan.limits import MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_SPACE_CANDIDATES
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import DpComm, Recompute, Schedule, Sharding
from echo_plan.specs.loaders import read_mapping


class Knob(str, Enum):
    """A PlanSpec field the search may vary. Order here is the order of enumeration."""

    TP = "tp"
    PP = "pp"
    MICRO_BATCH_SIZE = "micro_batch_size"
    VIRTUAL_STAGES = "virtual_stages"
    SCHEDULE = "schedule"
    RECOMPUTE = "recompute"
    SEQUENCE_PARALLEL = "sequence_parallel"
    DISTRIBUTED_OPTIMIZER = "distributed_optimizer"
    OVERLAP_GRAD_REDUCE = "overlap_grad_reduce"
    OVERLAP_PARAM_GATHER = "overlap_param_gather"
    EP = "ep"  # expert parallel (MoE models; dense models ignore it)
    ETP = "etp"  # expert tensor parallel (MoE models; dense models ignore it)
    DP_COMM = "dp_comm"  # data-parallel gradient exchange (dense or a sparsifier)
    DENSITY = "density"  # a sparse dp_comm's density (dense exchanges ignore it)
    DTYPE = "dtype"  # training precision: bf16, fp16, or fp8 (FP8 GEMMs; needs FP8 tensor cores)
    CP = "cp"  # context parallel: the sequence in 2 x cp chunks, two per rank (docs/long-context.md)
    SHARDING = "sharding"  # none | optimizer | gradients | parameters (ZeRO 0-3); unset: distributed_optimizer says
    SHARD_DEGREE = "shard_degree"  # HSDP: shard within groups of N ranks; 0: the whole data-parallel group
    RECOMPUTE_LAYERS = "recompute_layers"  # full recompute of the first N layers of each chunk; 0: none
    OFFLOAD_OPTIMIZER = "offload_optimizer"  # optimizer states in CPU memory, the step on the CPU (cost/offload.py)
    OFFLOAD_FRACTION = "offload_fraction"  # the share of the optimizer offloaded, in (0, 1]


class Constraint(str, Enum):
    TP_WITHIN_NODE = "tp_within_node"  # a tensor-parallel group never spans servers


INT_KNOBS = (Knob.TP, Knob.PP, Knob.MICRO_BATCH_SIZE, Knob.VIRTUAL_STAGES, Knob.EP, Knob.ETP, Knob.CP)
COUNT_KNOBS = (Knob.SHARD_DEGREE, Knob.RECOMPUTE_LAYERS)  # 0 allowed: "the whole group" / "no layers"
LAYER_SHARE = re.compile(r"1\s*/\s*(\d+)")  # recompute_layers as a share of each model chunk: "1/n"
EXPERT_KNOBS = (Knob.EP, Knob.ETP)
BOOL_KNOBS = (Knob.SEQUENCE_PARALLEL, Knob.DISTRIBUTED_OPTIMIZER, Knob.OVERLAP_GRAD_REDUCE,
              Knob.OVERLAP_PARAM_GATHER, Knob.OFFLOAD_OPTIMIZER)
ENUM_KNOBS: dict[Knob, type[Enum]] = {Knob.SCHEDULE: Schedule, Knob.RECOMPUTE: Recompute, Knob.DP_COMM: DpComm,
                                      Knob.SHARDING: Sharding}
FLOAT_KNOBS = (Knob.DENSITY, Knob.OFFLOAD_FRACTION)

# What a knob is when a space says nothing about it (PlanSpec's defaults, Megatron-LM's usual).
KNOB_DEFAULTS: dict[Knob, Any] = {
    Knob.TP: 1, Knob.PP: 1, Knob.MICRO_BATCH_SIZE: 1, Knob.VIRTUAL_STAGES: 1,
    Knob.SCHEDULE: Schedule.ONE_F_ONE_B.value, Knob.RECOMPUTE: Recompute.NONE.value,
    Knob.SEQUENCE_PARALLEL: False, Knob.DISTRIBUTED_OPTIMIZER: False,
    Knob.OVERLAP_GRAD_REDUCE: True, Knob.OVERLAP_PARAM_GATHER: True, Knob.EP: 1, Knob.ETP: 1,
    Knob.DP_COMM: DpComm.DENSE.value, Knob.DENSITY: 1.0, Knob.DTYPE: DType.BF16.value, Knob.CP: 1,
    Knob.SHARDING: None, Knob.SHARD_DEGREE: 0, Knob.RECOMPUTE_LAYERS: 0, Knob.OFFLOAD_OPTIMIZER: False,
    Knob.OFFLOAD_FRACTION: 1.0,
}
# Knobs whose default the digest leaves out, so spaces written before them keep their digests.
NEW_KNOB_DEFAULTS = {Knob.CP: 1, Knob.SHARDING: None, Knob.SHARD_DEGREE: 0, Knob.RECOMPUTE_LAYERS: 0,
                     Knob.OFFLOAD_OPTIMIZER: False, Knob.OFFLOAD_FRACTION: 1.0}
TRAINING_DTYPES = (DType.BF16.value, DType.FP16.value, DType.FP8.value, DType.FP4.value)
# Settings that may only be fixed (one value for the whole search).
FIXED_ONLY: set[str] = set()
# Names a user may reach for that the search sets itself.
NOT_SETTABLE = {
    "dp": "dp is implied by gpus / (tp x cp x pp); it is not a knob",
    "global_batch_size": "the global batch comes from --gbs",
    "layer_split": "the search uses an even split of layers over pipeline stages",
}
TOP_KEYS = {"name", "description", "knobs", "fixed", "constraints"}


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """A validated search space. ``knobs`` maps each knob to its allowed values (JSON scalars)."""

    name: str
    knobs: tuple[tuple[Knob, tuple[Any, ...]], ...]
    fixed: tuple[tuple[str, Any], ...]
    tp_within_node: bool = True
    description: str = ""
    source: str = ""  # the file it came from, or "" when built in code

    def values(self, knob: Knob) -> tuple[Any, ...]:
        for k, vals in self.knobs:
            if k is knob:
                return vals
        raise KeyError(knob)

    @property
    def varying(self) -> tuple[Knob, ...]:
        """Knobs with more than one value: the ones a sampler chooses."""
        return tuple(k for k, vals in self.knobs if len(vals) > 1)

    @property
    def size(self) -> int:
        n = 1
        for _, vals in self.knobs:
            n *= len(vals)
        return n

    def combos(self) -> Iterator[dict[str, Any]]:
        """Every combination of knob values, in a stable order, as ``{knob name: value}``."""
        names = [k.value for k, _ in self.knobs]
        for vals in itertools.product(*(v for _, v in self.knobs)):
            yield dict(zip(names, vals))

    def with_values(self, overrides: dict[str, tuple[Any, ...]]) -> "SearchSpace":
        """This space with some knobs' values replaced (validated as a space file's would be)."""
        knobs = []
        for k, vals in self.knobs:
            if k.value in overrides:
                vals = tuple(_knob_value(k, v, f"knobs.{k.value}", "command line") for v in overrides[k.value])
            knobs.append((k, vals))
        _check_size(tuple(knobs), "command line")
        return SearchSpace(self.name, tuple(knobs), self.fixed, self.tp_within_node, self.description, self.source)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "knobs": {k.value: list(v) for k, v in self.knobs},
            "fixed": dict(self.fixed),
            "constraints": {Constraint.TP_WITHIN_NODE.value: self.tp_within_node},
            "file": self.source,
        }

    def digest(self) -> str:
        """A short content hash: equal for spaces that would enumerate the same candidates."""
        body = self.as_json()
        body.pop("file"), body.pop("name"), body.pop("description")
        for knob, default in NEW_KNOB_DEFAULTS.items():  # the digest spaces had before these knobs existed
            if body["knobs"].get(knob.value) == [default]:
                del body["knobs"][knob.value]
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def spaces_dir() -> Path:
    """``search_spaces/`` at the project root (found upward from this file)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "search_spaces"
        if (candidate / "default.yaml").exists():
            return candidate
    raise FileFormatError("search_spaces/default.yaml", "the default search space file is not installed")


def default_space_path() -> Path:
    return spaces_dir() / "default.yaml"


LONG_CONTEXT_SEQ = 16384  # above this sequence length a dense model's default space varies cp


def default_space_path_for(model: Any, stack: Any = None) -> Path:
    """The default space for ``model``: ``moe.yaml`` for a mixture of experts, ``long-context.yaml``
    for a dense model whose sequence is longer than 16K tokens (context parallelism as a knob),
    ``fsdp.yaml`` for a dense model on a stack whose data parallelism shards parameters (torchtitan,
    DeepSpeed ZeRO-3) and ``fsdp-long-context.yaml`` for such a model and stack above 16K tokens, else
    ``default.yaml``."""
    if getattr(model, "is_moe", False):
        return spaces_dir() / "moe.yaml"
    fsdp = getattr(getattr(stack, "optimizer_sharding", None), "value", None) == "params"
    if getattr(model, "seq_length", 0) > LONG_CONTEXT_SEQ:
        return spaces_dir() / ("fsdp-long-context.yaml" if fsdp else "long-context.yaml")
    return spaces_dir() / ("fsdp.yaml" if fsdp else "default.yaml")


def load_space(path: str | Path | None = None) -> SearchSpace:
    """Read and validate a search-space YAML file (the default space when ``path`` is None)."""
    p = Path(path) if path is not None else default_space_path()
    if path is not None and not p.exists() and not p.suffix and (spaces_dir() / f"{p}.yaml").exists():
        p = spaces_dir() / f"{p}.yaml"  # a bare name: one of the shipped spaces
    data = read_mapping(p)
    return space_from_mapping(data, source=str(p), default_name=p.stem)


def space_from_mapping(data: dict[str, Any], source: str = "", default_name: str = "space") -> SearchSpace:
    """Validate a mapping shaped like a space file; errors name the key and what is valid."""
    where = source or "search space"
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise FileFormatError(where, f"unknown top-level key {sorted(unknown)[0]!r}; valid keys: "
                                     f"{', '.join(sorted(TOP_KEYS))}")
    knobs_in = _mapping(data.get("knobs") or {}, "knobs", where)
    fixed_in = _mapping(data.get("fixed") or {}, "fixed", where)
    constraints_in = _mapping(data.get("constraints") or {}, "constraints", where)

    valid_knobs = ", ".join(k.value for k in Knob)
    values: dict[Knob, tuple[Any, ...]] = {}
    for name, raw in knobs_in.items():
        knob = _knob(name, where, valid_knobs)
        if not isinstance(raw, list):
            raw = [raw]
        if not raw:
            raise SpecError(f"knobs.{name}", raw, "a non-empty list of values", where)
        vals = tuple(dict.fromkeys(_knob_value(knob, v, f"knobs.{name}", where) for v in raw))
        values[knob] = vals

    fixed: dict[str, Any] = {}
    for name, raw in fixed_in.items():
        knob = _knob(name, where, valid_knobs, section="fixed")
        if knob in values:
            raise SpecError(f"fixed.{name}", raw, "is also listed under knobs; give it in one place", where)
        if isinstance(raw, list):
            raise SpecError(f"fixed.{name}", raw, "a single value (lists go under knobs)", where)
        values[knob] = (_knob_value(knob, raw, f"fixed.{name}", where),)

    tp_within_node = True
    for name, raw in constraints_in.items():
        try:
            Constraint(name)
        except ValueError:
            valid = ", ".join(c.value for c in Constraint)
            raise SpecError(f"constraints.{name}", raw, f"unknown constraint; valid: {valid}", where) from None
        if not isinstance(raw, bool):
            raise SpecError(f"constraints.{name}", raw, "true or false", where)
        tp_within_node = raw

    ordered = tuple((k, values.get(k, (KNOB_DEFAULTS[k],))) for k in Knob)
    _check_size(ordered, where)
    name = data.get("name") or default_name
    return SearchSpace(
        name=str(name), knobs=ordered, fixed=tuple(sorted(fixed.items())), tp_within_node=tp_within_node,
        description=str(data.get("description") or ""), source=source,
    )


def _check_size(knobs: tuple[tuple[Knob, tuple[Any, ...]], ...], where: str) -> None:
    """Refuse a space too large to enumerate (the pruner checks every candidate, ~30 us each)."""
    size = 1
    for _, vals in knobs:
        size *= len(vals)
    if size > MAX_SPACE_CANDIDATES:
        widest = sorted(((len(v), k.value) for k, v in knobs if len(v) > 1), reverse=True)[:3]
        product = " x ".join(f"{n} {name}" for n, name in widest)
        raise FileFormatError(where, f"the space has {size:,} candidate plans ({product} x ...); at most "
                                     f"{MAX_SPACE_CANDIDATES:,}: give fewer values for those knobs, or fix some "
                                     "under fixed:")


def _mapping(value: Any, key: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FileFormatError(where, f"{key!r} must be a mapping of names to values, found {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def _knob(name: str, where: str, valid: str, section: str = "knobs") -> Knob:
    if name in NOT_SETTABLE:
        raise SpecError(f"{section}.{name}", name, NOT_SETTABLE[name], where)
    try:
        return Knob(name)
    except ValueError:
        raise SpecError(f"{section}.{name}", name, f"unknown knob; valid knobs: {valid}", where) from None


def _knob_value(knob: Knob, raw: Any, field: str, where: str) -> Any:
    """One knob value, checked against what any plan could take (type and range)."""
    if knob in INT_KNOBS:
        if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= MAX_GLOBAL_BATCH:
            raise SpecError(field, raw, f"positive integers up to {MAX_GLOBAL_BATCH:,} (e.g. [1, 2, 4, 8])", where)
        return raw
    if knob is Knob.RECOMPUTE_LAYERS and isinstance(raw, str):  # a share of each chunk: "1/n", every n-th layer
        share = LAYER_SHARE.fullmatch(raw.strip())
        if share is None or not 1 <= int(share.group(1)) <= MAX_LAYERS:
            raise SpecError(field, raw, f"a layer count (0: none) or a share of each chunk's layers as 1/n with n from "
                                        f"1 to {MAX_LAYERS:,} (\"1/4\": a quarter, every 4th layer)", where)
        return f"1/{int(share.group(1))}"
    if knob in COUNT_KNOBS:
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_GLOBAL_BATCH:
            what = "0 (the whole data-parallel group)" if knob is Knob.SHARD_DEGREE else "0 (none)"
            raise SpecError(field, raw, f"integers from {what} up to {MAX_GLOBAL_BATCH:,}", where)
        return raw
    if knob in BOOL_KNOBS:
        if not isinstance(raw, bool):
            raise SpecError(field, raw, "true or false", where)
        return raw
    if knob is Knob.DTYPE:
        if str(raw).lower() not in TRAINING_DTYPES:
            raise SpecError(field, raw, f"one of {', '.join(TRAINING_DTYPES)}", where)
        return str(raw).lower()
    if knob in FLOAT_KNOBS:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0.0 < float(raw) <= 1.0:
            raise SpecError(field, raw, "numbers in (0, 1] (e.g. [0.001, 0.01, 0.1])", where)
        return float(raw)
    enum = ENUM_KNOBS[knob]
    try:
        return enum(str(raw).lower()).value
    except ValueError:
        valid = ", ".join(e.value for e in enum)
        raise SpecError(field, raw, f"one of {valid}", where) from None
