"""Filling in the recommended plan's timeline: one simulation at most, and the report says so."""

from dataclasses import replace

import pytest
from report_synthetic import compare_outcome, search_outcome, with_timeline

from echo_plan.errors import SpecError
from echo_plan.report.enrich import compare_with_timeline, search_with_timeline, timeline_simulator
from echo_plan.report.render import detail_row


@pytest.fixture(scope="module")
def bare():
    o = search_outcome(40, seed=4, timeline=False, gbs=256)
    assert not o.best.timeline
    return o


def test_missing_timeline_is_simulated_once_for_the_best_plan(bare):
    calls = []

    def sim(model, cluster, plan, stack):
        calls.append(plan)
        return with_timeline(bare.best)

    filled, note = search_with_timeline(bare, sim)
    assert calls == [bare.best.plan]
    assert filled.best.timeline and filled.best.step_time_s == bare.best.step_time_s
    assert filled.ranked[1:] == bare.ranked[1:]
    assert "simulated once more" in note and "against the stored" not in note


def test_right_after_a_search_the_expected_simulation_needs_no_note(bare):
    filled, note = search_with_timeline(bare, lambda *a: with_timeline(bare.best), fresh=True)
    assert filled.best.timeline and note is None
    other = replace(with_timeline(bare.best), step_time_s=bare.best.step_time_s * 1.2)
    _, note = search_with_timeline(bare, lambda *a: other, fresh=True)
    assert "against the stored" in note  # a different step time is still worth saying


def test_a_different_step_time_is_reported(bare):
    other = replace(with_timeline(bare.best), step_time_s=bare.best.step_time_s * 1.2)
    _, note = search_with_timeline(bare, lambda *a: other)
    assert "against the stored" in note


def test_a_failing_simulation_leaves_the_outcome_and_says_why(bare):
    def sim(*args):
        raise SpecError("tp", 3, "must divide 96")

    same, note = search_with_timeline(bare, sim)
    assert same is bare
    assert note.startswith("No timeline") and "must divide" in note


def test_nothing_is_simulated_when_the_timeline_is_there():
    o = search_outcome(30, seed=1, gbs=256)
    assert o.best.timeline

    def sim(*args):
        raise AssertionError("must not simulate")

    assert search_with_timeline(o, sim) == (o, None)


def test_compare_fills_the_size_shown_in_detail():
    c = compare_outcome(n_trials=20, gbs=256)
    rows = tuple(replace(r, outcome=replace(r.outcome, ranked=(replace(r.outcome.best, timeline=()),
                                                                *r.outcome.ranked[1:])))
                 for r in c.rows)
    bare = replace(c, rows=rows)
    size = detail_row(bare).num_gpus
    filled, note = compare_with_timeline(bare, size, lambda m, cl, p, st: with_timeline(
        next(r.outcome.best for r in bare.rows if r.num_gpus == size)))
    assert note
    for row in filled.rows:
        assert bool(row.outcome.best.timeline) is (row.num_gpus == size)


def test_the_timeline_is_simulated_with_the_stack_the_search_used(tmp_path):
    """A search with a stack of its own (here torchtitan's FSDP) is timed again with that stack, not the
    default one, so the report's chart and its table give the same step."""
    from echo_plan.simulate import simulate
    from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
    from echo_plan.trace.cache import TraceCache

    model, cluster = load_model("llama3-8b"), load_cluster("h100-gt").resized(gpus=8)
    stack = load_stack("torchtitan")
    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 8, "micro_batch_size": 1, "global_batch_size": 8,
                           "recompute": "full", "sharding": "parameters"})
    searched = simulate(model, cluster, plan, stack=stack, cache=TraceCache(str(tmp_path)))
    default = simulate(model, cluster, plan, cache=TraceCache(str(tmp_path)))
    assert abs(default.step_time_s / searched.step_time_s - 1) > 0.01  # the stack matters for this plan
    dump = {"model": model.model_dump(mode="json"), "cluster": cluster.model_dump(mode="json")}
    bare = replace(search_outcome(20, seed=3, timeline=False, gbs=256), ranked=(replace(searched, timeline=()),),
                   stack=stack.model_dump(mode="json"), **dump)
    filled, note = search_with_timeline(bare, timeline_simulator(str(tmp_path)), fresh=True)
    assert filled.best.timeline and note is None  # the same step: nothing to say


def test_the_fault_sensitivity_is_simulated_with_the_stack_the_search_used(monkeypatch):
    """Each top plan's faults are timed with the search's stack (deepseek-v3 here), not the default one."""
    from types import SimpleNamespace

    from echo_plan.report import sensitivity_view as view
    from echo_plan.specs import load_stack

    stacks = []

    def fake(model, cluster, plan, stack=None, **kw):
        stacks.append(None if stack is None else stack.name)
        return SimpleNamespace(step_time_s=1.0)

    monkeypatch.setattr(view, "simulate", fake)
    o = search_outcome(20, seed=3, timeline=False, gbs=256)
    view.sensitivity_rows(replace(o, stack=load_stack("torchtitan").model_dump(mode="json")))
    assert stacks and set(stacks) == {"torchtitan"}
    stacks.clear()
    view.sensitivity_rows(replace(o, stack={}))  # a result that recorded no stack: the default, as before
    assert stacks and set(stacks) == {None}
