"""The parts of a software stack's settings that change what the tracer records: the strings that go into every trace's
cache key (``SoftwareSpec.trace_signature`` and ``precision_signature`` call these). A setting that changes a trace
and is missing here would let two stacks share a cached trace: ``tests/specs/test_software.py`` checks every preset
gets its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echo_plan.specs.cluster import DType
from echo_plan.specs.software_kinds import (CheckpointUnit, CPComm, CPRuntime, CrossEntropy, Fp8Kernels, GradientBuffers,
                                            RecomputePolicy, TPRuntime)

if TYPE_CHECKING:  # the spec module imports this one
    from echo_plan.specs.software import SoftwareSpec


def trace_signature(spec: "SoftwareSpec") -> str:
    """The settings that change what the tracer records (part of every trace's cache key)."""
    modules = (",".join(m.value for m in spec.recompute_modules) or "-") if spec.recompute_policy is \
        RecomputePolicy.MODULES else "ops"
    grad = "auto" if spec.grad_reduce_dtype is None else spec.grad_reduce_dtype.value
    return (f"attn={spec.attention.value};hdrop={spec.hidden_dropout > 0};adrop={spec.attention_dropout > 0};"
            f"fuse={spec.fused_elementwise};gaf={spec.gradient_accumulation_fusion}/{grad};"
            + ("" if spec.gradient_buffers is GradientBuffers.MEGATRON else f"gbuf={spec.gradient_buffers.value};")
            + f"tpov={spec.tp_comm_overlap};rc={modules};moe={spec.moe_dispatcher.value},"
            f"{spec.moe_grouped_gemm},{spec.moe_permute_fusion}"
            + ("" if spec.moe_probs_in_activation else ",probs-at-unpermute")
            + (",act-in-fp8" if spec.moe_act_input_fp8 else "")
            + (",fp8-dispatch" if spec.moe_dispatch_fp8 else "")
            + ("" if spec.cp_comm is CPComm.P2P else f";cp={spec.cp_comm.value}")
            + ("" if spec.cp_runtime is CPRuntime.TRANSFORMER_ENGINE else f";cp-rt={spec.cp_runtime.value}")
            + ("" if spec.tp_runtime is TPRuntime.MEGATRON else f";tp-rt={spec.tp_runtime.value}")
            + ("" if spec.full_recompute_unit is CheckpointUnit.BLOCK else ";full=sub")
            + ("" if spec.fused_projections else ";split-proj")
            + ("" if spec.cross_entropy is CrossEntropy.UNFUSED else f";ce={spec.cross_entropy.value}")
            + ("" if spec.fused_rope_scales else ";rope-unscaled")
            + ("" if spec.fused_norm else ";norm-eager")
            + ("" if spec.fused_bias_dropout_add in (None, spec.fused_elementwise)
               else f";bda-fused={spec.fused_bias_dropout_add}"))


def fp8_signature(spec: "SoftwareSpec") -> str:
    """The FP8 settings that change an fp8 trace (appended to its cache key; bf16 traces ignore them)."""
    return (f"fp8={spec.fp8_recipe.value},pg={spec.fp8_param_gather}"
            + (",orig" if spec.fp8_save_original_input else "")
            + (",any-layout" if spec.fp8_transposes is False else "")
            + ("" if spec.fp8_kernels is Fp8Kernels.TRANSFORMER_ENGINE else f",k={spec.fp8_kernels.value}")
            + (",attn-out-e5m6" if spec.fp8_attention_output_e5m6 else ""))


def fp4_signature(spec: "SoftwareSpec") -> str:
    """The NVFP4 settings that change an fp4 trace (appended to its cache key)."""
    return f"fp4=nvfp4,pg={spec.fp4_param_gather}" + (",orig" if spec.fp8_save_original_input else "")


def precision_signature(spec: "SoftwareSpec", dtype: DType) -> str:
    """What the plan's precision adds to a trace's cache key: the FP8 or NVFP4 settings, nothing for bf16."""
    return {DType.FP8: fp8_signature, DType.FP4: fp4_signature}.get(DType(dtype), lambda _: "")(spec)
