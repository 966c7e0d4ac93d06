"""DeepSeek-V3's recipe on 2,048 H800 with its own stack (issue 32, in part): DeepEP's node-limited
exchange instead of NCCL's all-to-all, shown as the expert exchange in the breakdown."""

from __future__ import annotations

import pytest

from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack
from echo_plan.errors import SpecError
from echo_plan.specs.plan import balanced_split
from echo_plan.trace.cache import TraceCache


@pytest.mark.slow
def test_deepseeks_stack_runs_the_exchange_as_deepep(tmp_path):
    model, cluster = load_model("deepseek-v3"), load_cluster("h800").resized(gpus=2048)
    plan = PlanSpec.build({"tp": 1, "pp": 16, "dp": 128, "ep": 64, "micro_batch_size": 1, "global_batch_size": 15360,
                           "distributed_optimizer": True, "dtype": "fp8", "schedule": "dualpipe",
                           "layer_split": balanced_split(model.num_layers, 16)})
    cache, memo = TraceCache(tmp_path), SimulationMemo()
    nccl = simulate(model, cluster, plan, stack=load_stack("megatron-core", {"fp8_recipe": "blockwise"}), cache=cache,
                    memo=memo)
    deepep = simulate(model, cluster, plan, stack=load_stack("megatron-core", {"fp8_recipe": "blockwise",
                                                                               "moe_dispatcher": "deepep"}),
                      cache=cache, memo=memo)
    for r in (nccl, deepep):
        assert r.breakdown.total_s == pytest.approx(r.step_time_s, rel=1e-9)
        assert r.breakdown.ep_comm_exposed_s > r.breakdown.tp_comm_exposed_s  # the exchange, not TP (tp 1)
    # node-limited: at most 4 servers a token, once each over the network, not one copy per expert
    assert deepep.breakdown.ep_comm_exposed_s < 0.5 * nccl.breakdown.ep_comm_exposed_s
    assert deepep.step_time_s < nccl.step_time_s
    # simulate says where the exchange runs and what node-limited routing saves
    (note,) = [n for n in deepep.notes if n.startswith("DeepEP exchange")]
    assert "at most 4 of 8 servers" in note and "crosses the network 3.50 times" in note
    assert note.startswith("DeepEP exchange (2025-04 kernels)")
    assert any(n.startswith("expert exchange on the critical stage") and "the schedule hides" in n for n in deepep.notes)
    assert not any(n.startswith("DeepEP exchange") for n in nccl.notes)
    # DeepEP's first release (what DeepSeek-V3 trained with) reaches less of the network: never a faster step
    first = simulate(model, cluster, plan, stack=load_stack("megatron-core", {
        "fp8_recipe": "blockwise", "moe_dispatcher": "deepep", "deepep_release": "2025-02"}), cache=cache, memo=memo)
    assert first.step_time_s > deepep.step_time_s
    assert first.breakdown.ep_comm_exposed_s > deepep.breakdown.ep_comm_exposed_s
    assert any(n.startswith("DeepEP exchange (2025-02 kernels)") for n in first.notes)


