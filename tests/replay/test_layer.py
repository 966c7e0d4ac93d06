"""Level-1 layer replay on synthetic traces with simple cost models (the protocols' contract)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from echo_plan.cost.base import Algorithm, CollectiveEstimate, CollectiveModel, ComputeModel, Protocol_
from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.layer import phase_tasks, replay_layer
from echo_plan.replay.engine import replay
from echo_plan.specs import load_cluster
from echo_plan.specs.cluster import DType
from echo_plan.trace.records import (
    CollectiveInfo, CollectiveKind, CommGroup, GroupKind, LayerTrace, OpKind, OpRecord, Phase, StageKind,
    Stream, TraceKey,
)

CLUSTER = load_cluster("h800")
TP = CommGroup(GroupKind.TP, 8)


class FlopsModel:
    """1 TFLOP/s and 1 TB/s: an op takes flops/1e12 + bytes/1e12 seconds (views: 0)."""

    def op_time(self, op, gpu, dtype):
        return 0.0 if op.kind is OpKind.VIEW else op.flops / 1e12 + (op.bytes_read + op.bytes_written) / 1e12


class BytesComm:
    """A collective moves its bytes at 1e11 B/s."""

    def time(self, kind, nbytes, group, cluster):
        t = nbytes / 1e11
        return CollectiveEstimate(t, Algorithm.RING, Protocol_.SIMPLE, nbytes / t / 1e9 if t else 0.0, 0.0)


def test_models_implement_the_protocols():
    assert isinstance(FlopsModel(), ComputeModel) and isinstance(BytesComm(), CollectiveModel)


class Builder:
    def __init__(self) -> None:
        self.ops: list[OpRecord] = []

    def op(self, kind: OpKind, phase: Phase, deps=(), flops=0.0, nbytes=0, coll: CollectiveKind | None = None,
           name: str = "", group: CommGroup = TP) -> int:
        i = len(self.ops)
        info = CollectiveInfo(coll, nbytes, group) if coll is not None else None
        stream = Stream.TP_COMM if coll is not None else Stream.COMPUTE
        self.ops.append(OpRecord(i, name or f"op{i}", OpKind.COLLECTIVE if coll else kind, phase, stream, (), (),
                                 flops, 0 if coll else nbytes, 0, tuple(deps), info))
        return i

    def trace(self) -> LayerTrace:
        key = TraceKey(StageKind.BLOCK, "synthetic", 8, False, 1, 2048, "bf16", "none", "test")
        return LayerTrace(key, tuple(self.ops), saved_bytes=0)


def run(b: Builder, model: InterferenceModel | None = None):
    return replay_layer(b.trace(), FlopsModel(), BytesComm(), CLUSTER, DType.BF16,
                        model if model is not None else load_interference(None))


def check_invariant(p):
    assert p.duration_s == pytest.approx(p.compute_s + p.tp_comm_exposed_s + p.ep_comm_exposed_s + p.interference_s,
                                         rel=1e-12, abs=1e-15)
    assert p.tp_comm_exposed_s >= 0 and p.ep_comm_exposed_s >= 0 and p.interference_s >= 0


def test_the_expert_exchange_is_exposed_as_its_own_part():
    """An MoE layer's dispatch and combine that the compute waits on are the expert exchange, not TP
    communication; a TP all-reduce in the same phase stays TP."""
    ep = CommGroup(GroupKind.EP, 8)
    b = Builder()
    router = b.op(OpKind.GEMM, Phase.FORWARD, flops=1e9)  # 1 ms
    dispatch = b.op(None, Phase.FORWARD, deps=(router,), nbytes=2 * 10**8, coll=CollectiveKind.ALL_TO_ALL, group=ep)
    experts = b.op(OpKind.GEMM, Phase.FORWARD, deps=(dispatch,), flops=3e9)  # 3 ms
    combine = b.op(None, Phase.FORWARD, deps=(experts,), nbytes=2 * 10**8, coll=CollectiveKind.ALL_TO_ALL, group=ep)
    out = b.op(OpKind.GEMM, Phase.FORWARD, deps=(combine,), flops=1e9)
    b.op(None, Phase.FORWARD, deps=(out,), nbytes=10**8, coll=CollectiveKind.ALL_REDUCE)  # TP, 1 ms
    f = run(b).forward
    assert f.ep_comm_exposed_s == pytest.approx(4e-3)  # two 2 ms exchanges, nothing beside them
    assert f.tp_comm_exposed_s == pytest.approx(1e-3)
    check_invariant(f)


def test_row_parallel_forward_all_reduce_is_exposed():
    b = Builder()
    g = b.op(OpKind.GEMM, Phase.FORWARD, flops=2e9)  # 2 ms
    ar = b.op(None, Phase.FORWARD, deps=(g,), nbytes=10**8, coll=CollectiveKind.ALL_REDUCE)  # 1 ms
    w = b.op(OpKind.VIEW, Phase.FORWARD, deps=(ar,), name="wait_tensor")
    b.op(OpKind.ELEMENTWISE, Phase.FORWARD, deps=(w,), nbytes=5 * 10**8)  # 0.5 ms
    f = run(b).forward
    assert f.compute_s == pytest.approx(2.5e-3)
    assert f.tp_comm_exposed_s == pytest.approx(1e-3)
    assert f.interference_s == 0.0  # nothing ran beside the collective
    assert f.duration_s == pytest.approx(3.5e-3)
    assert f.ops == 3  # the view launched nothing
    check_invariant(f)


def test_column_parallel_backward_overlaps_and_interferes():
    b = Builder()
    fwd = b.op(OpKind.GEMM, Phase.FORWARD, flops=1e9)
    gi = b.op(OpKind.GEMM, Phase.BACKWARD, deps=(fwd,), flops=2e9)  # input gradient, 2 ms
    ar = b.op(None, Phase.BACKWARD, deps=(gi,), nbytes=10**8, coll=CollectiveKind.ALL_REDUCE)  # 1 ms
    b.op(OpKind.GEMM, Phase.BACKWARD, deps=(fwd,), flops=2e9)  # weight gradient, independent, 2 ms
    w = b.op(OpKind.VIEW, Phase.BACKWARD, deps=(ar,), name="wait_tensor")
    b.op(OpKind.ELEMENTWISE, Phase.BACKWARD, deps=(w,), nbytes=10**8)  # 0.1 ms
    none = run(b, InterferenceModel.none()).backward
    assert none.tp_comm_exposed_s == 0.0  # the all-reduce hides behind the weight-gradient GEMM
    assert none.duration_s == pytest.approx(4.1e-3)
    assert none.tp_comm_hidden_s == pytest.approx(1e-3)
    real = run(b).backward
    assert real.interference_s > 0.0 and real.duration_s > none.duration_s
    check_invariant(real)
    # the exact value: GEMM at 1/f_c beside the AR at 1/f_m; AR (1 ms) ends first when f_m < 2 f_c
    m = load_interference(None)
    fc, fm = m.compute_factor(TaskKind.GEMM, [TaskKind.ALL_REDUCE]), m.comm_factor(TaskKind.ALL_REDUCE, [TaskKind.GEMM])
    ar_end = 1e-3 * fm
    gemm_end = ar_end + (2e-3 - ar_end / fc)
    assert real.duration_s == pytest.approx(2e-3 + gemm_end + 1e-4)
    spans = {s.name: s for s in real.spans}
    assert spans[f"op{ar}"].stream == "tp_comm" and spans[f"op{ar}"].duration_s == pytest.approx(ar_end)


def test_recompute_ops_count_in_backward_and_mix():
    b = Builder()
    a = b.op(OpKind.ATTENTION, Phase.FORWARD, flops=1e9)
    r = b.op(OpKind.ATTENTION, Phase.RECOMPUTE, deps=(a,), flops=1e9)
    b.op(OpKind.GEMM, Phase.BACKWARD, deps=(r,), flops=3e9)
    t = run(b)
    assert t.forward.compute_s == pytest.approx(1e-3)
    assert t.backward.compute_s == pytest.approx(4e-3)
    assert dict(t.backward.work_by_kind) == pytest.approx({TaskKind.ATTENTION: 1e-3, TaskKind.GEMM: 3e-3})
    assert sum(w for _, w in t.backward.mix) == pytest.approx(1.0)
    assert t.total_s == pytest.approx(5e-3)


def test_collective_without_info_is_rejected():
    b = Builder()
    b.ops.append(OpRecord(0, "c10d.all_reduce", OpKind.COLLECTIVE, Phase.FORWARD, Stream.TP_COMM, (), (), 0, 0, 0, ()))
    with pytest.raises(ValueError, match="CollectiveInfo"):
        run(b)


def random_trace(rng: random.Random, n: int) -> Builder:
    b = Builder()
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        start = len(b.ops)
        for _ in range(n):
            k = rng.random()
            pool = list(range(start, len(b.ops))) or list(range(len(b.ops)))
            deps = tuple(rng.sample(pool, k=min(len(pool), rng.randint(0, 2))))
            if k < 0.25:
                b.op(None, phase, deps, nbytes=rng.randint(1, 10**8),
                     coll=rng.choice([CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER]))
            elif k < 0.35:
                b.op(OpKind.VIEW, phase, deps)
            else:
                kind = rng.choice([OpKind.GEMM, OpKind.ATTENTION, OpKind.ELEMENTWISE, OpKind.NORM])
                b.op(kind, phase, deps, flops=rng.uniform(0, 3e9), nbytes=rng.randint(0, 10**9))
    return b


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40), scale=st.floats(0.0, 3.0))
def test_layer_properties(seed, n, scale):
    b = random_trace(random.Random(seed), n)
    model = load_interference(None).scaled(scale)
    t = run(b, model)
    plain = run(b, InterferenceModel.none())
    for p, q in ((t.forward, plain.forward), (t.backward, plain.backward)):
        check_invariant(p)
        # removing interference never makes a phase slower; the no-interference phase has none
        assert q.duration_s <= p.duration_s + 1e-15
        assert q.interference_s == 0.0
        assert p.compute_s == q.compute_s and p.tp_comm_exposed_s == pytest.approx(q.tp_comm_exposed_s)
        assert p.duration_s >= p.compute_s - 1e-15
    # exposed communication = the compute stream's idle time in the no-interference replay
    ops = [op for op in b.ops if op.phase is Phase.FORWARD]
    r = replay(phase_tasks(ops, FlopsModel(), BytesComm(), CLUSTER, DType.BF16))
    idle = sum(g.duration_s for g in r.idle_intervals(0, "compute", until_s=r.makespan_s))
    has_compute = any(t.stream == "compute" for t in r.tasks)
    if has_compute:
        assert idle == pytest.approx(plain.forward.tp_comm_exposed_s, abs=1e-12)


# -- integration: a real traced layer with the analytical compute and NCCL models --------------

@pytest.fixture(scope="module")
def gpt3_block():
    from echo_plan.specs import Recompute, load_model
    from echo_plan.trace.records import StageKind as SK
    from echo_plan.trace.tracer import trace_stage

    return trace_stage(load_model("gpt3-175b"), SK.BLOCK, tp=8, sequence_parallel=False, micro_batch_size=1,
                       dtype=DType.BF16, recompute=Recompute.NONE)


def test_real_traced_layer(gpt3_block):
    from echo_plan.cost.collectives import NcclModel
    from echo_plan.cost.compute import AnalyticalComputeModel

    args = (gpt3_block, AnalyticalComputeModel(), NcclModel(), CLUSTER, DType.BF16)
    real = replay_layer(*args, load_interference(None))
    none = replay_layer(*args, InterferenceModel.none())
    f, b = real.forward, real.backward
    for p in (f, b, none.forward, none.backward):
        check_invariant(p)
        assert p.compute_s > 0 and p.tp_comm_s > 0
    # Megatron-LM forward without sequence parallelism: the row-parallel all-reduces (attention
    # output, MLP output) are read by the next op, so all of their time is exposed, and nothing
    # runs beside them.
    assert f.tp_comm_exposed_s == pytest.approx(f.tp_comm_s)
    assert f.interference_s == 0.0
    # backward: the column-parallel input-gradient all-reduces run beside the weight-gradient GEMMs
    assert b.tp_comm_hidden_s > 0.5 * b.tp_comm_s
    assert b.interference_s > 0.0 and none.backward.interference_s == 0.0
    assert none.backward.duration_s < b.duration_s
    # GEMMs dominate a 175B layer's compute
    assert dict(f.work_by_kind)[TaskKind.GEMM] > 0.5 * f.compute_s
    assert {s.stream for s in b.spans} == {"compute", "tp_comm"}
