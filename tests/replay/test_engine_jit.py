"""The compiled event loop gives exactly what the Python loop gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from echo_plan.replay.compiled import event_loop
from echo_plan.replay.compiled.switch import CompiledSwitch, JitMode
from echo_plan.replay.engine import Task, TaskKind, replay
from echo_plan.replay.interference import InterferenceModel, load_interference

G, M, AR, AG, RS, P2P, D = (TaskKind.GEMM, TaskKind.MEMORY, TaskKind.ALL_REDUCE, TaskKind.ALL_GATHER,
                            TaskKind.REDUCE_SCATTER, TaskKind.P2P, TaskKind.DELAY)
KINDS = [G, TaskKind.ATTENTION, M, AR, AG, RS, P2P, D]
STREAMS = ["compute", "compute2", "tp_comm", "dp_comm", "pp_fwd", "pp_bwd"]


def both(tasks, model, monkeypatch=None):
    """(compiled, python) replays of the same tasks."""
    on, off = CompiledSwitch(JitMode.ON), CompiledSwitch(JitMode.OFF)
    assert on.rates_for(len(tasks)) is not None and off.rates_for(len(tasks)) is None
    return replay(tasks, model, on), replay(tasks, model, off)


def random_tasks(rng: random.Random, n: int, devices: int, mixes: int) -> list[Task]:
    tasks = []
    for i in range(n):
        deps = tuple(sorted(rng.sample(range(i), k=min(i, rng.randint(0, 3)))))
        kind = rng.choice(KINDS)
        stream = rng.choice(STREAMS[:2]) if kind.is_compute else rng.choice(STREAMS[2:])
        mix = None
        if kind is G and mixes and rng.random() < 0.5:
            share = rng.randrange(1, mixes + 1) / (mixes + 1)
            mix = ((G, share), (M, 1 - share))
        # equal works make equal end times: ties must break the same way in both loops
        work = 0.0 if rng.random() < 0.05 else rng.choice([0.5, 1.0, rng.uniform(0.01, 2.0)])
        tasks.append(Task(i, rng.randrange(devices), stream, work, kind, deps=deps, mix=mix))
    return tasks


def test_numba_is_there():
    # numba is a dependency: the search's speed rests on it, so a silent fallback is a failure
    kernels = CompiledSwitch(JitMode.ON).kernels()
    assert kernels.rates is not None and kernels.build is not None


def test_the_switch_decides_once_per_owner(monkeypatch):
    """auto: small graphs stay in Python until enough tasks passed; off: never; on: always; the mode
    comes from ECHO_PLAN_JIT when the switch is made, and the level-2 build only once the loop loaded."""
    auto = CompiledSwitch(JitMode.AUTO, min_tasks=1000, after_tasks=250)
    assert auto.rates_for(100) is None and auto.rates_for(100) is None and auto.level2() is None
    assert auto.rates_for(100) is not None  # 300 tasks seen: it pays now
    assert auto.level2() is not None
    assert CompiledSwitch(JitMode.AUTO, min_tasks=1000).rates_for(1000) is not None  # one large graph
    off = CompiledSwitch(JitMode.OFF)
    off.expect_many()
    assert off.rates_for(10**6) is None and off.level2() is None and not off.loaded
    monkeypatch.setenv("ECHO_PLAN_JIT", "0")
    assert CompiledSwitch.from_environment().mode is JitMode.OFF
    monkeypatch.setenv("ECHO_PLAN_JIT", "yes")
    assert CompiledSwitch.from_environment().mode is JitMode.ON
    monkeypatch.delenv("ECHO_PLAN_JIT")
    assert CompiledSwitch.from_environment().mode is JitMode.AUTO


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 300), devices=st.integers(1, 5), mixes=st.integers(0, 6))
def test_same_schedule_as_python(seed, n, devices, mixes):
    tasks = random_tasks(random.Random(seed), n, devices, mixes)
    model = load_interference(None)
    with pytest.MonkeyPatch.context() as mp:
        fast, slow = both(tasks, model, mp)
    assert fast.start_at == slow.start_at
    assert fast.end_at == slow.end_at
    assert fast.waited_at == slow.waited_at
    assert fast.makespan_s == slow.makespan_s


def test_deadlock_named_by_both(monkeypatch):
    tasks = [Task(0, 0, "c", 1.0, G, deps=(1,)), Task(1, 0, "d", 1.0, AR, deps=(0,))]
    for mode in (JitMode.ON, JitMode.OFF):
        with pytest.raises(ValueError, match="deadlock: task 0"):
            replay(tasks, load_interference(None), CompiledSwitch(mode))


def test_heap_grows_when_full(monkeypatch):
    # start with a one-slot event heap: the loop must ask for room again and again, losing nothing
    monkeypatch.setattr(event_loop, "HEAP_SLOTS_PER_TASK", 0)
    monkeypatch.setattr(event_loop, "HEAP_MIN_SLOTS", 1)
    tasks = random_tasks(random.Random(11), 400, 3, 3)
    fast, slow = both(tasks, load_interference(None), monkeypatch)
    assert fast.end_at == slow.end_at and fast.start_at == slow.start_at


def test_too_many_profiles_fall_back(monkeypatch):
    # 400 distinct mixes on six streams of one GPU: keys do not fit in 64 bits, the Python loop runs
    rng = random.Random(3)
    tasks = []
    for i in range(2400):
        s = i % 6
        kind = G if s < 2 else AR
        mix = ((G, (i % 400 + 1) / 401), (M, 1 - (i % 400 + 1) / 401)) if kind is G else None
        tasks.append(Task(i, 0, STREAMS[s], rng.uniform(0.1, 1.0), kind, deps=(i - 6,) if i >= 6 else (), mix=mix))
    fast, slow = both(tasks, load_interference(None), monkeypatch)
    assert fast.end_at == slow.end_at


def test_no_interference_factors_give_plain_schedule(monkeypatch):
    rng = random.Random(5)
    tasks = random_tasks(rng, 200, 3, 2)
    unused = InterferenceModel({(TaskKind.ATTENTION, TaskKind.BROADCAST): 3.0}, {}, share_compute=False)
    fast, _ = both(tasks, unused, monkeypatch)
    plain = replay(tasks, InterferenceModel.none())
    assert fast.end_at == pytest.approx(plain.end_at)


def test_real_step_same_both_ways(monkeypatch):
    from echo_plan.simulate import simulate
    from echo_plan.specs import PlanSpec, load_cluster, load_model

    model, cluster = load_model("gpt-13b"), load_cluster("h800", gpus=64)
    plan = PlanSpec(tp=2, pp=4, dp=8, micro_batch_size=1, global_batch_size=256, virtual_stages=2,
                    distributed_optimizer=True)
    monkeypatch.setenv("ECHO_PLAN_JIT", "1")
    fast = simulate(model, cluster, plan)
    monkeypatch.setenv("ECHO_PLAN_JIT", "0")
    slow = simulate(model, cluster, plan)
    assert fast.step_time_s == slow.step_time_s
    assert fast.breakdown == slow.breakdown
