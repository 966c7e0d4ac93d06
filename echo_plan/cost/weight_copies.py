"""What low-precision training adds to a transformer layer's weights: the quantised copies Transformer Engine
keeps beside (or instead of) the bf16 weight, and what the data-parallel parameter all-gather moves.

Bytes per layer parameter, by recipe (the scales of block-scaled recipes included):

* per-tensor FP8 (delayed, current) where the GEMMs take only TN (Hopper): the FP8 weight and its FP8
  transpose, 2; on sm100 and newer (the stack's ``fp8_transposes`` false): the FP8 weight alone, 1;
* blockwise FP8: the weight and its other-direction copy, 2 (+ 1/128^2 of fp32 scales, left out); with
  DeepSeek's kernels (the stack's ``fp8_kernels: deepseek``) the weight alone, 1: its published profile transposes
  the FP8 weights in every backward (INFERENCE: a framework that kept the transposes would not make them again);
* MXFP8: a rowwise and a columnwise copy with an E8M0 scale per 32 values each: 2 x (1 + 1/32);
* NVFP4: a rowwise and a columnwise copy (16 x 16 blocks) of half a byte with an E4M3 scale per 16 values
  each: 2 x (1/2 + 1/16).

With the stack's ``fp8_param_gather`` (FP8 recipes) or ``fp4_param_gather`` (NVFP4) the quantised weight is
the parameter itself and the bf16 copy is gone. The parameter all-gather then moves 1 byte per layer
parameter for FP8 (Megatron's --fp8-param-gather), 2 for MXFP8 (Megatron-Core gathers the bf16 values into
the gradient buffer and quantises after: ``reuse_grad_buf_for_mxfp8_param_ag``, which MXFP8 parameters need)
and 1/2 for NVFP4 (the packed rowwise bytes; Megatron-Core's param buffer maps them), else 2 (bf16).
"""

from __future__ import annotations

from echo_plan.specs.cluster import DType
from echo_plan.specs.software import Fp8Recipe, SoftwareSpec

MX_COPY = 1.0 + 1.0 / 32  # one MXFP8 copy: E4M3 values and an E8M0 scale per 32
NVFP4_COPY = 0.5 + 1.0 / 16  # one NVFP4 copy: E2M1 values (two per byte) and an E4M3 scale per 16


def quantized_copy_bytes(dtype: DType, stack: SoftwareSpec) -> float:
    """Bytes per layer parameter of the low-precision copies a rank keeps (0 for bf16 / fp16 training)."""
    if dtype is DType.FP4:
        return 2 * NVFP4_COPY
    if dtype is not DType.FP8:
        return 0.0
    if stack.fp8_recipe is Fp8Recipe.MXFP8:
        return 2 * MX_COPY
    if stack.fp8_recipe.per_tensor and stack.fp8_transposes is False:
        return 1.0
    if stack.deepseek_fp8_kernels:
        return 1.0
    return 2.0


def keeps_quantized_params(dtype: DType, stack: SoftwareSpec) -> bool:
    """The optimizer writes the quantised weight itself: no bf16 copy of the layers' weights."""
    return (dtype is DType.FP8 and stack.fp8_param_gather) or (dtype is DType.FP4 and stack.fp4_param_gather)


def layer_weight_extra_bytes(dtype: DType, stack: SoftwareSpec, bf16_bytes: float) -> float:
    """What low precision changes per layer parameter: its copies, less the bf16 weight they replace."""
    extra = quantized_copy_bytes(dtype, stack)
    return extra - (bf16_bytes if extra and keeps_quantized_params(dtype, stack) else 0.0)


def layer_gather_bytes(dtype: DType, stack: SoftwareSpec) -> float:
    """Bytes per layer parameter the data-parallel parameter all-gather moves."""
    if not keeps_quantized_params(dtype, stack):
        return 2.0
    if dtype is DType.FP4:
        return 0.5
    return 2.0 if stack.fp8_recipe is Fp8Recipe.MXFP8 else 1.0
