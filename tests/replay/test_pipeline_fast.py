"""The compiled level-2 build and replay gives exactly what build_tasks and the engine give."""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from echo_plan.replay.compiled import build_kernel, level2
from echo_plan.replay.compiled.switch import CompiledSwitch, JitMode, load_kernels
from echo_plan.replay.breakdown import critical_rank, step_breakdown
from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.replay.pipeline import DpBucket, build_tasks
from echo_plan.layout.schedules import Pass
from echo_plan.specs.plan import Schedule

from tests.replay.test_pipeline import configs, costs_from, make_costs


@functools.cache
def kernels():
    """The compiled level 2's kernels, loaded once for this module (Numba is a dependency: never None)."""
    got = CompiledSwitch(JitMode.ON).level2()
    assert got is not None
    return got


def varied(costs, rng: random.Random, recv: bool, sync: bool, per_stage: bool):
    """``costs`` with uneven buckets, per-rank speeds and p2p times, the receiver's TP gather, sync p2p."""
    pp = costs.schedule.pp
    stages = []
    for stage in costs.stages:
        buckets = tuple(tuple(DpBucket(rng.randint(0, 50), rng.uniform(0.01, 0.3), b.reduce_kind, b.gather_s and
                                       rng.uniform(0.01, 0.2)) for b in bs) for bs in stage.buckets)
        saving = tuple(tuple(rng.choice([0.0, rng.uniform(0.0, 0.3)]) for _ in row) for row in stage.pair_saving_s)
        share = rng.choice([0.0, rng.uniform(0.0, 1.0)])  # part of the exposed communication an expert exchange

        def moe(ph, share=share):
            return replace(ph, tp_comm_exposed_s=ph.tp_comm_exposed_s * (1 - share),
                           ep_comm_exposed_s=ph.tp_comm_exposed_s * share)

        stages.append(replace(stage, buckets=buckets, optimizer_s=rng.uniform(0.0, 0.2), pair_saving_s=saving,
                              forward=tuple(map(moe, stage.forward)), backward=tuple(map(moe, stage.backward))))
    return replace(costs, stages=tuple(stages), p2p_recv_s=0.02 if recv else 0.0, sync_p2p=sync,
                   work_scale=tuple(rng.choice([1.0, 1.0, 1.3, 0.7]) for _ in range(pp)) if per_stage else None,
                   p2p_by_stage=tuple(rng.uniform(0.0, 0.1) for _ in range(pp)) if per_stage else None)


def python_replay(costs, interference):
    steps = build_tasks(costs)
    result = steps.replay(interference)
    return steps, result


def assert_same(costs, interference):
    fast = level2.replay_step(costs, interference, level2.schedule_arrays, lambda: build_tasks(costs).tasks,
                              kernels=kernels())
    steps, slow = python_replay(costs, interference)
    assert fast is not None
    assert fast.n == len(steps.work)
    r = fast.result()
    assert r.work_at == slow.work_at
    assert r.start_at == slow.start_at and r.end_at == slow.end_at
    assert r.waited_at == slow.waited_at and r.prev_at == slow.prev_at
    assert r.streams == slow.streams
    rank = critical_rank(slow, costs.schedule.pp)
    assert fast.rank == rank and fast.makespan_s == slow.makespan_s
    assert fast.breakdown == step_breakdown(steps, slow, rank)  # the compiled breakdown
    assert step_breakdown(fast, r, rank) == fast.breakdown
    assert [fast.info[i] for i in range(fast.n)] == list(steps.info)
    assert r.tasks == steps.tasks  # names on demand, from the Python build


@settings(max_examples=60, deadline=None)
@given(c=configs, seed=st.integers(0, 10**6), recv=st.booleans(), sync=st.booleans(), per_stage=st.booleans())
def test_same_replay_as_build_tasks(c, seed, recv, sync, per_stage):
    costs = varied(costs_from(c), random.Random(seed), recv, sync, per_stage)
    assert_same(costs, load_interference(None))


