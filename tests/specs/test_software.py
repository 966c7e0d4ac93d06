"""SoftwareSpec: presets, files that derive from them, and the rules a plan must meet."""

from __future__ import annotations

import pytest

from echo_plan.errors import EchoPlanError, SpecError, UnknownPresetError
from echo_plan.specs import DType, load_stack, stack_names
from echo_plan.specs.software import OptimizerSharding
from echo_plan.specs.software_checks import check_stack_supports


def test_every_preset_loads_cites_its_sources_and_traces_differently():
    names = stack_names()
    assert {"megatron-core", "megatron-lm-2021", "megatron-lm-2022", "megatron-deepspeed"} <= set(names)
    stacks = [load_stack(n) for n in names]
    assert all(s.sources and (s.base == s.name or s.base in names) for s in stacks)  # a preset may derive from one
    # every preset runs something the others do not: traced ops, FP8 settings or the attention library
    assert len({(s.trace_signature(), s.fp8_signature(), s.attention_library) for s in stacks}) == len(stacks)
    assert load_stack().name == "megatron-core"


def test_a_stack_file_derives_from_a_preset(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("base: megatron-core\nhidden_dropout: 0.1\ngrad_reduce_dtype: bf16\n")
    s = load_stack(str(f))
    assert (s.name, s.base, s.hidden_dropout, s.grad_bytes(DType.BF16)) == ("mine", "megatron-core", 0.1, 2)
    assert s.tp_comm_overlap == load_stack("megatron-core").tp_comm_overlap
    assert load_stack("megatron-core", {"attention": "unfused"}).attention.value == "unfused"


@pytest.mark.parametrize("text,needle", [("base: megatron-core\nhidden_dropout: 1.5\n", "hidden_dropout"),
                                         ("base: megatron-core\nattention: magic\n", "attention"),
                                         ("base: megatron-core\ncolour: red\n", "colour"),
                                         ("base: no-such-stack\n", "no-such-stack"),
                                         ("base: megatron-core\ngrad_reduce_dtype: fp8\n", "grad_reduce_dtype")])
def test_bad_stack_files_are_one_line_errors(tmp_path, text, needle):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(EchoPlanError) as err:
        load_stack(str(f))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_file_that_bases_itself_on_itself_is_refused(tmp_path):
    f = tmp_path / "loop.yaml"
    f.write_text(f"base: {f}\n")
    with pytest.raises(EchoPlanError, match="refers back"):
        load_stack(str(f))
    with pytest.raises(UnknownPresetError):
        load_stack("megatron-2099")


def test_gradient_bytes_follow_megatron_unless_the_stack_says():
    core, old = load_stack(), load_stack("megatron-lm-2021")
    assert core.grad_bytes(DType.BF16) == 4 and old.grad_bytes(DType.FP16) == 2 and old.grad_bytes(DType.BF16) == 4


def test_plans_the_stack_cannot_run_are_errors():
    old = load_stack("megatron-lm-2021")
    assert old.optimizer_sharding is OptimizerSharding.NONE
    for kw in (dict(sequence_parallel=True), dict(distributed_optimizer=True), dict(selective_recompute=True)):
        args = {**dict(sequence_parallel=False, distributed_optimizer=False, selective_recompute=False), **kw}
        with pytest.raises(SpecError, match="megatron-lm-2021"):
            check_stack_supports(old, **args)
    check_stack_supports(load_stack(), sequence_parallel=True, distributed_optimizer=True, selective_recompute=True)


def test_the_attention_library_is_a_stack_setting_for_fused_attention_only():
    old = load_stack("nemo-24.03")
    assert (old.attention_library.value, load_stack().attention_library.value) == ("flash-attn-2", "cudnn")
    assert old.trace_signature() == load_stack("megatron-core", {"optimizer_sharding": "states_and_grads",
                                                                 "grad_reduce_dtype": "bf16",
                                                                 "moe_probs_in_activation": False}).trace_signature()
    for bad, needle in (({"attention": "unfused", "attention_library": "flash-attn-2"}, "needs attention: fused"),
                        ({"attention_library": "fa9"}, "attention_library")):
        with pytest.raises(SpecError) as err:
            load_stack("megatron-core", bad)
        assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [("moe_dispatch_fp8", True), ("moe_comm_sms", 20), ("deepep_release", "2025-02")])
def test_deepeps_own_settings_need_its_dispatcher(field, value):
    with pytest.raises(Exception, match=f"{field}( {value})? is DeepEP's"):
        load_stack("megatron-core", {field: value})
    got = getattr(load_stack("megatron-core", {"moe_dispatcher": "deepep", field: value}), field)
    assert getattr(got, "value", got) == value


def test_deepseeks_stack_runs_the_deepep_release_it_trained_with():
    """DeepSeek-V3 was trained, and its profile taken, before DeepEP's 2025-04 optimisation; any other stack with
    DeepEP runs the current release unless it says otherwise."""
    assert load_stack("deepseek-v3").deepep_release.value == "2025-02"
    assert load_stack("megatron-core", {"moe_dispatcher": "deepep"}).deepep_release.value == "2025-04"
    with pytest.raises(Exception, match="deepep_release"):
        load_stack("megatron-core", {"moe_dispatcher": "deepep", "deepep_release": "2024-12"})
