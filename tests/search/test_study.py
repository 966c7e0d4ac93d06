"""The Optuna study with a small deterministic evaluator (the search machinery, not the simulator)."""

from __future__ import annotations

import pytest

from echo_plan.errors import EchoPlanError
from echo_plan.search.prune import PruneReason
from echo_plan.search.results import TrialState
from echo_plan.search.space import load_space, space_from_mapping
from echo_plan.search.study import DEFAULT_TRIALS, SamplerKind, SearchConfig, prune_for, run_search
from echo_plan.specs import load_cluster, load_model

from .toy import ToyEvaluator, toy_memory, toy_step


class Shared:
    """A factory handing out one evaluator, so a test can count its calls."""

    def __init__(self, evaluator):
        self.evaluator = evaluator

    def build(self):
        return self.evaluator


def _config(model="gpt3-175b", gpus=96, gbs=1536, **kw):
    kw.setdefault("storage", "memory")
    kw.setdefault("space", load_space())
    return SearchConfig(model=load_model(model), cluster=load_cluster("h800", gpus=gpus), global_batch_size=gbs, **kw)


_PRUNED: dict = {}  # pruning is deterministic: share it between the tests of this module


def _run(config, evaluator=None):
    evaluator = evaluator or ToyEvaluator(config.model, config.cluster)
    key = (config.model.name, config.cluster.num_gpus, config.global_batch_size, config.space.digest())
    if key not in _PRUNED:
        _PRUNED[key] = prune_for(config, toy_memory)
    return run_search(config, Shared(evaluator), pruned=_PRUNED[key]), evaluator


@pytest.mark.parametrize("model, gpus, gbs", [("gpt3-175b", 96, 1536), ("llama2-70b", 256, 1024)])
def test_tpe_default_budget_finds_the_exhaustive_optimum_within_1pct(model, gpus, gbs):
    config = _config(model, gpus, gbs, sampler=SamplerKind.TPE)
    outcome, evaluator = _run(config)
    pruned = _PRUNED[(model, gpus, gbs, config.space.digest())]
    assert len(pruned.valid) > 3 * DEFAULT_TRIALS  # the sampler really has to search
    optimum = min(toy_step(config.model, config.cluster, v.plan).step_time_s for v in pruned.valid)
    assert evaluator.calls == DEFAULT_TRIALS
    assert outcome.best.step_time_s <= optimum * 1.01


def test_same_seed_same_trials_other_seed_other_trials():
    a, _ = _run(_config(sampler=SamplerKind.TPE, n_trials=20, seed=3))
    b, _ = _run(_config(sampler=SamplerKind.TPE, n_trials=20, seed=3))
    c, _ = _run(_config(sampler=SamplerKind.TPE, n_trials=20, seed=4))
    assert [t.plan for t in a.trials] == [t.plan for t in b.trials]
    assert [t.plan for t in a.trials] != [t.plan for t in c.trials]


def test_small_space_is_searched_exhaustively():
    space = space_from_mapping({"knobs": {"tp": [4, 8], "pp": [4, 8], "micro_batch_size": [1, 2],
                                          "recompute": ["selective", "full"]}})
    config = _config("gpt-13b", 64, 512, space=space)
    pruned = prune_for(config, toy_memory)
    outcome, evaluator = _run(config)
    assert outcome.sampler == SamplerKind.GRID.value
    assert evaluator.calls == len(pruned.valid) == len(outcome.ranked) + sum(
        1 for t in outcome.trials if t.result is not None and not t.result.fits)
    assert outcome.best.step_time_s == min(toy_step(config.model, config.cluster, v.plan).step_time_s
                                           for v in pruned.valid)
    steps = [r.step_time_s for r in outcome.ranked]
    assert steps == sorted(steps)


def test_sampled_invalid_plans_are_recorded_with_their_reason():
    outcome, _ = _run(_config(sampler=SamplerKind.TPE, n_trials=40))
    pruned = [t for t in outcome.trials if t.state is TrialState.PRUNED]
    assert pruned
    reasons = {r.value for r in PruneReason}
    assert all(t.pruned_reason in reasons and t.detail for t in pruned)
    assert [t.number for t in outcome.trials] == list(range(len(outcome.trials)))
    assert sum(outcome.pruned_counts.values()) < outcome.candidates_total


