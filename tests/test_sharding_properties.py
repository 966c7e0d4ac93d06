"""Data-parallel sharding and layer recompute: the properties any prediction must keep (issue 34).

Sharding more never raises a GPU's memory; a shard group of one rank is plain data parallelism; HSDP
with one replica is FSDP; recomputing more layers never raises memory and never shortens the step;
the breakdown of an FSDP step still adds up to it, and the exposed data-parallel part is where FSDP's
per-block collectives show."""

from __future__ import annotations

import pytest

from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.plan import Sharding

LEVELS = (Sharding.NONE, Sharding.OPTIMIZER, Sharding.GRADIENTS, Sharding.PARAMETERS)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    return TraceCache(tmp_path_factory.mktemp("traces")), SimulationMemo()


def run(env, stack="torchtitan", model="llama3-8b", gpus=16, seq=2048, cluster="h100-gt", **plan):
    cache, memo = env
    fields = dict(tp=1, pp=1, micro_batch_size=1)
    fields.update(plan)
    fields.setdefault("dp", gpus // (fields["tp"] * fields["pp"] * fields.get("cp", 1)))
    fields.setdefault("global_batch_size", 2 * fields["dp"] * fields["micro_batch_size"])
    m = load_model(model).replace(seq_length=seq)
    return simulate(m, load_cluster(cluster, gpus=gpus), PlanSpec(**fields), cache=cache, memo=memo,
                    stack=load_stack(stack))


def peak(result) -> int:
    return max(m.total_bytes for m in result.memory)


SHAPES = [dict(), dict(tp=2, sequence_parallel=True), dict(pp=2, tp=2, sequence_parallel=True)]


@pytest.mark.parametrize("stack", ["torchtitan", "megatron-core", "deepspeed-zero3"])
@pytest.mark.parametrize("shape", [dict(), dict(tp=2), dict(cp=2), dict(micro_batch_size=2)])
def test_sharding_more_never_raises_memory(env, stack, shape):
    if shape.get("tp", 1) > 1 and stack != "deepspeed-zero3":
        shape = dict(shape, sequence_parallel=True)
    peaks = [peak(run(env, stack=stack, sharding=level.value, **shape)) for level in LEVELS]
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), [p / 2**30 for p in peaks]
    assert peaks[-1] < peaks[0]


def test_with_a_pipeline_fsdp_holds_the_stage_gathered_with_its_gradients(env):
    """torch.distributed.pipelining keeps every block gathered after a backward and accumulates unsharded
    fp32 gradients until the last micro-batch: more than ZeRO-2 holds, shown as it is (cost/fsdp_memory.py)."""
    shape = dict(pp=2, tp=2, sequence_parallel=True)
    zero2, fsdp = (run(env, sharding=level, **shape) for level in ("gradients", "parameters"))
    stage = max(fsdp.memory, key=lambda m: m.total_bytes)
    params = 8.0e9 / 4  # about a quarter of Llama 3 8B per rank
    assert stage.gradients_bytes > 0.8 * params * 4  # unsharded fp32 gradients of the stage
    assert peak(fsdp) > peak(zero2)


@pytest.mark.parametrize("level", [Sharding.OPTIMIZER, Sharding.GRADIENTS, Sharding.PARAMETERS])
def test_a_shard_group_of_one_rank_is_no_sharding(env, level):
    plain = run(env, sharding="none")
    one = run(env, sharding=level.value, shard_degree=1)
    assert one.step_time_s == pytest.approx(plain.step_time_s, rel=1e-12)
    assert peak(one) == peak(plain)


@pytest.mark.parametrize("shape", SHAPES)
def test_hsdp_with_one_replica_is_fsdp(env, shape):
    dp = 16 // (shape.get("tp", 1) * shape.get("pp", 1))
    fsdp = run(env, sharding="parameters", **shape)
    hsdp = run(env, sharding="parameters", shard_degree=dp, **shape)
    assert hsdp.step_time_s == pytest.approx(fsdp.step_time_s, rel=1e-12)
    assert peak(hsdp) == peak(fsdp)


