"""Local worker processes (no Ray): the same ranking as in-process, a dying worker loses nothing."""

from __future__ import annotations

import pytest

from echo_plan.search.process_pool import MIN_PLANS_FOR_PROCESSES, auto_processes, usable_cpus
from echo_plan.search.results import TrialState
from echo_plan.search.space import space_from_mapping
from echo_plan.search.study import SamplerKind, SearchConfig, run_search
from echo_plan.specs import load_cluster, load_model

from . import toy
from .dying import DyingFactory

SPACE = space_from_mapping({"knobs": {"tp": [2, 4, 8], "pp": [1, 2, 4], "micro_batch_size": [1, 2],
                                      "recompute": ["none", "selective"]}})


def config(tmp_path, processes, name, sampler=SamplerKind.TPE, trials=20, space=SPACE):
    model, cluster = load_model("gpt-13b"), load_cluster("h800", gpus=64)
    return SearchConfig(model=model, cluster=cluster, global_batch_size=512, space=space, sampler=sampler,
                        n_trials=trials, processes=processes, storage=f"sqlite:///{tmp_path / name}")


def test_processes_rank_like_in_process(tmp_path):
    c1 = config(tmp_path, 1, "one.db")
    one = run_search(c1, toy.ToyFactory(c1.model, c1.cluster), memory=toy.toy_memory)
    c2 = config(tmp_path, 2, "two.db")
    two = run_search(c2, toy.ToyFactory(c2.model, c2.cluster), memory=toy.toy_memory)
    assert [(r.plan, r.step_time_s) for r in two.ranked] == [(r.plan, r.step_time_s) for r in one.ranked]
    assert [t.plan for t in two.trials] == [t.plan for t in one.trials]  # the sampler saw the same answers
    assert "evaluated on 2 local processes" in two.notes
    assert not any("local processes" in n for n in one.notes)


def test_a_dying_worker_fails_its_plan_only_and_is_restarted(tmp_path):
    space = space_from_mapping({"knobs": {"tp": [4, 8], "pp": [1, 2, 4]}})  # one plan kills its worker
    c = config(tmp_path, 2, "dying.db", sampler=SamplerKind.GRID, trials=None, space=space)
    outcome = run_search(c, DyingFactory(c.model, c.cluster), memory=toy.toy_memory)
    failed = [t for t in outcome.trials if t.state is TrialState.FAILED]
    assert failed and all(t.plan["tp"] == 8 and t.plan["pp"] == 2 and "worker failed" in t.detail for t in failed)
    done = [t for t in outcome.trials if t.state is TrialState.COMPLETE]
    assert len(done) + len(failed) == len(outcome.trials)
    assert any(t.plan["tp"] == 8 and t.plan["pp"] == 4 for t in done)  # plans after a death still ran
    assert any("died and were restarted" in n for n in outcome.notes)


def test_small_searches_and_one_cpu_stay_in_process(monkeypatch):
    assert auto_processes(MIN_PLANS_FOR_PROCESSES - 1) == 1
    monkeypatch.setattr("echo_plan.search.process_pool.usable_cpus", lambda: 1)
    assert auto_processes(1000) == 1
    monkeypatch.setattr("echo_plan.search.process_pool.usable_cpus", lambda: 64)
    assert 2 <= auto_processes(1000) <= 4
    assert usable_cpus() >= 1


@pytest.mark.parametrize("args, says", [
    (["--processes", "0"], "--processes"),
    (["--processes", "2", "--workers", "2"], "--processes"),
])
def test_bad_process_counts_are_one_line_errors(args, says, capsys):
    from echo_plan.cli import main

    assert main(["search", "--gpus", "8", "--model", "llama2-7b", "--storage", "memory", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_compare_on_processes_ranks_every_size_like_in_process(tmp_path):
    from echo_plan.search.compare import run_compare

    ranked = {}
    for n in (1, 2):  # with processes, the sizes' spaces are checked ahead in a thread
        base = config(tmp_path, n, f"compare{n}.db", trials=12)
        out = run_compare(base, [32, 64], lambda c: toy.ToyFactory(base.model, c))
        ranked[n] = [(r.num_gpus, [(x.plan, x.step_time_s) for x in r.outcome.ranked], r.outcome.candidates_total)
                     for r in out.rows]
    assert ranked[2] == ranked[1] and all(plans for _, plans, _ in ranked[1])