def test_resume_reuses_finished_trials(tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    first, ev1 = _run(_config(sampler=SamplerKind.TPE, n_trials=12, storage=url))
    assert ev1.calls == 12
    second, ev2 = _run(_config(sampler=SamplerKind.TPE, n_trials=20, storage=url))
    assert ev2.calls == 8  # only the new plans
    assert second.study_name == first.study_name
    assert [t.plan for t in second.trials[:len(first.trials)]] == [t.plan for t in first.trials]
    third, ev3 = _run(_config(sampler=SamplerKind.TPE, n_trials=20, storage=url))
    assert ev3.calls == 0  # nothing re-simulated: the outcome is rebuilt from storage
    assert [r.plan for r in third.ranked] == [r.plan for r in second.ranked]
    assert [r.step_time_s for r in third.ranked] == [r.step_time_s for r in second.ranked]


class Interrupting(ToyEvaluator):
    def __init__(self, model, cluster, after):
        super().__init__(model, cluster)
        self.after = after

    def evaluate(self, plan):
        if self.calls == self.after:
            raise KeyboardInterrupt
        return super().evaluate(plan)


def test_an_interrupted_search_loses_no_finished_trial(tmp_path):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    config = _config(sampler=SamplerKind.TPE, n_trials=16, storage=url)
    with pytest.raises(KeyboardInterrupt):
        _run(config, Interrupting(config.model, config.cluster, after=11))
    resumed, ev = _run(config)
    simulated = [t for t in resumed.trials if t.state is TrialState.COMPLETE and not t.detail]
    assert len(simulated) == 16
    assert ev.calls == 16 - 11  # the 11 finished before Ctrl-C were kept
    assert len({str(sorted(t.plan.items())) for t in simulated}) == 16  # none simulated twice


class Failing(ToyEvaluator):
    def evaluate(self, plan):
        if plan.pp == 4:
            raise RuntimeError("boom")
        return super().evaluate(plan)


def test_failed_evaluations_are_recorded_and_the_search_goes_on():
    config = _config(sampler=SamplerKind.TPE, n_trials=30)
    outcome, _ = _run(config, Failing(config.model, config.cluster))
    failed = [t for t in outcome.trials if t.state is TrialState.FAILED]
    assert failed and all("boom" in t.detail or "same plan" in t.detail or "repeat" in t.detail for t in failed)
    assert all(r.plan["pp"] != 4 for r in outcome.ranked)
    assert any("failed to simulate" in n for n in outcome.notes)


def test_nsga2_gives_a_pareto_front():
    outcome, _ = _run(_config(sampler=SamplerKind.NSGA2, n_trials=40))
    assert outcome.sampler == "nsga2"
    front = outcome.pareto
    assert front
    for p in front:
        assert not any(q.tokens_per_s > p.tokens_per_s and q.memory_peak_gib < p.memory_peak_gib
                       for q in outcome.ranked)


def test_a_space_with_no_valid_plan_is_an_error_that_points_to_explain():
    space = space_from_mapping({"knobs": {"tp": [3]}})
    with pytest.raises(EchoPlanError, match="--explain"):
        _run(_config(gpus=64, space=space))


def test_tpe_polish_spends_the_last_fifth_around_the_best_so_far():
    from echo_plan.search.study import POLISH_SHARE, ROUND_SIZE

    budget = 40
    config = _config(sampler=SamplerKind.TPE, n_trials=budget, seed=1)
    outcome, _ = _run(config)
    polished = int(POLISH_SHARE * budget)
    assert any(f"the last {polished} plans were the nearest neighbours" in n for n in outcome.notes)
    simulated = [r for r in outcome.trials if r.state is TrialState.COMPLETE and not r.detail]
    assert len(simulated) == budget
    varying = [k.value for k in config.space.varying]
    # each polish round is centred on the fastest fitting plan simulated before it and takes the
    # nearest plans first: its first is one move away, none is more than two, and they are much
    # nearer to that centre than the plans TPE proposed
    def moves(plan, centre):
        changed = {k for k in varying if plan[k] != centre[k]}
        if 1 in (plan["dp"], centre["dp"]):  # a dp-1 plan shows these knobs normalised, not as chosen
            changed -= {"distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather"}
        if {"tp", "pp"} <= changed and plan["dp"] == centre["dp"]:
            changed -= {"pp"}  # moving GPUs between TP and PP at the same dp is one move
        return len(changed)

    for start in range(budget - polished, budget, ROUND_SIZE):
        before = [r.result for r in simulated[:start] if r.result.fits]
        centre = min(before, key=lambda r: r.step_time_s).plan
        near = [moves(rec.plan, centre) for rec in simulated[start:start + ROUND_SIZE]]
        tpe = [moves(rec.plan, centre) for rec in simulated[:budget - polished]]
        assert near[0] <= 1 and max(near) <= 2, near
        assert sum(near) / len(near) < sum(tpe) / len(tpe) - 1


def test_ray_advice_only_when_one_process_would_have_been_faster():
    from echo_plan.search.results import TrialRecord, TrialState
    from echo_plan.search.ray_eval import ray_advice

    class R:  # a finished trial with a result
        pass

    recs = [TrialRecord(i, {}, TrialState.COMPLETE, R(), wall_s=1.0) for i in range(4)]
    assert ray_advice(recs, wall_s=10.0, workers=2)[0].startswith("in-process would have been faster here: "
                                                                  "the plans took 4.0 s")
    assert ray_advice(recs, wall_s=3.0, workers=2) == []
