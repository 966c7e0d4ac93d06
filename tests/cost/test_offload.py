"""The optimizer on the CPU (--offload-optimizer, cost/offload.py): the properties it must keep.

Offloading never raises a GPU's memory and moves the optimizer shard to the host; a faster host never slows the
step; a host too small for the shard does not fit; a stack or a cluster that cannot say how is refused in one line
naming the setting; the breakdown still adds up to the step."""

from __future__ import annotations

import pytest

from echo_plan.cost.offload import (CPU_BYTES_PER_PARAM, GRAD_D2H_BYTES, HOST_BYTES_PER_PARAM, PARAM_H2D_BYTES,
                                    host_step)
from echo_plan.errors import SpecError
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.specs.software_checks import check_plan_supported
from echo_plan.specs.software_kinds import OptimizerOffload


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    return TraceCache(tmp_path_factory.mktemp("traces")), SimulationMemo()


def run(env, cluster=None, stack="megatron-core", **changes):
    cache, memo = env
    fields = dict(tp=2, pp=2, dp=4, global_batch_size=16, sequence_parallel=True, distributed_optimizer=True)
    fields.update(changes)
    model = load_model("llama3-8b").replace(seq_length=2048)
    return simulate(model, cluster or load_cluster("dgx-h100", gpus=16), PlanSpec(**fields), cache=cache, memo=memo,
                    stack=load_stack(stack))


@pytest.mark.parametrize("kind", [OptimizerOffload.MEGATRON_HYBRID, OptimizerOffload.ZERO_OFFLOAD])
def test_more_host_bandwidth_never_slows_the_host_step(kind):
    cluster = load_cluster("dgx-h100", gpus=16)
    base = host_step(10**9, cluster, kind)
    for field in ("memory_bw_GBps", "link_GBps"):
        faster = cluster.replace(host=cluster.host.replace(**{field: getattr(cluster.host, field) * 2}).model_dump())
        assert host_step(10**9, faster, kind).exposed_s <= base.exposed_s
    assert host_step(2 * 10**9, cluster, kind).exposed_s > base.exposed_s


def test_the_host_step_is_its_parts_as_each_framework_runs_them():
    cluster = load_cluster("dgx-h100", gpus=16)
    n, host = 10**9, cluster.host
    hybrid = host_step(n, cluster, OptimizerOffload.MEGATRON_HYBRID)
    assert hybrid.d2h_s == pytest.approx(n * GRAD_D2H_BYTES / (host.link_GBps * 1e9))
    assert hybrid.h2d_s == pytest.approx(n * PARAM_H2D_BYTES / (host.link_GBps * 1e9))
    assert hybrid.cpu_s == pytest.approx(n * CPU_BYTES_PER_PARAM * cluster.gpus_per_node / (host.memory_bw_GBps * 1e9))
    assert hybrid.exposed_s == max(hybrid.d2h_s, hybrid.cpu_s, hybrid.h2d_s)  # pipelined per parameter
    zero = host_step(n, cluster, OptimizerOffload.ZERO_OFFLOAD)
    assert zero.exposed_s == pytest.approx(zero.cpu_s + zero.h2d_s)  # gradients copied during the backward


def test_offloading_moves_the_optimizer_to_the_host_and_never_raises_gpu_memory(env):
    on, off = run(env, offload_optimizer=True), run(env)
    for a, b in zip(on.memory, off.memory):
        assert a.total_bytes <= b.total_bytes and a.optimizer_bytes == 0 < b.optimizer_bytes
        params = b.optimizer_bytes / 12  # megatron-core: fp32 master weights and two fp32 moments
        assert a.host_bytes == pytest.approx(params * HOST_BYTES_PER_PARAM, rel=1e-6)
        assert 0 < a.host_bytes <= a.host_capacity_bytes and b.host_bytes == b.host_capacity_bytes == 0


def test_an_offloaded_step_is_slower_here_and_its_breakdown_adds_up(env):
    on, off = run(env, offload_optimizer=True), run(env)
    assert on.step_time_s > off.step_time_s  # a CPU step over PCIe on every preset host
    assert on.breakdown.optimizer_s > off.breakdown.optimizer_s
    assert on.breakdown.total_s == pytest.approx(on.step_time_s, rel=1e-6)
    notes = " ".join(on.notes)
    assert "optimizer offloaded to the CPU" in notes and "not checked against measured runs" in notes
    assert "host memory for the offloaded optimizer" in notes


def test_a_host_too_small_for_the_shard_does_not_fit(env):
    cluster = load_cluster("dgx-h100", gpus=16)
    tiny = cluster.replace(host=cluster.host.replace(memory_GiB=8).model_dump())
    result = run(env, cluster=tiny, offload_optimizer=True)
    assert not result.fits and all(not m.host_fits for m in result.memory)
    assert all(m.overflow_bytes == 0 for m in result.memory)  # the GPUs themselves have room
    assert any("does not fit; more GPUs" in n for n in result.notes)


