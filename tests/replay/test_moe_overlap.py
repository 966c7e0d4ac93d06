"""The stack's MoE all-to-all overlap (``moe_a2a_overlap``): steady-state forward/backward pairs."""

from __future__ import annotations

import pytest

from echo_plan.layout.schedules import Pass, build_schedule, pair_forward_backward
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster, load_stack
from echo_plan.specs.plan import Schedule

ON, OFF = load_stack("megatron-core", {"moe_a2a_overlap": True}), load_stack("megatron-core")


@pytest.fixture(scope="module")
def model(small_moe) -> ModelSpec:
    return small_moe


@pytest.fixture(scope="module")
def memo() -> SimulationMemo:
    return SimulationMemo()


def run(model, plan, stack, memo):
    return simulate(model, load_cluster("h800", gpus=32), plan, stack=stack, memo=memo)


@pytest.mark.parametrize("plan", [
    PlanSpec(dp=32, ep=16, global_batch_size=64),
    PlanSpec(pp=2, dp=16, ep=16, global_batch_size=64, virtual_stages=2, schedule="interleaved"),
])
def test_the_overlap_never_slows_an_moe_step_and_hides_some_exchange(model, memo, plan):
    off, on = run(model, plan, OFF, memo), run(model, plan, ON, memo)
    assert on.step_time_s < off.step_time_s
    assert on.breakdown.total_s == pytest.approx(on.step_time_s, rel=1e-9)
    assert any("pairs each steady-state forward with the next backward" in n for n in on.notes)
    # simulate says how much of the critical stage's exchange the schedule hides: more with the overlap
    hidden = [hidden_share(r) for r in (off, on)]
    assert all(0.0 <= h <= 1.0 for h in hidden) and hidden[1] > hidden[0]


def hidden_share(result) -> float:
    import re

    (note,) = [n for n in result.notes if n.startswith("expert exchange on the critical stage")]
    total, exposed, hidden = re.search(r": ([\d.]+) s per step.*?; ([\d.]+) s of it exposed.*hides (\d+)%", note).groups()
    assert float(exposed) <= float(total) + 0.005
    return int(hidden) / 100


def test_plain_1f1b_over_several_stages_does_not_overlap_and_says_why(model, memo):
    plan = PlanSpec(pp=2, dp=16, ep=16, global_batch_size=64)
    off, on = run(model, plan, OFF, memo), run(model, plan, ON, memo)
    assert on.step_time_s == off.step_time_s
    assert any("needs interleaved 1F1B" in n for n in on.notes)


def test_a_dense_model_is_untouched(memo):
    dense = ModelSpec.build(dict(
        name="small-dense", num_layers=4, hidden_size=512, num_attention_heads=8, num_kv_heads=4, vocab_size=4096,
        seq_length=512, activation="swiglu", norm="rmsnorm", position_embedding="rotary", ffn_hidden_size=1024,
        tied_embeddings=False))
    plan = PlanSpec(dp=32, global_batch_size=64)
    assert run(dense, plan, ON, memo).step_time_s == run(dense, plan, OFF, memo).step_time_s


@pytest.mark.parametrize("schedule,pp,m,v", [(Schedule.ONE_F_ONE_B, 4, 8, 1), (Schedule.ONE_F_ONE_B, 1, 6, 1),
                                             (Schedule.INTERLEAVED, 2, 8, 2)])
def test_only_a_forward_followed_by_a_backward_is_paired(schedule, pp, m, v):
    sched = pair_forward_backward(build_schedule(schedule, pp, m, v))
    for acts in sched.actions:
        for i, a in enumerate(acts):
            follows = i + 1 < len(acts) and acts[i + 1].kind is Pass.BACKWARD
            assert a.paired == (a.kind is Pass.FORWARD and follows)
        assert any(a.paired for a in acts)  # every rank has a steady state here
    assert sched.actions == build_schedule(schedule, pp, m, v).actions  # the same actions, in the same order


def test_a_pair_is_never_shorter_than_its_compute_or_its_exchange(model, memo):
    from echo_plan.replay.layer import replay_layer
    from echo_plan.replay.split import pair_saving
    from echo_plan.trace.records import CollectiveKind

    cluster = load_cluster("h800", gpus=32)
    plan = PlanSpec(dp=32, ep=16, global_batch_size=64)  # the exchange spans two servers
    traces = memo.traces(model, plan, None, OFF)
    comm, compute, itf = memo.default_comm(cluster), memo.default_compute(cluster), memo.default_interference()
    trace = next(t for kind, t in traces.blocks if kind.moe)
    lt = replay_layer(trace, compute, comm, cluster, plan.dtype, itf)
    apart = lt.forward.duration_s + lt.backward.duration_s
    saved = pair_saving(trace, compute, comm, cluster, plan.dtype, itf, apart)
    exchange = sum(comm.time(op.collective.kind, op.collective.nbytes, op.collective.group, cluster).time_s
                   for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL
                   and op.phase.value != "step")
    assert saved > 0.0
    assert apart - saved >= max(lt.forward.compute_s + lt.backward.compute_s, exchange) * (1 - 1e-9)
