"""Data-parallel gradient exchange methods: dense reduction and the sparsifiers, one cost each.

For one worker's flattened gradient of ``n`` fp32 elements on a data-parallel group of ``p`` workers
at density ``d`` (k = d x n), after the reference reducers of the ExDyna code (github kljp/exdyna,
ncf/gradient_reducers.py) and the ExDyna paper (Yoon and Oh 2024, arXiv 2402.13781):

* ``dense``: one all-reduce of n values (the existing bucketed model, ``replay/dp.py``).
* ``topk``: Top-k over all n; all-gather of the k indices (p x k in all); the union of the
  gathered indices is what is exchanged: all-reduce of the union's values. The union grows with p
  (gradient build-up): with selections that overlap like independent draws it holds
  n x (1 - (1 - d)^p) elements, between k and p x k (ASSUMPTION: real selections overlap more;
  this is the build-up's upper estimate).
* ``cltk``: every worker waits for a rotating leader's Top-k over all n; broadcast of its k indices;
  all-reduce of those k values. No build-up.
* ``hard-threshold``: one threshold pass over all n, no density control: the share that passes is
  ``threshold_drift`` x d (docs/sparsification.md); the counts are all-gathered (p integers), the
  indices all-gathered padded to the largest count (p x k_max), the union's values all-reduced.
* ``exdyna``: each worker scans only its own partition (n / p elements) with an online-scaled
  threshold that holds the density at d; counts all-gathered, indices all-gathered padded to the
  largest partition's count (p x k_max, where p x k_max / sum k - 1 is the partition imbalance),
  then all-reduce of the k (disjoint, so no build-up) values.

Indices are 8 bytes (int64, as torch.topk and nonzero return them), values 4 bytes (fp32 main
gradients), counts 8 bytes. Selection, error feedback and combine are traced ops
(``trace/sparsify.py``) timed by the compute model; the exchanges are collectives on the group's
placement. Convergence is not modelled: a sparsifier changes how many steps reach a given loss,
and echo-plan prices one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Callable

from echo_plan.files import safe_load
import yaml

from echo_plan.errors import FileFormatError
from echo_plan.specs.plan import DpComm
from echo_plan.trace.records import CollectiveKind, CommGroup, OpRecord

INDEX_BYTES = 8
VALUE_BYTES = 4
COUNT_BYTES = 8

CommTime = Callable[[CollectiveKind, int, CommGroup], float]
OpTime = Callable[[OpRecord], float]


@dataclass(frozen=True)
class SparsifierConstants:
    partition_imbalance: float  # p x k_max / sum k - 1 of threshold selections (ExDyna, hard threshold)
    threshold_drift: float  # achieved over requested density of the uncontrolled hard threshold
    source: str


@lru_cache(maxsize=1)
def load_constants() -> SparsifierConstants:
    text = (resources.files("echo_plan") / "data" / "sparsification.yaml").read_text(encoding="utf-8")
    try:
        raw = safe_load(text, packaged=True)
        return SparsifierConstants(float(raw["partition_imbalance"]), float(raw["threshold_drift"]),
                                   str(raw["source"]))
    except (KeyError, TypeError, ValueError, yaml.YAMLError) as exc:
        raise FileFormatError("echo_plan/data/sparsification.yaml", f"invalid sparsifier constants: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class Exchange:
    """One sparse exchange of one worker's gradient: seconds per part and bytes each worker moves."""

    select_s: float
    index_s: float
    value_s: float
    feedback_s: float
    index_bytes: int  # nccl-tests size of the index (and count) collectives
    value_bytes: int  # size of the values all-reduce
    selected: int  # elements this worker selects
    union: int  # values all-reduced (after build-up)

    @property
    def total_s(self) -> float:
        return self.select_s + self.index_s + self.value_s + self.feedback_s


@dataclass(frozen=True, slots=True)
class Sizes:
    scanned: int
    selected: int
    padded: int  # per-worker indices in the all-gather (after padding to the largest count)
    union: int


def sizes(method: DpComm, n: int, p: int, density: float, consts: SparsifierConstants | None = None) -> Sizes:
    """How many elements each stage of ``method`` touches (module docstring)."""
    c = consts or load_constants()
    k = max(1, math.ceil(density * n))
    if method is DpComm.TOPK:
        union = min(n, max(k, round(n * (1.0 - (1.0 - density) ** p))))
        return Sizes(n, k, k, union)
    if method is DpComm.CLTK:
        return Sizes(n, k, k, k)
    if method is DpComm.HARD_THRESHOLD:
        d_act = min(1.0, density * c.threshold_drift)
        k_act = max(1, math.ceil(d_act * n))
        union = min(n, max(k_act, round(n * (1.0 - (1.0 - d_act) ** p))))
        return Sizes(n, k_act, min(n, math.ceil(k_act * (1.0 + c.partition_imbalance))), union)
    if method is DpComm.EXDYNA:
        own = max(1, math.ceil(k / p))
        return Sizes(max(1, math.ceil(n / p)), own, math.ceil(own * (1.0 + c.partition_imbalance)), k)
    raise ValueError(f"{method.value} is not a sparse method")


def exchange(method: DpComm, n: int, group: CommGroup, density: float, comm_time: CommTime, op_time: OpTime,
             consts: SparsifierConstants | None = None) -> Exchange:
    """The cost of exchanging one worker's ``n``-element gradient over ``group`` with ``method``."""
    from echo_plan.trace.sparsify import worker_ops  # deferred: loads numpy, torch

    p = group.size
    s = sizes(method, n, p, density, consts)
    select_ops, feedback_ops = worker_ops(method.value, n, s.scanned, s.selected, s.union, p)
    select_s = sum(op_time(op) for op in select_ops)
    feedback_s = sum(op_time(op) for op in feedback_ops)
    if method is DpComm.CLTK:
        index_bytes = s.selected * INDEX_BYTES
        index_s = comm_time(CollectiveKind.BROADCAST, index_bytes, group)
    else:
        index_bytes = p * s.padded * INDEX_BYTES
        index_s = comm_time(CollectiveKind.ALL_GATHER, index_bytes, group)
        if method in (DpComm.HARD_THRESHOLD, DpComm.EXDYNA):  # the counts come first
            index_s += comm_time(CollectiveKind.ALL_GATHER, p * COUNT_BYTES, group)
            index_bytes += p * COUNT_BYTES
    value_bytes = s.union * VALUE_BYTES
    value_s = comm_time(CollectiveKind.ALL_REDUCE, value_bytes, group)
    return Exchange(select_s, index_s, value_s, feedback_s, index_bytes, value_bytes, s.selected, s.union)