@pytest.mark.parametrize("schedule,v", [(Schedule.ONE_F_ONE_B, 1), (Schedule.INTERLEAVED, 2), (Schedule.ZB_H1, 1),
                                        (Schedule.ZB_V, 2), (Schedule.GPIPE, 1), (Schedule.DUALPIPE, 1)])
def test_every_schedule_same_replay(schedule, v):
    costs = make_costs(pp=4, m=16, v=v, schedule=schedule, buckets=3, gather_s=0.2, tied=0.05, pair_saving=0.1)
    if schedule is Schedule.DUALPIPE:
        assert any(a.paired for acts in costs.schedule.actions for a in acts)
    assert_same(varied(costs, random.Random(1), True, True, True), load_interference(None))


def test_python_path_where_the_compiled_one_does_not_apply(monkeypatch):
    costs = make_costs(pp=4, m=8)
    arrays, tasks = level2.schedule_arrays, lambda: build_tasks(costs).tasks
    k = kernels()
    assert level2.replay_step(costs, InterferenceModel.none(), arrays, tasks, kernels=k) is None  # the plain pass
    bad = replace(costs, stages=(replace(costs.stages[0], optimizer_s=float("nan")),) + costs.stages[1:])
    assert level2.replay_step(bad, load_interference(None), arrays, tasks, kernels=k) is None  # Python names it
    assert level2.replay_step(costs, load_interference(None), arrays, tasks, kernels=None) is None  # switched off
    assert CompiledSwitch(JitMode.OFF).level2() is None


def test_split_passes_without_their_costs_go_to_python():
    costs = make_costs(pp=4, m=8, schedule=Schedule.ZB_H1)
    assert any(a.kind is Pass.WEIGHT_GRAD for acts in costs.schedule.actions for a in acts)
    bare = replace(costs, stages=tuple(replace(s, input_grad=None, weight_grad=None) for s in costs.stages))
    assert level2.replay_step(bare, load_interference(None), level2.schedule_arrays,
                              lambda: build_tasks(bare).tasks, kernels=kernels()) is None


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 12), mult=st.integers(1, 6), extra=st.integers(0, 3),
       times=st.tuples(*[st.sampled_from([1.0, 0.5, 2.0, 0.37, 1.61])] * 3))
def test_compiled_zb_v_order_is_the_python_one(pp, mult, extra, times):
    from echo_plan.layout.schedules_zb import _zb_v

    m = pp * mult + extra
    assert level2.zb_v_actions(pp, m, times, kernels()) == _zb_v(pp, m, times)


def test_a_builder_that_cannot_run_leaves_the_python_path_with_a_warning(monkeypatch):
    def broken(*args):
        raise RuntimeError("cannot compile here")
    monkeypatch.setattr(build_kernel, "build", broken)
    with pytest.warns(RuntimeWarning, match="level-2 build cannot be used.*Python code"):
        loaded = load_kernels()
    assert loaded.build is None and loaded.rates is not None  # the event loop still runs compiled
    costs = make_costs(pp=2, m=4)
    assert level2.replay_step(costs, load_interference(None), level2.schedule_arrays,
                              lambda: build_tasks(costs).tasks, kernels=None) is None


@pytest.mark.parametrize("schedule,pp,v", [(Schedule.ONE_F_ONE_B, 1, 1), (Schedule.INTERLEAVED, 4, 2)])
def test_ep_overlap_pairs_same_replay(schedule, pp, v):
    """The MoE all-to-all overlap's forward/backward pairs of 1F1B and interleaved 1F1B (the stack's
    moe_a2a_overlap, schedules.pair_forward_backward) replay the same compiled as in Python."""
    from echo_plan.layout.schedules import pair_forward_backward

    costs = make_costs(pp=pp, m=16, v=v, schedule=schedule, buckets=3, gather_s=0.2, pair_saving=0.1)
    costs = replace(costs, schedule=pair_forward_backward(costs.schedule))
    assert any(a.paired for acts in costs.schedule.actions for a in acts)
    assert_same(varied(costs, random.Random(2), True, False, True), load_interference(None))
