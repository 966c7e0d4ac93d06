"""Steady-state extrapolation must equal the full replay, and must refuse what is not periodic."""

import pytest

from echo_plan.replay.results import Breakdown
from echo_plan.replay.steady import StepReplay, sample_counts, steady_state_step


def _replay(m: int, step_of, rank_of=lambda m: 0) -> StepReplay:
    s = step_of(m)
    return StepReplay(m, s, Breakdown(s * 0.8, s * 0.05, 0.0, 0.0, s * 0.15, 0.0, 0.0), rank_of(m), 10 * m)


def test_affine_step_is_extrapolated_and_replays_less():
    calls = []

    def replay_at(m):
        calls.append(m)
        return _replay(m, lambda k: 3.0 + 0.25 * k)

    out = steady_state_step(4, 1, 400, replay_at)
    assert out.extrapolated and out.step_s == pytest.approx(3.0 + 0.25 * 400, rel=1e-12)
    assert out.breakdown.total_s == pytest.approx(out.step_s, rel=1e-12)
    assert 400 not in calls and sum(calls) < 400


def test_not_yet_periodic_falls_back_to_a_full_replay():
    calls = []

    def replay_at(m):
        calls.append(m)
        return _replay(m, lambda k: 3.0 + 0.25 * k + 1e-3 * k * k)  # curved: never linear

    out = steady_state_step(4, 1, 400, replay_at)
    assert not out.extrapolated and calls[-1] == 400
    assert out.step_s == pytest.approx(3.0 + 0.25 * 400 + 1e-3 * 400 * 400)


def test_a_changing_critical_stage_is_not_extrapolated():
    out = steady_state_step(4, 1, 400, lambda m: _replay(m, lambda k: 1.0 + k, rank_of=lambda k: k % 3))
    assert not out.extrapolated


def test_exact_or_short_steps_replay_in_full():
    assert sample_counts(8, 2, 64) is None  # three samples would cost more than the step
    assert sample_counts(1, 1, 10_000) is None  # no pipeline: nothing to extrapolate
    out = steady_state_step(4, 1, 400, lambda m: _replay(m, lambda k: 1.0 + k), exact=True)
    assert not out.extrapolated and out.sampled == (400,)


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=4, dp=1, micro_batch_size=1, global_batch_size=256),
    dict(tp=2, pp=4, dp=1, micro_batch_size=1, global_batch_size=256, virtual_stages=2, sequence_parallel=True),
    dict(tp=1, pp=8, dp=1, micro_batch_size=2, global_batch_size=512, recompute="full", overlap_grad_reduce=False),
    dict(tp=2, pp=4, dp=1, micro_batch_size=1, global_batch_size=256, schedule="gpipe"),
])
def test_simulate_extrapolation_equals_the_full_replay(tmp_path, kw):
    from echo_plan.simulate import SimulationMemo, simulate
    from echo_plan.specs import PlanSpec, load_cluster, load_model
    from echo_plan.trace.cache import TraceCache

    model, cluster, plan = load_model("gpt-13b"), load_cluster("dgx-a100", gpus=8), PlanSpec.build(kw)
    cache, memo = TraceCache(tmp_path), SimulationMemo()
    fast = simulate(model, cluster, plan, cache=cache, memo=memo)
    full = simulate(model, cluster, plan, cache=cache, memo=memo, timeline=True)  # a timeline forces a full replay
    assert any("extrapolated" in n for n in fast.notes)
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    for name, value in full.breakdown.as_json().items():
        assert fast.breakdown.as_json()[name] == pytest.approx(value, rel=1e-9, abs=1e-12 * full.step_time_s)