def test_a_cluster_without_host_figures_is_refused_by_name(env):
    with pytest.raises(SpecError, match="offload_optimizer.*gives no host figures"):
        run(env, cluster=load_cluster("h100-gt", gpus=16), offload_optimizer=True)


def test_a_stack_that_cannot_offload_is_refused_by_name():
    plan = PlanSpec(dp=16, global_batch_size=16, sharding="parameters", offload_optimizer=True)
    with pytest.raises(SpecError, match="offload_optimizer.*stack olmo-core"):
        check_plan_supported(load_stack("olmo-core"), plan)
    check_plan_supported(load_stack("deepspeed-zero3"), plan)
    check_plan_supported(load_stack("torchtitan"), plan)


FSDP = dict(tp=1, pp=1, dp=16, global_batch_size=16, sequence_parallel=False, sharding="parameters")


def test_fsdp2_offload_moves_parameters_gradients_and_states_and_slows_the_gathers(env):
    on, off = (run(env, stack="torchtitan", offload_optimizer=o, **FSDP) for o in (True, False))
    for a, b in zip(on.memory, off.memory):
        assert a.optimizer_bytes == 0 < b.optimizer_bytes and a.gradients_bytes < b.gradients_bytes
        assert a.total_bytes < b.total_bytes and a.host_bytes > 0
    assert on.step_time_s > off.step_time_s and on.breakdown.optimizer_s > off.breakdown.optimizer_s
    assert on.breakdown.total_s == pytest.approx(on.step_time_s, rel=1e-6)
    assert "(stack torchtitan: fsdp2)" in " ".join(on.notes)


@pytest.mark.parametrize("changes, knob", [(dict(global_batch_size=32), "micro-batches per step"),
                                           (dict(offload_fraction=0.5), "offload_fraction"),
                                           (dict(sharding="optimizer"), "sharding")])
def test_fsdp2_offload_outside_what_is_modelled_is_refused_by_name(changes, knob):
    plan = PlanSpec(**dict(FSDP, offload_optimizer=True, **changes))
    with pytest.raises(SpecError, match=f"^plan: {knob}=.*CPUOffloadPolicy"):
        check_plan_supported(load_stack("torchtitan"), plan)


def test_offload_needs_a_sharded_optimizer():
    with pytest.raises(ValueError, match="offload_optimizer .* needs sharding"):
        PlanSpec(dp=16, global_batch_size=16, offload_optimizer=True)
    assert "opt-offload" in PlanSpec(dp=16, global_batch_size=16, distributed_optimizer=True,
                                     offload_optimizer=True).short()


def test_a_slow_gpu_slows_the_gpu_part_of_the_optimizer_step_not_the_hosts():
    from echo_plan.cost.offload import HostStep
    from echo_plan.replay.step_model import StageCosts

    host = HostStep(d2h_s=0.1, cpu_s=2.0, h2d_s=0.05, exposed_s=2.0, params=10**9)
    offloaded = StageCosts((), (), (), (), 2.5, host_step=host)  # 0.5 s of other per-step GPU work
    assert offloaded.optimizer_time(2.0) == pytest.approx(2.0 + 0.5 * 2.0)
    partial = StageCosts((), (), (), (), 2.5, host_step=HostStep(0.1, 2.0, 0.05, 2.0, 10**9, gpu_s=1.5))
    assert partial.optimizer_time(1.0) == pytest.approx(2.5)  # the GPU's share hides under the host's
    assert partial.optimizer_time(2.0) == pytest.approx(3.0 + 0.5 * 2.0)  # until a slow GPU takes longer
    assert StageCosts((), (), (), (), 2.5).optimizer_time(2.0) == pytest.approx(5.0)


def test_offloading_more_of_the_optimizer_never_raises_gpu_memory(env):
    peaks, hosts = [], []
    for fraction in (0.25, 0.5, 0.75, 1.0):
        result = run(env, offload_optimizer=True, offload_fraction=fraction)
        peaks.append(max(m.total_bytes for m in result.memory))
        hosts.append(max(m.host_bytes for m in result.memory))
    plain = max(m.total_bytes for m in run(env).memory)
    assert plain >= peaks[0] and all(b <= a for a, b in zip(peaks, peaks[1:])) and peaks[-1] < peaks[0]
    assert all(b > a for a, b in zip(hosts, hosts[1:]))


def test_a_partial_offload_steps_both_shares_at_once(env):
    half = run(env, offload_optimizer=True, offload_fraction=0.5)
    whole = run(env, offload_optimizer=True)
    assert half.breakdown.optimizer_s < whole.breakdown.optimizer_s  # half the host's share, the GPU's beside it
    assert "50% of its optimizer shard" in " ".join(half.notes)
    with pytest.raises(SpecError, match="offload_fraction.*Twin-Flow"):
        check_plan_supported(load_stack("deepspeed-zero3"), PlanSpec(dp=16, global_batch_size=16, sharding="parameters",
                                                                     offload_optimizer=True, offload_fraction=0.5))
    with pytest.raises(ValueError, match="offload_fraction 0.5 needs offload_optimizer"):
        PlanSpec(dp=16, global_batch_size=16, distributed_optimizer=True, offload_fraction=0.5)
