"""The GPU kernels a sparsified data-parallel exchange runs on one worker, traced as ops.

Written after the reference reducers of the ExDyna code (github kljp/exdyna, ncf/gradient_reducers.py:
TopKReducer, CLTKReducer, ThreshReducer, ExDynaReducer); the code is ours. Per worker and per
flattened gradient of ``n`` fp32 elements:

* error feedback in: the residual memory is added to the fresh gradient (one elementwise pass);
* selection: ``topk`` of |g| over the whole gradient (Top-k, CLT-k), or one threshold compare over
  the whole gradient (hard threshold) or over the worker's own partition only (ExDyna) followed by
  a compaction of the passing indices;
* union of the gathered indices (Top-k, hard threshold: the exchanged values are the union of all
  workers' selections, which is what builds up);
* gathering the selected values, scattering the reduced values into a zeroed gradient (combine) and
  zeroing the exchanged positions of the residual memory (error feedback out).

Data-dependent sizes (how many pass a threshold, how big the union is) are given by the caller:
``selected`` per worker and ``union`` (``cost/dp_comm.py`` derives them). Compaction and union are
custom ops with one kernel each and their real input and output sizes.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from echo_plan.trace.records import OpRecord
from echo_plan.trace.recorder import Recorder

Tensor = torch.Tensor


@torch.library.custom_op("echo_plan::compact_indices", mutates_args=())
def compact_indices(mask: Tensor, count: int) -> Tensor:
    """Indices of the ``count`` set entries of ``mask`` (stream compaction, one pass)."""
    return mask.nonzero().flatten()[:count]


compact_indices.register_fake(lambda mask, count: mask.new_empty((count,), dtype=torch.int64))


@torch.library.custom_op("echo_plan::sorted_unique", mutates_args=())
def sorted_unique(indices: Tensor, count: int) -> Tensor:
    """The ``count`` distinct values of ``indices`` (sort and unique, as torch.unique on a GPU)."""
    return torch.unique(indices)[:count]


sorted_unique.register_fake(lambda indices, count: indices.new_empty((count,)))


def _error_feedback_in(n: int) -> Tensor:
    g = torch.empty(n, dtype=torch.float32)
    memory = torch.empty(n, dtype=torch.float32)
    return g + memory  # last step's residual joins this step's gradient


def _select(method: str, g: Tensor, scanned: int, selected: int, union: int, workers: int) -> Tensor:
    part = g[:scanned]
    if method in ("topk", "cltk"):
        _, idx = torch.topk(part.abs(), selected, sorted=False)
    else:
        idx = compact_indices(part.abs() >= 0.5, selected)
    if method in ("topk", "hard-threshold"):
        gathered = idx.new_empty(selected * workers)  # every worker's indices, after the all-gather
        idx = sorted_unique(gathered, union)
    elif method == "exdyna":
        idx = idx.new_empty(union)  # all workers' (disjoint) selections, after the all-gather
    return idx


def _combine_and_feedback(g: Tensor, idx: Tensor, workers: int) -> None:
    values = g.index_select(0, idx)
    reduced = values / workers  # after the all-reduce of the values
    torch.zeros_like(g).index_put_((idx,), reduced)  # combine into the dense gradient
    g.index_put_((idx,), torch.zeros_like(reduced))  # the residual keeps what was not sent


@lru_cache(maxsize=4096)
def worker_ops(method: str, n: int, scanned: int, selected: int, union: int, workers: int
               ) -> tuple[tuple[OpRecord, ...], tuple[OpRecord, ...]]:
    """(selection ops, error-feedback and combine ops) of one worker, recorded under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from echo_plan.trace import kernels  # noqa: F401 - registers echo_plan's custom ops before recording

    recorder = Recorder(1)
    with FakeTensorMode():
        with recorder:
            g = _error_feedback_in(n)
        first = len(recorder.ops)
        with recorder:
            idx = _select(method, g, scanned, selected, union, workers)
        second = len(recorder.ops)
        with recorder:
            _combine_and_feedback(g, idx, workers)
    ops = tuple(recorder.ops)
    return ops[first:second], ops[:first] + ops[second:]
