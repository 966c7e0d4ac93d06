"""Level-2 step replay on synthetic chunk costs: the properties every schedule must keep."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.replay.breakdown import critical_rank, step_breakdown
from echo_plan.replay.engine import replay
from echo_plan.replay.interference import InterferenceModel, load_interference
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.pipeline import DpBucket, PhaseCost, StageCosts, StepCosts, build_tasks
from echo_plan.layout.schedules import build_schedule
from echo_plan.replay.split import zb_v_times
from echo_plan.specs.plan import Schedule

MIX = ((TaskKind.GEMM, 0.8), (TaskKind.MEMORY, 0.2))


def make_costs(pp=4, m=8, v=1, schedule=Schedule.ONE_F_ONE_B, f=1.0, b=2.0, p2p=0.05, buckets=2,
               reduce_s=0.3, gather_s=0.0, overlap_grad=True, overlap_gather=True, tied=0.0, scale=None,
               tp_frac=0.1, w_frac=0.5, pair_saving=0.0):
    times = zb_v_times(f, b * (1 - w_frac), b * w_frac) if schedule is Schedule.ZB_V else None
    sched = build_schedule(schedule, pp, m, v, times)
    split_v = v  # chunk costs: a stage's share; DualPipe's two chunks are two whole-stage copies
    v = sched.virtual_stages

    def cost(t):
        return PhaseCost(t / split_v, t / split_v * (1 - tp_frac), t / split_v * tp_frac, 0.0, MIX)
    kind = TaskKind.REDUCE_SCATTER if gather_s else TaskKind.ALL_REDUCE
    bk = tuple(DpBucket(100, reduce_s / buckets, kind, gather_s / buckets) for _ in range(buckets))
    stage = StageCosts((cost(f),) * v, (cost(b),) * v, tuple(f"layers {c}" for c in range(v)), (bk,) * v, 0.1,
                       (cost(b * (1 - w_frac)),) * v, (cost(b * w_frac),) * v, ((pair_saving,) * v,) * v)
    return StepCosts(sched, (stage,) * pp, p2p, tied, overlap_grad, overlap_gather, work_scale=scale)


def run(costs, interference=None):
    steps = build_tasks(costs)
    res = replay(steps.tasks, interference or InterferenceModel.none())
    rank = critical_rank(res, costs.schedule.pp)
    return res, step_breakdown(steps, res, rank)


configs = st.fixed_dictionaries({
    "pp": st.integers(1, 6), "mult": st.integers(1, 4), "v": st.integers(1, 3),
    "sched": st.sampled_from(list(Schedule)), "buckets": st.integers(0, 3),
    "gather": st.booleans(), "og": st.booleans(), "opg": st.booleans(), "tied": st.booleans(),
    "p2p": st.sampled_from([0.0, 0.05, 0.4]),
})


def runnable(sched, pp, m, v):
    """(schedule, v) that can run pp stages and m micro-batches: ``sched`` when it can, else 1F1B."""
    if sched is Schedule.INTERLEAVED and (pp == 1 or v == 1):
        return Schedule.ONE_F_ONE_B, 1
    if sched is Schedule.ZB_V:
        return (sched, 2) if pp >= 2 else (Schedule.ONE_F_ONE_B, 1)
    if sched is Schedule.DUALPIPE and (pp % 2 or m % 2 or m < 2 * pp):
        return Schedule.ONE_F_ONE_B, 1
    return sched, (v if sched is Schedule.INTERLEAVED else 1)


def costs_from(c):
    pp, m = c["pp"], c["pp"] * c["mult"]
    sched, v = runnable(c["sched"], pp, m, c["v"])
    return make_costs(pp=pp, m=m, v=v, schedule=sched, buckets=c["buckets"], p2p=c["p2p"],
                      gather_s=0.2 if c["gather"] else 0.0, overlap_grad=c["og"], overlap_gather=c["opg"],
                      tied=0.05 if c["tied"] else 0.0)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_breakdown_adds_up_to_step_time(c):
    costs = costs_from(c)
    for im in (InterferenceModel.none(), load_interference(None)):
        res, bd = run(costs, im)
        assert bd.total_s == pytest.approx(res.makespan_s, rel=1e-9, abs=1e-12)
        for part in bd.as_json().values():
            assert part >= -1e-12


@settings(max_examples=25, deadline=None)
@given(configs)
def test_interference_never_makes_a_step_faster_to_remove(c):
    costs = costs_from(c)
    without, _ = run(costs, InterferenceModel.none())
    with_, _ = run(costs, load_interference(None))
    assert without.makespan_s <= with_.makespan_s + 1e-12


def test_1f1b_without_communication_matches_closed_form():
    res, bd = run(make_costs(pp=4, m=8, p2p=0.0, buckets=0))
    assert res.makespan_s == pytest.approx((8 + 4 - 1) * 3.0 + 0.1)
    assert bd.bubble_s == pytest.approx(3 * 3.0)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_more_microbatches_never_raise_the_1f1b_bubble_fraction(pp):
    fractions = []
    for m in range(1, 33):
        res, bd = run(make_costs(pp=pp, m=m))
        fractions.append(bd.bubble_s / res.makespan_s)
    assert all(b <= a + 1e-12 for a, b in zip(fractions, fractions[1:]))


def test_interleaving_shrinks_the_bubble_with_few_microbatches():
    _, plain = run(make_costs(pp=4, m=4))
    _, inter = run(make_costs(pp=4, m=4, v=2, schedule=Schedule.INTERLEAVED))
    assert inter.bubble_s < plain.bubble_s


def test_overlapping_the_gradient_reduction_hides_it():
    res_over, over = run(make_costs(buckets=4, reduce_s=1.0))
    res_sync, sync = run(make_costs(buckets=4, reduce_s=1.0, overlap_grad=False))
    assert over.dp_comm_exposed_s < sync.dp_comm_exposed_s
    assert sync.dp_comm_exposed_s == pytest.approx(1.0)
    assert res_over.makespan_s < res_sync.makespan_s


def test_param_gather_overlap_hides_the_gather():
    res_over, over = run(make_costs(gather_s=1.0, buckets=4))
    res_sync, sync = run(make_costs(gather_s=1.0, buckets=4, overlap_gather=False))
    assert res_over.makespan_s < res_sync.makespan_s
    assert sync.dp_comm_exposed_s > over.dp_comm_exposed_s


def test_slow_p2p_is_exposed_as_pipeline_communication():
    _, fast = run(make_costs(p2p=0.01))
    _, slow = run(make_costs(p2p=0.5))
    assert slow.pp_comm_exposed_s > fast.pp_comm_exposed_s + 0.5


def test_a_slow_rank_slows_the_step():
    base, _ = run(make_costs())
    slow, _ = run(make_costs(scale=(1.0, 1.5, 1.0, 1.0)))
    assert slow.makespan_s > base.makespan_s


def test_every_task_runs_on_its_rank_streams():
    costs = make_costs(pp=3, m=6, v=2, schedule=Schedule.INTERLEAVED, gather_s=0.2, tied=0.1)
    steps = build_tasks(costs)
    assert {t.stream for t in steps.tasks} == {"compute", "pp_fwd", "pp_bwd", "dp_comm"}
    assert {t.device for t in steps.tasks} == {0, 1, 2}
    assert sum(1 for t in steps.tasks if t.category == "optimizer") == 3


@pytest.mark.parametrize("schedule, v, reduced", [("1f1b", 1, True), ("interleaved", 2, True), ("zb-v", 2, False)])
def test_tied_embeddings_reduce_between_ranks_only_when_the_ends_are_apart(schedule, v, reduced):
    """GPT-3's tied word embeddings: the first and last stages all-reduce their gradient, except in ZB-V's V,
    where rank 0 holds both ends (one copy, nothing to reduce)."""
    from echo_plan.replay.transfers import _params, _tied_time
    from echo_plan.specs import PlanSpec, load_model

    model = load_model("gpt3-175b")
    assert model.tied_embeddings
    plan = PlanSpec.build(dict(tp=8, pp=4, dp=1, global_batch_size=16, schedule=schedule, virtual_stages=v))
    seconds = _tied_time(model, plan, lambda kind, nbytes, group: nbytes / 1e11, 2)
    assert (seconds > 0) is reduced
    _, embedding, output = _params(model, plan)  # and the output keeps its own copy only where it is apart
    word = -(-model.vocab_size * model.hidden_size // plan.tp)
    assert (output >= word) is reduced
