"""The trace-key strings of a stack (``specs/software_signature.py``): a setting that changes what the tracer records
changes the key, so two stacks never share a cached trace; bf16 traces ignore the low-precision settings."""

from __future__ import annotations

import pytest

from echo_plan.specs import DType, load_stack
from echo_plan.specs.software_signature import precision_signature, trace_signature


@pytest.mark.parametrize("field, value", [("tp_runtime", "torch"), ("full_recompute_unit", "submodules"),
                                          ("cp_runtime", "torch"), ("fused_norm", False), ("cross_entropy", "te"),
                                          ("fused_projections", False)])
def test_each_traced_setting_changes_the_key(field, value):
    base = load_stack("megatron-core")
    assert trace_signature(base.replace(**{field: value})) != trace_signature(base)


def test_precision_settings_key_only_their_precision():
    base = load_stack("megatron-core")
    mx = base.replace(fp8_recipe="mxfp8")
    assert precision_signature(mx, DType.FP8) != precision_signature(base, DType.FP8)
    assert precision_signature(mx, DType.BF16) == precision_signature(base, DType.BF16) == ""
    assert base.precision_signature(DType.FP4) == precision_signature(base, DType.FP4).strip()
