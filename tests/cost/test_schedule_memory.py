"""Activation peaks of the schedules that split the backward, walked from their action lists."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.cost.memory import estimate_memory
from echo_plan.cost.schedule_memory import held_profile, profile_microbatches, profile_peak, walk_peak
from echo_plan.layout.schedules import build_schedule
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.plan import Schedule

SPLIT = [(Schedule.ZB_H1, 1), (Schedule.ZB_V, 2), (Schedule.DUALPIPE, 1)]


def peak_units(schedule, pp, m, v, held=1.0, kept=1.0):
    sched = build_schedule(schedule, pp, m, v)
    per_chunk = [held / sched.virtual_stages * (2 if schedule is Schedule.DUALPIPE else 1)] * sched.virtual_stages
    keep = [kept / sched.virtual_stages * (2 if schedule is Schedule.DUALPIPE else 1)] * sched.virtual_stages
    return [walk_peak(acts, per_chunk, keep) for acts in sched.actions]


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 32), (8, 16), (8, 40)])
def test_zero_bubble_holds_1f1b_peak_and_dualpipe_one_more(pp, m):
    # W keeping as much as the forward saved (the worst case): ZB-H1 and ZB-V never hold more than
    # 1F1B's first stage (pp micro-batches of a stage); DualPipe holds pp + 1 (DeepSeek-V3's table).
    base = max(peak_units(Schedule.ONE_F_ONE_B, pp, m, 1))
    assert base == pp
    assert max(peak_units(Schedule.ZB_H1, pp, m, 1)) == pytest.approx(base)
    assert max(peak_units(Schedule.ZB_V, pp, m, 2)) <= base + 1e-9
    assert max(peak_units(Schedule.DUALPIPE, pp, m, 1)) == pytest.approx(pp + 1)


@pytest.mark.parametrize("schedule,v", SPLIT)
@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_the_profile_of_4pp_microbatches_gives_every_peak(schedule, v, pp):
    rng = random.Random(pp)
    for m in (2 * pp, 6 * pp, 11 * pp):
        if schedule is Schedule.DUALPIPE and m % 2:
            continue
        sched = build_schedule(schedule, pp, m, v)
        prof = held_profile(schedule, pp, profile_microbatches(schedule, pp, m), v)
        for _ in range(5):
            held = [rng.random() for _ in range(sched.virtual_stages)]
            kept = [2 * rng.random() for _ in range(sched.virtual_stages)]
            for r in range(pp):
                assert profile_peak(prof[r], held, kept) == pytest.approx(walk_peak(sched.actions[r], held, kept))


def test_dualpipe_holds_two_copies_of_the_parameters():
    model, cluster, stack = load_model("gpt-13b"), load_cluster("h800", gpus=64), load_stack()
    one = estimate_memory(model, PlanSpec(tp=8, pp=4, dp=2, global_batch_size=64), cluster, stack)
    two = estimate_memory(model, PlanSpec(tp=8, pp=4, dp=2, global_batch_size=64, schedule="dualpipe"), cluster, stack)
    for s in range(4):  # rank s holds stage s and stage 3 - s
        assert two[s].weights_bytes == one[s].weights_bytes + one[3 - s].weights_bytes


def test_deferred_weight_gradients_cost_memory_with_full_recompute():
    # Full recomputation keeps only each layer's input, but W reads every linear's input: deferring
    # it keeps the recomputed activations alive, so ZB-H1 needs more than 1F1B there.
    model, cluster, stack = load_model("gpt-13b"), load_cluster("h800", gpus=64), load_stack()
    plan = dict(tp=8, pp=4, dp=2, global_batch_size=64, recompute="full")
    base = estimate_memory(model, PlanSpec(**plan), cluster, stack)
    zb = estimate_memory(model, PlanSpec(**plan, schedule="zb-h1"), cluster, stack)
    assert max(m.activations_bytes for m in zb) > max(m.activations_bytes for m in base)


@given(st.sets(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), max_size=40))
@settings(max_examples=60, deadline=None)
def test_the_maximal_states_are_exactly_those_no_other_state_dominates(states):
    from echo_plan.cost.schedule_memory import _maximal

    keep = _maximal(states)
    assert set(keep) <= states and list(keep) == sorted(keep)
    for x in states:
        dominated = any(y != x and all(p >= q for p, q in zip(y, x)) for y in states)
        assert (x not in keep) == dominated
