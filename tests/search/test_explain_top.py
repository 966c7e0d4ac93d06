"""What the search says about its best plan and the runner-up."""

from __future__ import annotations

from dataclasses import replace

from echo_plan.search.explain import explain_top
from echo_plan.specs import PlanSpec, load_cluster, load_model
from .toy import toy_step


def _pair(best_plan: dict, runner_plan: dict):
    model, cluster = load_model("gpt-13b"), load_cluster("h800", gpus=64)
    best = toy_step(model, cluster, PlanSpec(tp=4, pp=2, dp=8, global_batch_size=64))
    runner = replace(best, step_time_s=best.step_time_s * 1.1)
    return (replace(best, plan={**best.plan, **best_plan}), replace(runner, plan={**best.plan, **runner_plan}))


def test_the_runner_up_line_names_what_changes():
    lines = explain_top(_pair({"tp": 4, "pp": 8, "etp": 4}, {"tp": 2, "pp": 8, "etp": 2}))
    assert "tp 4 -> 2" in lines[1]
    assert "etp" not in lines[1]  # expert TP that only follows tp (a dense model's) is not a change of its own


def test_an_expert_tp_of_its_own_is_named():
    lines = explain_top(_pair({"tp": 4, "etp": 1}, {"tp": 4, "etp": 4}))
    assert "etp 1 -> 4" in lines[1]
