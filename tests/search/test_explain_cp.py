"""The paragraph that explains a search's context-parallel choice."""

from __future__ import annotations

from types import SimpleNamespace

from echo_plan.search.explain_cp import NEEDS_CP, cp_choice
from echo_plan.search.prune import PruneReason


def _result(step_s: float, **plan):
    return SimpleNamespace(step_time_s=step_s, plan={"tp": 8, "cp": 1, **plan})


def test_the_reason_text_is_the_pruners():
    assert NEEDS_CP == PruneReason.NEEDS_CP.value


def test_cp_choice_says_how_the_sequence_is_cut_and_what_the_others_cost():
    best = _result(10.0, cp=16)
    others = [best, _result(12.0, cp=8), _result(11.0, cp=8), _result(15.0, cp=1)]
    text = cp_choice(best, others, 131072, 8, {NEEDS_CP: 3})
    assert "32 chunks of 4,096 tokens" in text and "across 16 servers" in text
    assert "3 candidates without context parallelism were pruned" in text
    assert "cp 1 +50.0%" in text and "cp 8 +10.0%" in text  # the fastest plan of each other cp


def test_a_ring_inside_one_server_says_so():
    assert "inside one server" in cp_choice(_result(1.0, tp=2, cp=4), [], 32768, 8)


def test_nothing_to_say_without_cp_in_sight():
    assert cp_choice(_result(1.0), [_result(2.0)], 4096, 8, {}) == ""
