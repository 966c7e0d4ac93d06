"""Sparse data-parallel exchanges: properties, and agreement with the derivations of docs/sparsification.md."""

from __future__ import annotations

import math

import pytest

from echo_plan.cost.collectives import collective_model_for
from echo_plan.cost.dp_comm import exchange, load_constants, sizes
from echo_plan.cost.kernel_db import compute_model_for
from echo_plan.specs import DType, load_cluster
from echo_plan.specs.plan import DpComm
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.trace.sparsify import worker_ops

SPARSE = [m for m in DpComm if m.sparse]
N = 200_000_000  # elements of one worker's gradient: large enough for bandwidth-bound collectives


def _cluster(p: int):
    return load_cluster("h800", gpus=8 * p)  # one worker per server: every hop on the network


def _tools(p: int):
    cluster = _cluster(p)
    comm, compute = collective_model_for(cluster), compute_model_for(cluster)
    group = CommGroup(GroupKind.DP, size=p, stride=8)

    def comm_time(kind, nbytes, g):
        return comm.time(kind, nbytes, g, cluster).time_s

    def op_time(op):
        return compute.op_time(op, cluster.gpu, DType.BF16)

    dense = comm_time(CollectiveKind.ALL_REDUCE, N * 4, group)
    return group, comm_time, op_time, dense


def _comm_break_even(method: DpComm, p: int) -> float:
    group, comm_time, op_time, dense = _tools(p)
    lo, hi = -6.0, 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        ex = exchange(method, N, group, 10 ** mid, comm_time, op_time)
        lo, hi = (mid, hi) if ex.index_s + ex.value_s <= dense else (lo, mid)
    return 10 ** lo


@pytest.mark.parametrize("method", SPARSE)
def test_at_density_one_every_method_costs_at_least_the_dense_reduction(method):
    group, comm_time, op_time, dense = _tools(8)
    assert exchange(method, N, group, 1.0, comm_time, op_time).total_s >= dense


def test_topk_bytes_grow_with_workers_and_exdyna_selection_shrinks_as_one_over_p():
    d = 0.01
    moved = []
    for p in (4, 16, 64):
        group, comm_time, op_time, _ = _tools(p)
        ex = exchange(DpComm.TOPK, N, group, d, comm_time, op_time)
        moved.append(ex.index_bytes + ex.value_bytes)
    assert moved == sorted(moved) and moved[-1] > 4 * moved[0]
    scanned = {}
    for p in (4, 16, 64):
        s = sizes(DpComm.EXDYNA, N, p, d)
        select, _ = worker_ops("exdyna", N, s.scanned, s.selected, s.union, p)
        scanned[p] = sum(op.bytes_read for op in select)
    assert scanned[16] == pytest.approx(scanned[4] / 4, rel=0.02)
    assert scanned[64] == pytest.approx(scanned[4] / 16, rel=0.02)


def test_break_even_densities_follow_the_derivations():
    imb = load_constants().partition_imbalance
    topk = {p: _comm_break_even(DpComm.TOPK, p) for p in (8, 32)}
    exdyna = {p: _comm_break_even(DpComm.EXDYNA, p) for p in (8, 32)}
    # Top-k: d* = W(1) / p = 0.567 / p, falling as 1/p
    assert topk[32] < topk[8] / 2.5
    for p, d in topk.items():
        assert d == pytest.approx(0.567 / p, rel=0.35)
    # ExDyna: d* = 1 / (2 + imbalance), flat in p
    assert exdyna[32] == pytest.approx(exdyna[8], rel=0.15)
    for d in exdyna.values():
        assert d == pytest.approx(1.0 / (2.0 + imb), rel=0.35)


def test_union_builds_up_between_k_and_p_k():
    for p in (2, 8, 64):
        s = sizes(DpComm.TOPK, 1_000_000, p, 0.01)
        assert s.selected <= s.union <= min(1_000_000, p * s.selected)
        assert s.union == pytest.approx(1_000_000 * (1 - 0.99 ** p), rel=1e-3)
    assert sizes(DpComm.EXDYNA, 1_000_000, 64, 0.01).union == math.ceil(0.01 * 1_000_000)
