"""Fitting the NCCL collective model to nccl-tests logs, and measuring its error per size.

What is fitted, and from what:

* NVLink tier (from logs whose ranks share a server): the bandwidth efficiency relative to
  ``links x NCCL's per-link constant``, and a per-protocol scale of the per-hop latency;
* per-call overhead: a per-protocol scale of NCCL's base latency (the constant part of a call);
* the LL and LL128 bandwidth factors relative to NCCL's (they set where the protocols switch);
* network tier (only when a fitted log spans several servers): the bandwidth efficiency
  relative to the cluster's NIC figures and a latency scale. Otherwise the network stays at the
  cluster's NIC figures and NCCL's latencies: the fit cannot see it.

Residuals are log(predicted / measured time) of every row (out-of-place and in-place), fitted with
a Huber loss and outlier rejection by median absolute deviation (``nccl_solver.robust_fit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from echo_plan.calibrate.nccl_solver import robust_fit
from echo_plan.cost.collectives import NcclModel
from echo_plan.cost.nccl_params import NcclParams, load_default_params
from echo_plan.errors import EchoPlanError
from echo_plan.interop.nccl_tests import NcclTestsLog
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.validation.suites import NcclFitter

# (field, protocol index or None for a scalar, lower bound, upper bound)
NVLINK_KNOBS: tuple[tuple[str, int | None, float, float], ...] = (
    ("base_latency_scale", 0, 0.05, 20.0),
    ("base_latency_scale", 1, 0.05, 20.0),
    ("base_latency_scale", 2, 0.05, 40.0),
    ("nvlink_latency_scale", 0, 0.05, 20.0),
    ("nvlink_latency_scale", 1, 0.05, 20.0),
    ("nvlink_latency_scale", 2, 0.05, 20.0),
    ("protocol_bw_scale", 0, 0.1, 2.0),
    ("protocol_bw_scale", 1, 0.85, 1.15),  # LL128 moves 120 of 128 bytes: a protocol property, +-15% at most
    ("nvlink_bw_efficiency", None, 0.2, 1.5),
    ("nvlink_group_loss", None, 1e-4, 0.9),
)
NET_KNOBS: tuple[tuple[str, int | None, float, float], ...] = (
    ("net_bw_efficiency", None, 0.1, 1.5),
    ("net_latency_scale", -1, 0.05, 20.0),  # -1: one scale for all three protocols
)


@dataclass(frozen=True, slots=True)
class RowError:
    log: str
    nranks: int
    size_bytes: int
    placement: str  # "in-place" or "out-of-place"
    measured_us: float
    predicted_us: float
    measured_busbw: float
    predicted_busbw: float
    algorithm: str
    protocol: str
    in_fit: bool  # the row's log was used to fit
    outlier: bool  # rejected by the robust fit

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_us - self.measured_us) / self.measured_us


@dataclass(frozen=True, slots=True)
class NcclFit:
    params: NcclParams
    values: dict  # the fitted calibratable values (NcclParams.calibratable())
    fitted: tuple[str, ...]  # names of the knobs that were fitted
    fit_logs: tuple[str, ...]
    holdout_logs: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]  # (log, why it was not used)
    rows: tuple[RowError, ...]
    iterations: int

    def log_summary(self) -> list[dict]:
        """Per log: rows, outliers, median/max |error| % (out-of-place rows)."""
        out = []
        for name in self.fit_logs + self.holdout_logs:
            rows = [r for r in self.rows if r.log == name and r.placement == "out-of-place"]
            errs = sorted(abs(r.error_pct) for r in rows if not r.outlier)
            out.append({
                "log": name, "nranks": rows[0].nranks if rows else 0, "role": "fit" if name in self.fit_logs else "holdout",
                "rows": len(rows), "outliers": sum(r.outlier for r in self.rows if r.log == name),
                "median_abs_error_pct": round(errs[len(errs) // 2], 2) if errs else None,
                "max_abs_error_pct": round(errs[-1], 2) if errs else None,
            })
        return out


def group_for_log(log: NcclTestsLog, cluster: ClusterSpec) -> tuple[CommGroup, ClusterSpec]:
    """The group a log's ranks form on ``cluster`` (from its hosts, else filling servers in order)."""
    gpn = cluster.gpus_per_node
    ppn = log.ranks_per_node or min(log.nranks, gpn)
    if ppn > gpn:
        raise EchoPlanError(f"{log.name}: {ppn} ranks on one host but cluster {cluster.name} has {gpn} GPUs per server")
    stride = max(1, gpn // ppn) if log.nranks > ppn else 1
    group = CommGroup(GroupKind.WORLD, log.nranks, stride=stride)
    nodes = group.placement(gpn)[1]
    if nodes > cluster.num_nodes:
        cluster = cluster.replace(num_nodes=nodes)
    return group, cluster


def measurement_outliers(times: Sequence[float], floor: float = 0.15, k: float = 5.0) -> list[bool]:
    """Rows that jump away from both neighbours (sizes double from row to row).

    d_i = log t_i - (log t_(i-1) + log t_(i+1)) / 2 is near zero on any smooth curve; a row is an
    outlier when |d_i| is above max(floor, k robust sigmas of d) and is the largest of its run.
    """
    lt = [math.log(t) for t in times]
    d = [0.0] + [lt[i] - 0.5 * (lt[i - 1] + lt[i + 1]) for i in range(1, len(lt) - 1)] + [0.0]
    if len(lt) < 5:
        return [False] * len(lt)
    inner = sorted(abs(x) for x in d[1:-1])
    limit = max(floor, k * 1.4826 * inner[len(inner) // 2])
    return [0 < i < len(d) - 1 and abs(d[i]) > limit and abs(d[i]) >= abs(d[i - 1]) and abs(d[i]) >= abs(d[i + 1])
            for i in range(len(d))]


def _points(logs: Sequence[NcclTestsLog], cluster: ClusterSpec):
    pts = []
    for log in logs:
        group, c = group_for_log(log, cluster)
        rows = [r for r in log.rows if r.size_bytes > 0]
        for where, attr, bw_attr in (("out-of-place", "time_us_oop", "busbw_oop"), ("in-place", "time_us_ip", "busbw_ip")):
            times = [getattr(r, attr) for r in rows]
            if not all(t > 0 and math.isfinite(t) for t in times):
                continue
            flags = measurement_outliers(times)
            for row, t, bad in zip(rows, times, flags):
                pts.append((log, group, c, row.size_bytes, where, t, getattr(row, bw_attr), bad))
    return pts


def evaluate(logs: Sequence[NcclTestsLog], cluster: ClusterSpec, params: NcclParams, fit_names: Sequence[str] = (),
             outliers: frozenset = frozenset()) -> list[RowError]:
    """Predicted vs measured for every row of every log (multi-rank logs only)."""
    model = NcclModel(params)
    out = []
    for log, group, c, size, where, t, bw, bad in _points([lg for lg in logs if lg.nranks > 1], cluster):
        est = model.time(log.kind, size, group, c)
        out.append(RowError(log.name, log.nranks, size, where, t, est.time_s * 1e6, bw, est.busbw_GBps,
                            est.algorithm.value, est.protocol.value, log.name in fit_names,
                            bad or (log.name, size, where) in outliers))
    return out


def _batches(pts) -> list[tuple]:
    """Points grouped per (log, placement): (kind, group, cluster, indices, sizes)."""
    out: dict[tuple, list[int]] = {}
    for i, p in enumerate(pts):
        out.setdefault((id(p[0]), p[4]), []).append(i)
    return [(pts[ix[0]][0].kind, pts[ix[0]][1], pts[ix[0]][2], np.array(ix),
             np.array([pts[i][3] for i in ix], dtype=float)) for ix in out.values()]


def _predict_us(model: NcclModel, batches: list[tuple], n: int) -> np.ndarray:
    """Predicted times of all points, vectorised over sizes (same choice rule as NcclModel.time)."""
    pred = np.empty(n)
    p = model.params
    for kind, group, cluster, idx, sizes in batches:
        if kind in (CollectiveKind.SEND_RECV, CollectiveKind.ALL_TO_ALL):
            pred[idx] = [model.time(kind, int(s), group, cluster).time_s * 1e6 for s in sizes]
            continue
        _, lines = model.lines(kind, group, cluster)
        best = np.full(sizes.shape, np.inf)
        x = np.log2(np.maximum(sizes, 64.0) / 64.0)
        for line in lines:
            bw = np.full(sizes.shape, line.algbw_GBps)
            if line.tree_proto >= 0:
                table = p.tree_correction[line.tree_proto]
                bw = bw * np.interp(x, np.arange(len(table)), table)
            best = np.minimum(best, line.latency_us + sizes / (1000.0 * bw))
        pred[idx] = best
    return pred


def _apply(base: NcclParams, knobs, x: np.ndarray) -> NcclParams:
    values = base.calibratable()
    for (name, idx, _, _), v in zip(knobs, np.exp(x)):
        if idx is None:
            values[name] = float(v)
        elif idx < 0:
            values[name] = [float(v)] * 3
        else:
            values[name][idx] = float(v)
    return base.with_calibration(values)


def fit_nccl(logs: Sequence[NcclTestsLog], cluster: ClusterSpec, fit_max_gpus: int | None = None,
             base: NcclParams | None = None, network_only: bool = False,
             size_filter=None) -> NcclFit:
    """Fit the model on the logs with at most ``fit_max_gpus`` ranks; the rest are held out.

    ``network_only``: fit only the network tier (``NET_KNOBS``), the NVLink tier staying at
    ``base``'s; ``size_filter(size_bytes) -> bool`` keeps only those sizes of the fitted logs in
    the fit (the rest of their rows count as held out)."""
    base = base if base is not None else load_default_params()
    skipped = tuple((lg.name, "a single rank moves no data") for lg in logs if lg.nranks < 2)
    usable = [lg for lg in logs if lg.nranks >= 2]
    fit_logs = [lg for lg in usable if fit_max_gpus is None or lg.nranks <= fit_max_gpus]
    holdout = [lg for lg in usable if lg not in fit_logs]
    if not fit_logs:
        raise EchoPlanError("no log to fit: every log has one rank or more than --fit-max-gpus ranks")
    multi_node = any(group_for_log(lg, cluster)[0].placement(cluster.gpus_per_node)[1] > 1 for lg in fit_logs)
    if network_only and not multi_node:
        raise EchoPlanError("a network-only fit needs a log that spans several servers")
    knobs = NET_KNOBS if network_only else NVLINK_KNOBS + (NET_KNOBS if multi_node else ())
    pts = [p for p in _points(fit_logs, cluster) if size_filter is None or size_filter(p[3])]
    meas = np.log(np.array([p[5] for p in pts]))
    batches = _batches(pts)

    def residuals(x: np.ndarray) -> np.ndarray:
        pred = _predict_us(NcclModel(_apply(base, knobs, x)), batches, len(pts))
        return np.log(pred) - meas

    lo = np.log([k[2] for k in knobs])
    hi = np.log([k[3] for k in knobs])
    best = None
    for start in (0.0, 1.0):  # NCCL's defaults, and a start with e times the latencies
        x0 = np.zeros(len(knobs))
        x0[:6 if not network_only else 0] = start
        res = robust_fit(residuals, x0, lo, hi, mask=np.array([not p[7] for p in pts]))
        if best is None or res.cost < best.cost:
            best = res
    params = _apply(base, knobs, best.x)
    outliers = frozenset((p[0].name, p[3], p[4]) for p, keep in zip(pts, best.kept) if not keep)
    fit_names = tuple(lg.name for lg in fit_logs)
    rows = evaluate(fit_logs + holdout, cluster, params, fit_names, outliers)
    if size_filter is not None:  # sizes of a fitted log left out of the fit are held out too
        rows = [replace(r, in_fit=r.in_fit and size_filter(r.size_bytes)) for r in rows]
    return NcclFit(
        params=params, values=params.calibratable(),
        fitted=tuple(f"{n}[{i}]" if i is not None and i >= 0 else n for n, i, _, _ in knobs),
        fit_logs=fit_names, holdout_logs=tuple(lg.name for lg in holdout), skipped=skipped,
        rows=tuple(rows), iterations=best.iterations,
    )


def nccl_fitter():
    """This module's fit and evaluation as the validation runner takes them (``validation.suites.NcclFitter``)."""
    return NcclFitter(fit_nccl, evaluate)