def test_more_replicas_never_lower_memory(env):
    """HSDP: smaller shard groups hold bigger shards."""
    peaks = [peak(run(env, sharding="parameters", shard_degree=d)) for d in (16, 8, 4, 2)]
    assert all(b >= a for a, b in zip(peaks, peaks[1:]))


@pytest.mark.parametrize("stack, shape", [("megatron-core", dict(tp=2, sequence_parallel=True)),
                                          ("torchtitan", dict(sharding="parameters")),
                                          ("megatron-core", dict(pp=2, virtual_stages=2, distributed_optimizer=True))])
def test_more_recompute_layers_never_raise_memory_nor_shorten_the_step(env, stack, shape):
    runs = [run(env, stack=stack, recompute_layers=k, **shape) for k in (0, 2, 4, 8)]
    for a, b in zip(runs, runs[1:]):
        assert peak(b) <= peak(a)
        assert b.step_time_s >= a.step_time_s * (1 - 1e-9)
    assert peak(runs[-1]) < peak(runs[0]) and runs[-1].step_time_s > runs[0].step_time_s


def test_recomputing_every_layer_is_full_recompute(env):
    every = run(env, stack="megatron-core", recompute_layers=32)
    full = run(env, stack="megatron-core", recompute="full")
    assert every.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert peak(every) == peak(full)


@pytest.mark.parametrize("shape", [dict(), dict(pp=2, tp=2, sequence_parallel=True),
                                   dict(reshard_after_forward=False), dict(shard_degree=4)])
def test_an_fsdp_step_breakdown_adds_up(env, shape):
    r = run(env, sharding="parameters", **shape)
    assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
    assert all(v >= -1e-12 for v in r.breakdown.as_json().values())


def test_gathering_again_for_backward_costs_time_and_saves_memory(env):
    keep = run(env, sharding="parameters", reshard_after_forward=False, gpus=64)
    again = run(env, sharding="parameters", reshard_after_forward=True, gpus=64)
    assert again.step_time_s >= keep.step_time_s


def test_a_slower_network_never_speeds_fsdp(env):
    cache, memo = env
    m = load_model("llama3-8b").replace(seq_length=2048)
    cluster = load_cluster("h100-gt", gpus=64)
    slow = cluster.replace(network=cluster.network.replace(nic_bw_Gbps=100))
    plan = PlanSpec(dp=64, global_batch_size=64, sharding="parameters")
    fast_r = simulate(m, cluster, plan, cache=cache, memo=memo, stack=load_stack("torchtitan"))
    slow_r = simulate(m, slow, plan, cache=cache, memo=memo, stack=load_stack("torchtitan"))
    assert slow_r.step_time_s > fast_r.step_time_s


@pytest.mark.parametrize("shape", [dict(), dict(pp=2, tp=2, sequence_parallel=True), dict(shard_degree=4)])
def test_a_search_replays_fsdp_steps_as_simulate_does(env, shape):
    """A search loads the compiled level 2 (replay/compiled/level2.py); an FSDP step must replay the same there."""
    cache, _ = env
    fields = dict(dp=16 // (shape.get("tp", 1) * shape.get("pp", 1)), global_batch_size=32, sharding="parameters",
                  **shape)
    m, cluster = load_model("llama3-8b").replace(seq_length=2048), load_cluster("h100-gt", gpus=16)
    plain = simulate(m, cluster, PlanSpec(**fields), cache=cache, memo=SimulationMemo(), stack=load_stack("torchtitan"))
    memo = SimulationMemo()
    memo.compiled.expect_many()
    searched = simulate(m, cluster, PlanSpec(**fields), cache=cache, memo=memo, stack=load_stack("torchtitan"))
    assert searched.step_time_s == plain.step_time_s


