"""Properties every pipeline schedule must hold, for all shapes (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.errors import SpecError
from echo_plan.layout.schedules import Action, Pass, action_deps, build_schedule
from echo_plan.specs.plan import Schedule


def run_unit_times(sched, f=1.0, b=2.0):
    """List-schedule the actions with fixed durations; returns finish time per (rank, action).

    Raises if the per-rank orders plus cross-rank deps contain a cycle (a deadlock)."""
    pos = [0] * sched.pp
    free = [0.0] * sched.pp
    done: dict[tuple[int, Action], float] = {}
    total = sum(len(a) for a in sched.actions)
    while len(done) < total:
        progressed = False
        for r in range(sched.pp):
            while pos[r] < len(sched.actions[r]):
                act = sched.actions[r][pos[r]]
                deps = action_deps(sched, r, act)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + (f if act.kind is Pass.FORWARD else b / 2 if act.kind.split else b)
                done[(r, act)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise AssertionError("deadlock: dependencies and rank orders form a cycle")
    return done


shapes = st.tuples(st.integers(1, 8), st.integers(1, 6), st.integers(1, 4)).map(
    lambda t: (t[0], t[0] * t[1], t[2]))  # pp, microbatches (multiple of pp), virtual stages


def all_schedules(pp, m, v):
    out = [build_schedule(Schedule.GPIPE, pp, m), build_schedule(Schedule.ONE_F_ONE_B, pp, m),
           build_schedule(Schedule.ZB_H1, pp, m)]
    if pp > 1 and v > 1:
        out.append(build_schedule(Schedule.INTERLEAVED, pp, m, v))
    if pp > 1:
        out.append(build_schedule(Schedule.ZB_V, pp, m, 2))
    if pp % 2 == 0 and m % 2 == 0 and m >= 2 * pp:
        out.append(build_schedule(Schedule.DUALPIPE, pp, m))
    return out


def passes_of(sched):
    """The passes a schedule must run: per micro-batch of each chunk's direction, F then B or Bi + W."""
    per_chunk = sched.num_microbatches // 2 if sched.layout.value == "dual" else sched.num_microbatches
    return per_chunk


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_each_pass_appears_exactly_once(shape):
    pp, m, v = shape
    for sched in all_schedules(pp, m, v):
        n = passes_of(sched)
        for r, acts in enumerate(sched.actions):
            got = [(a.kind, a.microbatch, a.chunk) for a in acts]
            assert len(got) == len(set(got))
            for mb in range(n):
                for c in range(sched.virtual_stages):
                    kinds = {k for k, i, cc in got if i == mb and cc == c}
                    assert kinds in ({Pass.FORWARD, Pass.BACKWARD}, {Pass.FORWARD, Pass.INPUT_GRAD, Pass.WEIGHT_GRAD})


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_no_deadlock_and_backward_after_forward(shape):
    pp, m, v = shape
    for sched in all_schedules(pp, m, v):
        done = run_unit_times(sched)
        for (r, a), t in done.items():
            if a.kind is not Pass.FORWARD:
                assert t > done[(r, Action(Pass.FORWARD, a.microbatch, a.chunk))]
            if a.kind is Pass.WEIGHT_GRAD:
                assert t > done[(r, Action(Pass.INPUT_GRAD, a.microbatch, a.chunk))]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40))
def test_1f1b_in_flight_bounded(pp, m):
    sched = build_schedule(Schedule.ONE_F_ONE_B, pp, m)
    for s, acts in enumerate(sched.actions):
        live = peak = 0
        for a in acts:
            live += 1 if a.kind is Pass.FORWARD else -1
            peak = max(peak, live)
        assert peak <= pp - s
        assert peak == min(pp - s, m)


def test_gpipe_keeps_all_microbatches_in_flight():
    sched = build_schedule(Schedule.GPIPE, 4, 8)
    assert all(acts[7].kind is Pass.FORWARD and acts[8].kind is Pass.BACKWARD for acts in sched.actions)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_1f1b_bubble_matches_closed_form(pp, m):
    # With forward 1 and backward 2 per stage the step is (m + pp - 1) * 3 (Narayanan et al. 2021).
    done = run_unit_times(build_schedule(Schedule.ONE_F_ONE_B, pp, m))
    assert max(done.values()) == pytest.approx((m + pp - 1) * 3)


@pytest.mark.parametrize("pp,m,v", [(4, 8, 2), (4, 8, 4), (8, 16, 2), (2, 4, 3)])
def test_interleaving_shrinks_the_bubble(pp, m, v):
    # Each chunk is 1/v of the stage: bubble (pp-1)*(f+b)/v instead of (pp-1)*(f+b).
    plain = max(run_unit_times(build_schedule(Schedule.ONE_F_ONE_B, pp, m)).values())
    inter = max(run_unit_times(build_schedule(Schedule.INTERLEAVED, pp, m, v), 1.0 / v, 2.0 / v).values())
    assert inter < plain
    assert inter >= m * 3 - 1e-9


def test_interleaved_first_rank_order_matches_megatron():
    # pp=2, v=2, m=4: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards:
    # mb0 c0, mb1 c0, mb0 c1, mb1 c1; its first backward is mb0 on chunk 1 (the last virtual stage).
    acts = build_schedule(Schedule.INTERLEAVED, 2, 4, 2).actions[0]
    assert [(a.kind.value, a.microbatch, a.chunk) for a in acts[:6]] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1)]


def test_bad_shapes_raise_spec_error():
    with pytest.raises(SpecError):
        build_schedule(Schedule.INTERLEAVED, 4, 6, 2)
    with pytest.raises(SpecError):
        build_schedule(Schedule.GPIPE, 4, 8, 2)
    with pytest.raises(SpecError):
        build_schedule(Schedule.ONE_F_ONE_B, 0, 8)


@pytest.mark.parametrize("schedule, pp, m, v", [
    (Schedule.ONE_F_ONE_B, 4, 16, 1), (Schedule.GPIPE, 2, 5, 1), (Schedule.INTERLEAVED, 4, 8, 2),
    (Schedule.INTERLEAVED, 4, 6, 2), (Schedule.ONE_F_ONE_B, 4, 8, 2), (Schedule.ZB_H1, 4, 8, 1),
    (Schedule.ZB_H1, 4, 8, 2), (Schedule.ZB_V, 4, 8, 2), (Schedule.ZB_V, 4, 8, 3), (Schedule.DUALPIPE, 4, 8, 1),
    (Schedule.DUALPIPE, 4, 6, 1), (Schedule.DUALPIPE, 3, 12, 1),
])
def test_the_shape_without_actions_is_the_built_schedule_and_fails_the_same_way(schedule, pp, m, v):
    from echo_plan.errors import SpecError
    from echo_plan.layout.schedules import schedule_shape

    try:
        built = build_schedule(schedule, pp, m, v)
    except SpecError as exc:
        with pytest.raises(SpecError) as got:
            schedule_shape(schedule, pp, m, v)
        assert str(got.value) == str(exc)
        return
    shape = schedule_shape(schedule, pp, m, v)
    assert shape.actions == ()
    assert (shape.schedule, shape.pp, shape.virtual_stages, shape.num_microbatches, shape.layout) == (
        built.schedule, built.pp, built.virtual_stages, built.num_microbatches, built.layout)
    assert [shape.virtual_stage(r, c) for r in range(pp) for c in range(shape.virtual_stages)] == [
        built.virtual_stage(r, c) for r in range(pp) for c in range(built.virtual_stages)]