@pytest.mark.slow
def test_deepseeks_own_recipe_fits_the_80_gb_cards_it_ran_on(tmp_path):
    """2,048 H800, PP 16 with DualPipe, EP 64, ZeRO-1, FP8, the deepseek-v3 stack's recompute and caching:
    DeepSeek trained this on 80 GB cards, so the memory model must say it fits (with the default headroom),
    and without the stack's memory choices (plain Megatron-Core FP8, no recompute) it must not."""
    model, cluster = load_model("deepseek-v3"), load_cluster("h800").resized(gpus=2048)
    recipe = {"tp": 1, "pp": 16, "dp": 128, "ep": 64, "micro_batch_size": 1, "global_batch_size": 15360,
              "distributed_optimizer": True, "dtype": "fp8", "schedule": "dualpipe", "recompute": "selective",
              "layer_split": balanced_split(model.num_layers, 16)}
    cache, memo = TraceCache(tmp_path), SimulationMemo()
    ours = simulate(model, cluster, PlanSpec.build(recipe), stack=load_stack("deepseek-v3"), cache=cache, memo=memo)
    assert ours.fits, f"peak {max(s.total_bytes for s in ours.memory) / 2**30:.1f} GiB"
    assert any("E5M6" in n for n in ours.notes)  # MLA's output kept in 12 bits, as the stack says
    # the 20 SMs DeepEP's kernels hold slow what runs beside them, and FP8 GEMMs sized to the other 112 for the
    # whole step are slower than GEMMs that take every SM while the exchange is idle: never a faster step
    every_sm = simulate(model, cluster, PlanSpec.build(recipe),
                        stack=load_stack("deepseek-v3", {"fp8_gemms_leave_comm_sms": False}), cache=cache, memo=memo)
    free_sms = simulate(model, cluster, PlanSpec.build(recipe),
                        stack=load_stack("deepseek-v3", {"moe_comm_sms": None, "fp8_gemms_leave_comm_sms": False}),
                        cache=cache, memo=memo)
    assert ours.step_time_s >= every_sm.step_time_s >= free_sms.step_time_s
    plain = simulate(model, cluster, PlanSpec.build({**recipe, "recompute": "none"}),
                     stack=load_stack("megatron-core", {"fp8_recipe": "blockwise"}), cache=cache, memo=memo)
    assert not plain.fits


def test_an_exchange_holding_all_the_sms_is_a_one_line_error(small_moe):
    cluster = load_cluster("h800").resized(gpus=16)
    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 16, "ep": 4, "micro_batch_size": 1, "global_batch_size": 32})
    stack = load_stack("megatron-core", {"moe_dispatcher": "deepep", "moe_comm_sms": 132})
    with pytest.raises(SpecError, match="moe_comm_sms.*at most 131") as err:
        simulate(small_moe, cluster, plan, stack=stack)
    assert "\n" not in str(err.value)


def test_fp8_gemms_sized_to_the_exchange_are_said_and_leave_bf16_plans_alone(small_moe):
    cluster = load_cluster("h800").resized(gpus=16)
    plan = {"tp": 1, "pp": 1, "dp": 16, "ep": 4, "micro_batch_size": 1, "global_batch_size": 32}
    sized, every_sm = load_stack("deepseek-v3"), load_stack("deepseek-v3", {"fp8_gemms_leave_comm_sms": False})
    fp8 = simulate(small_moe, cluster, PlanSpec.build({**plan, "dtype": "fp8"}), stack=sized)
    assert any("FP8 GEMMs run on 112 of" in n for n in fp8.notes)
    assert fp8.step_time_s >= simulate(small_moe, cluster, PlanSpec.build({**plan, "dtype": "fp8"}),
                                       stack=every_sm).step_time_s
    bf16 = [simulate(small_moe, cluster, PlanSpec.build(plan), stack=s) for s in (sized, every_sm)]
    assert bf16[0].step_time_s == bf16[1].step_time_s  # no FP8 GEMMs: nothing sized
    assert not any("FP8 GEMMs run" in n for n in bf16[0].notes)


def test_simulate_says_when_deepseeks_own_fp8_kernels_run(small_moe):
    cluster = load_cluster("h800").resized(gpus=16)
    plan = PlanSpec.build({"tp": 1, "pp": 1, "dp": 16, "ep": 4, "micro_batch_size": 1, "global_batch_size": 32,
                           "dtype": "fp8"})
    ours = simulate(small_moe, cluster, plan, stack=load_stack("deepseek-v3"))
    (note,) = [n for n in ours.notes if n.startswith("fp8: DeepSeek's own kernels")]
    assert "one FP8 copy of each weight" in note and "E5M6" not in note  # its attention is not MLA: no E5M6 copy
    te = load_stack("deepseek-v3", {"fp8_kernels": "transformer-engine", "fp8_attention_output_e5m6": False})
    assert not any("DeepSeek's own kernels" in n for n in simulate(small_moe, cluster, plan, stack=te).notes)