def test_fsdp2_keeps_its_sharded_gradients_in_fp32_whatever_the_reduce_dtype(env):
    """FSDP2 casts each reduce-scatter's output back to the sharded parameter's dtype (fp32 shards: the masters), so a
    bf16 reduce saves only on the unsharded gradients in flight: two blocks' worth, nothing of the sharded fp32 ones
    (torch's _fsdp_collectives.foreach_reduce); DeepSpeed's bf16 partitions keep bf16 gradients."""
    from echo_plan.cost.fsdp_memory import WORKING_BLOCKS

    cache, memo = env
    model, cluster = load_model("llama3-8b").replace(seq_length=2048), load_cluster("h100-gt", gpus=16)
    plan = PlanSpec(dp=16, global_batch_size=32, sharding="parameters")
    grads = {}
    for name, reduce in (("torchtitan", "fp32"), ("torchtitan", "bf16"), ("deepspeed-zero3", "bf16")):
        stack = load_stack(name, {"grad_reduce_dtype": reduce})
        result = simulate(model, cluster, plan, cache=cache, memo=memo, stack=stack)
        grads[name, reduce] = result.memory[0].gradients_bytes
    saved = grads["torchtitan", "fp32"] - grads["torchtitan", "bf16"]
    assert 0 < saved <= WORKING_BLOCKS * 0.25e9 * 2  # 2 bytes of the blocks in flight only (a block: < 0.25 B)
    assert grads["torchtitan", "bf16"] > model.num_params * 4 / 16  # the fp32 shards of all 8B over 16 ranks
    assert grads["deepspeed-zero3", "bf16"] < model.num_params * 4 / 16


def test_a_step_inside_the_backward_frees_the_sharded_gradients_and_nothing_else(env):
    """torchtitan's early_step_in_backward (stack optimizer_in_backward): FSDP2 runs each sharded parameter's
    post-accumulate-grad hook, the optimizer step, right after its reduce-scatter, and the gradient is freed, so no
    sharded gradients are held; the step itself is counted as before. Where torchtitan refuses it (a pipeline,
    expert parallelism) or it would step per micro-batch, the plan is refused by name."""
    from echo_plan.errors import SpecError

    cache, memo = env
    model, cluster = load_model("llama3-8b").replace(seq_length=2048), load_cluster("h100-gt", gpus=16)
    plan = PlanSpec(dp=16, global_batch_size=16, sharding="parameters")
    kept = simulate(model, cluster, plan, cache=cache, memo=memo, stack=load_stack("torchtitan"))
    early = simulate(model, cluster, plan, cache=cache, memo=memo,
                     stack=load_stack("torchtitan", {"optimizer_in_backward": True}))
    freed = kept.memory[0].gradients_bytes - early.memory[0].gradients_bytes
    assert freed == pytest.approx(model.num_params * 4 / 16, rel=0.01)  # the fp32 shards' gradients
    assert early.step_time_s == kept.step_time_s
    named = PlanSpec(dp=16, global_batch_size=16, distributed_optimizer=True)  # the stack's own level: FSDP here
    assert simulate(model, cluster, named, cache=cache, memo=memo,
                    stack=load_stack("torchtitan", {"optimizer_in_backward": True})).memory[0].gradients_bytes == \
        early.memory[0].gradients_bytes
    stack = load_stack("torchtitan", {"optimizer_in_backward": True})
    for fields, knob in ((dict(dp=8, pp=2, global_batch_size=16), "pp"),
                         (dict(dp=16, global_batch_size=32), "micro-batches per step"),
                         (dict(dp=16, global_batch_size=16, sharding="optimizer"), "sharding")):
        bad = PlanSpec(**{"sharding": "parameters", **fields})
        with pytest.raises(SpecError, match=knob):
            simulate(model, cluster, bad, cache=cache, memo=memo, stack=stack)
