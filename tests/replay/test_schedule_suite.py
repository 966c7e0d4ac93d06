"""The shared suite every pipeline schedule must pass (issue 19), on synthetic stage costs.

Each test is parametrized over every schedule in ``Schedule``; a new schedule joins by existing.
"""

from __future__ import annotations

import pytest

from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.specs.plan import Schedule, schedule_rule

from tests.replay.test_pipeline import make_costs, run, runnable

ALL = list(Schedule)


def shape(schedule, pp, m):
    sched, v = runnable(schedule, pp, m, 2)
    assert sched is schedule, f"{schedule.value} cannot run pp {pp} m {m}: {schedule_rule(schedule, pp, v, m)}"
    return v


@pytest.mark.parametrize("schedule", ALL)
@pytest.mark.parametrize("pp", [2, 4])
def test_enough_microbatches_converge_to_the_same_compute_bound_step(schedule, pp):
    # No communication, forward 1 and backward 2 per stage: every schedule's steady state runs
    # forward + backward of every stage each micro-batch, so the step grows by f + b per micro-batch.
    v = shape(schedule, pp, 8 * pp)
    steps = [run(make_costs(pp=pp, m=m, v=v, schedule=schedule, p2p=0.0, buckets=0, tp_frac=0.0))[0].makespan_s
             for m in (8 * pp, 16 * pp)]
    per_mb = (steps[1] - steps[0]) / (8 * pp)
    assert per_mb == pytest.approx(3.0, rel=1e-9)


@pytest.mark.parametrize("schedule", [Schedule.ZB_H1, Schedule.ZB_V])
@pytest.mark.parametrize("pp,mult", [(2, 2), (4, 1), (4, 4), (8, 2)])
@pytest.mark.parametrize("w_frac", [0.3, 0.5])
def test_zero_bubble_never_has_a_larger_bubble_than_1f1b(schedule, pp, mult, w_frac):
    # Both hold 1F1B's peak activations (pp micro-batches of a stage on the first rank; tested in
    # tests/cost/test_schedule_memory.py); the weight-gradient share of the backward varies.
    m = pp * mult
    v = shape(schedule, pp, m)
    _, base = run(make_costs(pp=pp, m=m, p2p=0.01, buckets=0, tp_frac=0.0))
    _, zb = run(make_costs(pp=pp, m=m, v=v, schedule=schedule, p2p=0.01, buckets=0, tp_frac=0.0, w_frac=w_frac))
    assert zb.bubble_s <= base.bubble_s + 1e-9


@pytest.mark.parametrize("schedule", ALL)
@pytest.mark.parametrize("interference", ["none", "default"])
def test_breakdown_sums_to_the_step_for_every_schedule(schedule, interference):
    im = InterferenceModel.none() if interference == "none" else load_interference(None)
    v = shape(schedule, 4, 8)
    res, bd = run(make_costs(pp=4, m=8, v=v, schedule=schedule, gather_s=0.2, tied=0.05, pair_saving=0.05), im)
    assert bd.total_s == pytest.approx(res.makespan_s, rel=1e-9, abs=1e-12)
    assert all(part >= -1e-12 for part in bd.as_json().values())


@pytest.mark.parametrize("schedule", ALL)
def test_every_rank_ends_with_its_optimizer_after_all_its_passes(schedule):
    v = shape(schedule, 4, 8)
    steps = __import__("echo_plan.replay.pipeline", fromlist=["build_tasks"]).build_tasks(
        make_costs(pp=4, m=8, v=v, schedule=schedule))
    res, _ = run(make_costs(pp=4, m=8, v=v, schedule=schedule))
    for r in range(4):
        compute = [t for t in steps.tasks if t.device == r and t.stream == "compute"]
        assert compute[-1].category == "optimizer"
        assert res.end_s[compute[-1].id] >= max(res.end_s[t.id] for t in compute[:-1])


def test_dualpipe_overlap_saving_shortens_the_step():
    plain, _ = run(make_costs(pp=4, m=16, schedule=Schedule.DUALPIPE, tp_frac=0.2))
    paired, _ = run(make_costs(pp=4, m=16, schedule=Schedule.DUALPIPE, tp_frac=0.2, pair_saving=0.2))
    assert paired.makespan_s < plain.makespan_s


def test_dualpipe_bubble_is_smaller_than_1f1b():
    _, base = run(make_costs(pp=8, m=16, p2p=0.0, buckets=0, tp_frac=0.0))
    _, dual = run(make_costs(pp=8, m=16, schedule=Schedule.DUALPIPE, p2p=0.0, buckets=0, tp_frac=0.0))
    assert dual.bubble_s < base.bubble_s
