"""The calibration a cluster file carries, read and checked in one place.

``calibration:`` in a cluster YAML has up to three parts, each produced by a ``calibrate``
command and each keeping the rows it was fitted on:

* ``compute``: what the analytical kernel model misses on this GPU generation under a real
  training load (``echo-plan calibrate steps``): a sustained GEMM efficiency scale (clocks under
  sustained power draw, the shape mix of real layers), a fused-attention efficiency scale, an
  achieved-memory-bandwidth scale and the fixed cost of one kernel;
* ``nccl``: the collective model's fitted parameters (``echo-plan calibrate nccl``);
* ``ranges``: the spread of held-out prediction errors per software stack, from which every
  prediction's range comes (``echo_plan.cost.ranges``).

Unknown keys and impossible values are errors that name the key and what is valid: a silently
ignored calibration would be a silently wrong answer.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

from echo_plan.specs.calibration import (COMPUTE_FIELDS, COMPUTE_INFO, SECTIONS, ComputeCalibration,
                                        check_calibration)
from echo_plan.trace.records import OpKind

__all__ = ["SECTIONS", "COMPUTE_FIELDS", "COMPUTE_INFO", "ComputeCalibration", "check_calibration",
           "calibrated_constants"]

def calibrated_constants(cal: ComputeCalibration, constants: Any) -> Any:
    """Kernel-model constants with the compute calibration ``cal`` applied (``echo_plan.cost.compute``)."""
    if cal.is_identity:
        return constants
    fp8 = cal.gemm_efficiency_scale * cal.fp8_gemm_efficiency_scale
    fp4 = cal.gemm_efficiency_scale * cal.fp4_gemm_efficiency_scale
    arch = {k: replace(a, asymptotic_eff=a.asymptotic_eff * cal.gemm_efficiency_scale,
                       max_eff=a.max_eff * cal.gemm_efficiency_scale,
                       fp8_asymptotic_eff=_scaled(a.fp8_asymptotic_eff, fp8),
                       fp8_max_eff=_scaled(a.fp8_max_eff, fp8),
                       fp4_asymptotic_eff=_scaled(a.fp4_asymptotic_eff, fp4),
                       fp4_max_eff=_scaled(a.fp4_max_eff, fp4),
                       attention_forward_eff=a.attention_forward_eff * cal.attention_efficiency_scale,
                       attention_backward_eff=a.attention_backward_eff * cal.attention_efficiency_scale,
                       fa2_forward_eff=_scaled(a.fa2_forward_eff, cal.attention_efficiency_scale),
                       fa2_backward_eff=_scaled(a.fa2_backward_eff, cal.attention_efficiency_scale),
                       fa3_forward_eff=_scaled(a.fa3_forward_eff, cal.attention_efficiency_scale),
                       fa3_backward_eff=_scaled(a.fa3_backward_eff, cal.attention_efficiency_scale))
            for k, a in constants.arch.items()}
    hbm: dict[OpKind, float] = {k: min(1.0, v * cal.memory_bandwidth_scale)
                                for k, v in constants.hbm_efficiency.items()}
    launch = constants.launch_overhead_s if cal.kernel_overhead_us is None else cal.kernel_overhead_us * 1e-6
    return replace(constants, arch=MappingProxyType(arch), hbm_efficiency=MappingProxyType(hbm),
                   launch_overhead_s=launch, fp8_mx_eff=constants.fp8_mx_eff * cal.mxfp8_gemm_efficiency_scale)


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
