"""Outcome JSON round trips, token budgets and the compare arithmetic."""

from __future__ import annotations

import json

import pytest

from echo_plan.errors import EchoPlanError, FileFormatError
from echo_plan.search.compare import build_compare, parse_gpu_list, parse_tokens
from echo_plan.search.serialize import compare_from_json, compare_to_json, outcome_from_json, outcome_to_json
from echo_plan.search.space import space_from_mapping
from echo_plan.search.study import SamplerKind, SearchConfig, run_search
from echo_plan.specs import load_cluster, load_model

from .toy import ToyFactory, toy_memory

SPACE = space_from_mapping({"knobs": {"tp": [2, 4, 8], "pp": [1, 2, 4], "micro_batch_size": [1, 2],
                                      "recompute": ["none", "full"]}})


def _outcome(gpus=64, storage="memory", **kw):
    config = SearchConfig(model=load_model("gpt-13b"), cluster=load_cluster("h800", gpus=gpus), global_batch_size=512,
                          space=SPACE, storage=storage, tokens_budget=kw.pop("tokens", None), **kw)
    return config, run_search(config, ToyFactory(config.model, config.cluster), memory=toy_memory)


def test_search_outcome_round_trips_through_json():
    _, outcome = _outcome(sampler=SamplerKind.NSGA2, n_trials=12)
    text = json.dumps(outcome_to_json(outcome))
    back = outcome_from_json(json.loads(text))
    assert back == outcome


def test_reading_something_else_is_a_file_error():
    with pytest.raises(FileFormatError):
        outcome_from_json({"format": "something"})
    with pytest.raises(FileFormatError):
        outcome_from_json({"format": "echo-plan/search-outcome", "model": {}})


@pytest.mark.parametrize("text, tokens", [("300B", 300e9), ("1.5T", 1.5e12), ("2e12", 2e12), ("500m", 500e6),
                                          ("12345", 12345.0), (" 7 B ", 7e9)])
def test_token_budgets_accept_suffixes(text, tokens):
    assert parse_tokens(text) == pytest.approx(tokens)


@pytest.mark.parametrize("text", ["", "lots", "-3B", "0", "3X", "nanB"])
def test_bad_token_budgets_are_user_errors(text):
    with pytest.raises(EchoPlanError):
        parse_tokens(text)


def test_gpu_lists():
    assert parse_gpu_list("128, 64,64,96") == [64, 96, 128]
    for bad in ("", "64,x", "0", "-8"):
        with pytest.raises(EchoPlanError):
            parse_gpu_list(bad)


def test_compare_arithmetic_and_json():
    outcomes = []
    for gpus in (32, 64):
        config, o = _outcome(gpus=gpus, tokens=300e9)
        outcomes.append((gpus, o))
    c = build_compare(config, outcomes, price=2.5, wall_s=1.0)
    small, big = c.rows
    assert small.scaling_efficiency == pytest.approx(1.0)
    per_gpu = lambda row: row.outcome.best.tokens_per_s / row.num_gpus  # noqa: E731
    assert big.scaling_efficiency == pytest.approx(per_gpu(big) / per_gpu(small))
    for row in c.rows:
        assert row.train_time_s == pytest.approx(300e9 / row.outcome.best.tokens_per_s)
        assert row.gpu_hours == pytest.approx(row.train_time_s / 3600 * row.num_gpus)
        assert row.cost == pytest.approx(row.gpu_hours * 2.5)
    assert compare_from_json(json.loads(json.dumps(compare_to_json(c)))) == c
