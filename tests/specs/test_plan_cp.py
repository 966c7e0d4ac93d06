"""PlanSpec's context-parallel degree: world size, gradient group, and the rules with their names."""

from __future__ import annotations

import pytest

from echo_plan.errors import SpecError
from echo_plan.layout.plan_layout import dp_group
from echo_plan.specs import PlanSpec, load_cluster, load_model, validate_plan


def test_world_size_and_gradient_group_include_cp():
    plan = PlanSpec(tp=4, cp=2, pp=4, dp=2, global_batch_size=8)
    assert plan.world_size == 64 and plan.grad_dp == 4 and plan.stage_ranks == 16
    group = dp_group(plan)
    assert (group.size, group.stride) == (4, 4)  # CP ranks reduce gradients with the DP ranks
    assert "cp2" in plan.short()
    assert "cp" not in PlanSpec(tp=4, pp=4, dp=2, global_batch_size=8).short()


def test_cp_rules_name_what_is_wrong():
    model = load_model("llama3-8b")
    cluster = load_cluster("dgx-h100", gpus=24)
    with pytest.raises(SpecError, match="2 x cp = 6"):
        validate_plan(PlanSpec(cp=3, dp=8, global_batch_size=8), model.replace(seq_length=8188), cluster)
    with pytest.raises(SpecError, match="tp x cp x pp x dp"):
        validate_plan(PlanSpec(cp=2, dp=8, global_batch_size=8), model, cluster)
    validate_plan(PlanSpec(cp=3, dp=8, global_batch_size=8), model.replace(seq_length=6144), cluster)


def test_a_stack_without_fused_attention_cannot_run_cp():
    from echo_plan.specs import load_stack
    from echo_plan.specs.software_checks import check_stack_supports

    stack = load_stack("megatron-lm-2021")
    check_stack_supports(stack, sequence_parallel=False, distributed_optimizer=False, selective_recompute=False)
    with pytest.raises(SpecError, match="fused attention"):
        check_stack_supports(stack, sequence_parallel=False, distributed_optimizer=False, selective_recompute=False,
                             cp=2)
