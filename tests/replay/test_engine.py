"""The replay engine: schedule semantics, exact rate-based interference, and its invariants."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from echo_plan.replay.engine import Task, TaskKind, replay
from echo_plan.replay.interference import InterferenceModel

G, M, AR, AG, P2P, D = TaskKind.GEMM, TaskKind.MEMORY, TaskKind.ALL_REDUCE, TaskKind.ALL_GATHER, TaskKind.P2P, TaskKind.DELAY


def model(cf: float = 1.5, mf: float = 1.25, share: bool = False) -> InterferenceModel:
    return InterferenceModel({(G, AR): cf, (M, AR): cf}, {(AR, G): mf, (AR, M): mf}, share_compute=share)


def test_fifo_stream_order_and_deps():
    tasks = [
        Task(0, 0, "compute", 1.0, G),
        Task(1, 0, "comm", 2.0, AR, deps=(0,)),
        Task(2, 0, "compute", 1.0, G),  # independent: runs right after task 0
        Task(3, 0, "compute", 1.0, G, deps=(1,)),  # waits for the collective
    ]
    r = replay(tasks, InterferenceModel.none())
    assert r.start_s == {0: 0.0, 1: 1.0, 2: 1.0, 3: 3.0}
    assert r.end_s == {0: 1.0, 1: 3.0, 2: 2.0, 3: 4.0}
    assert r.makespan_s == 4.0
    assert r.waited_on[3] == 1 and r.waited_on[2] is None and r.waited_on[0] is None
    gaps = r.idle_intervals(0, "compute")
    assert len(gaps) == 1 and gaps[0].start_s == 2.0 and gaps[0].end_s == 3.0 and gaps[0].waited_on == 1
    assert r.device_end(0) == 4.0 and r.device_end(7) == 0.0
    assert r.stream_ids(0, "compute") == (0, 2, 3) and r.stream_ids(0, "nope") == ()
    assert r.busy_s(0, "compute") == 3.0 and r.busy_s(0, "comm") == 2.0


def test_exact_piecewise_linear_progress():
    # A GEMM of 2 s beside an all-reduce of 1 s. Both start at 0. GEMM runs at 1/1.5, AR at 1/1.25.
    # AR ends at 1.25 (work 1 at rate 0.8). By then GEMM did 1.25/1.5 = 0.8333 s of work;
    # the remaining 1.1667 s run alone, so GEMM ends at 1.25 + 1.1667 = 2.41667.
    r = replay([Task(0, 0, "compute", 2.0, G), Task(1, 0, "comm", 1.0, AR)], model())
    assert r.end_s[1] == pytest.approx(1.25)
    assert r.end_s[0] == pytest.approx(1.25 + (2.0 - 1.25 / 1.5))
    assert r.slowdown_s[0] == pytest.approx(r.end_s[0] - 2.0)
    assert r.total_slowdown_s == pytest.approx(r.slowdown_s[0] + r.slowdown_s[1])


def test_rate_changes_when_a_task_starts_mid_way():
    # GEMM 3 s from 0; a collective starts at 1 (after a 1 s delay on the comm stream) and lasts
    # 1 s of work at rate 1/1.25 -> ends at 2.25; GEMM: 1 s done alone, then 1.25/1.5 while
    # overlapped, then the rest alone.
    tasks = [Task(0, 0, "compute", 3.0, G), Task(1, 0, "comm", 1.0, D), Task(2, 0, "comm", 1.0, AR)]
    r = replay(tasks, model())
    assert r.start_s[2] == pytest.approx(1.0) and r.end_s[2] == pytest.approx(2.25)
    assert r.end_s[0] == pytest.approx(2.25 + (3.0 - 1.0 - 1.25 / 1.5))


def test_devices_do_not_interfere():
    tasks = [Task(0, 0, "compute", 2.0, G), Task(1, 1, "comm", 1.0, AR)]
    r = replay(tasks, model())
    assert r.end_s == {0: 2.0, 1: 1.0}


def test_delay_neither_suffers_nor_causes():
    r = replay([Task(0, 0, "compute", 2.0, G), Task(1, 0, "host", 1.0, D)], model(share=True))
    assert r.end_s == {0: 2.0, 1: 1.0}


def test_compute_sharing_time_slices():
    tasks = [Task(0, 0, "a", 1.0, G), Task(1, 0, "b", 1.0, G)]
    assert replay(tasks, model(share=True)).makespan_s == pytest.approx(2.0)
    assert replay(tasks, model(share=False)).makespan_s == pytest.approx(1.0)


def test_mix_blends_factors():
    # Half GEMM (x1.5) and half memory-bound (x1.0 here) beside a long all-reduce: x1.25.
    m = InterferenceModel({(G, AR): 1.5}, {}, share_compute=False)
    tasks = [Task(0, 0, "compute", 1.0, G, mix=((G, 1.0), (M, 1.0))), Task(1, 0, "comm", 10.0, AR)]
    assert replay(tasks, m).end_s[0] == pytest.approx(1.25)


def test_cross_device_dependency():
    tasks = [Task(0, 0, "compute", 1.0, G), Task(1, 0, "pp", 0.5, P2P, deps=(0,)),
             Task(2, 1, "compute", 1.0, G, deps=(1,))]
    r = replay(tasks)
    assert r.start_s[2] == 1.5 and r.makespan_s == 2.5 and r.waited_on[2] == 1


def test_zero_work_and_empty():
    assert replay([]).makespan_s == 0.0
    r = replay([Task(0, 0, "c", 0.0, G), Task(1, 0, "c", 1.0, G, deps=(0,))], model())
    assert r.end_s == {0: 0.0, 1: 1.0}


@pytest.mark.parametrize("tasks, match", [
    ([Task(0, 0, "c", 1.0, G), Task(0, 0, "c", 1.0, G)], "duplicate"),
    ([Task(0, 0, "c", 1.0, G, deps=(5,))], "unknown"),
    ([Task(0, 0, "c", -1.0, G)], "work_s"),
    ([Task(0, 0, "c", math.nan, G)], "work_s"),
    ([Task(0, 0, "c", 1.0, G, deps=(1,)), Task(1, 0, "d", 1.0, G, deps=(0,))], "deadlock"),
    ([Task(0, 0, "c", 1.0, G, deps=(1,)), Task(1, 0, "c", 1.0, G)], "deadlock"),  # waits on a later task of its stream
])
def test_invalid_graphs(tasks, match):
    with pytest.raises(ValueError, match=match):
        replay(tasks)


# -- properties on random graphs --------------------------------------------------------------

KINDS = [G, TaskKind.ATTENTION, M, AR, AG, TaskKind.REDUCE_SCATTER, P2P, D]
STREAMS = ["compute", "tp_comm", "dp_comm", "pp_comm"]


def random_tasks(rng: random.Random, n: int, devices: int) -> list[Task]:
    tasks = []
    for i in range(n):
        deps = tuple(sorted(rng.sample(range(i), k=min(i, rng.randint(0, 2)))))
        kind = rng.choice(KINDS)
        stream = "compute" if kind.is_compute else rng.choice(STREAMS[1:])
        mix = ((G, 0.7), (M, 0.3)) if kind is G and rng.random() < 0.2 else None
        work = 0.0 if rng.random() < 0.05 else rng.uniform(0.01, 2.0)
        tasks.append(Task(i, rng.randrange(devices), stream, work, kind, deps=deps, mix=mix))
    return tasks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60), devices=st.integers(1, 3))
def test_properties(seed, n, devices):
    rng = random.Random(seed)
    tasks = random_tasks(rng, n, devices)
    plain = replay(tasks, InterferenceModel.none())
    real = load_default()
    slow = replay(tasks, real)
    for t in tasks:
        # the plain schedule: end = start + work, start = max(stream free, deps' ends)
        assert plain.end_s[t.id] == pytest.approx(plain.start_s[t.id] + t.work_s)
        for d in t.deps:
            assert plain.start_s[t.id] >= plain.end_s[d] - 1e-12
            assert slow.start_s[t.id] >= slow.end_s[d] - 1e-12
        # interference only ever slows a task, and removing it never delays anything
        assert slow.end_s[t.id] - slow.start_s[t.id] >= t.work_s - 1e-9
        assert slow.slowdown_s[t.id] >= 0.0
        assert plain.end_s[t.id] <= slow.end_s[t.id] + 1e-9
    assert plain.makespan_s <= slow.makespan_s + 1e-9
    # stream FIFO: no overlap and order kept within a (device, stream)
    for res in (plain, slow):
        last: dict[tuple[int, str], float] = {}
        for t in tasks:
            key = (t.device, t.stream)
            assert res.start_s[t.id] >= last.get(key, 0.0) - 1e-12
            last[key] = res.end_s[t.id]
    # the general (rate-tracking) path with factors that never apply gives the plain schedule
    unused = InterferenceModel({(TaskKind.ATTENTION, TaskKind.BROADCAST): 3.0}, {}, share_compute=False)
    assert not unused.is_none
    general = replay(tasks, unused)
    for t in tasks:
        assert general.start_s[t.id] == pytest.approx(plain.start_s[t.id])
        assert general.end_s[t.id] == pytest.approx(plain.end_s[t.id])
    # scaling the excess to zero (and no SM sharing) is no interference
    z = replay(tasks, InterferenceModel(real.scaled(0.0).compute_slowdown, real.scaled(0.0).comm_slowdown,
                                        share_compute=False))
    assert z.makespan_s == pytest.approx(plain.makespan_s)


def test_speed_smoke():
    # 20k tasks, two streams, collectives overlapping compute: well under a few seconds.
    import time

    rng = random.Random(1)
    tasks = []
    for i in range(10_000):
        tasks.append(Task(2 * i, 0, "compute", rng.uniform(1e-4, 1e-3), G, deps=(2 * i - 2,) if i else ()))
        tasks.append(Task(2 * i + 1, 0, "dp_comm", rng.uniform(1e-4, 1e-3), AR, deps=(2 * i,)))
    t0 = time.perf_counter()
    r = replay(tasks, load_default())
    assert time.perf_counter() - t0 < 5.0
    assert r.total_slowdown_s > 0.0


def load_default() -> InterferenceModel:
    from echo_plan.replay.interference import load_interference

    return load_interference(None)
