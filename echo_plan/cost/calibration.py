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

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

from echo_plan.errors import SpecError

SECTIONS = ("compute", "nccl", "ranges")
# field -> (lower bound, upper bound): a scale outside these is not a calibration but a mistake
COMPUTE_FIELDS: dict[str, tuple[float, float]] = {
    "gemm_efficiency_scale": (0.2, 1.5),
    "fp8_gemm_efficiency_scale": (0.2, 1.5),
    "attention_efficiency_scale": (0.2, 1.5),
    "memory_bandwidth_scale": (0.2, 1.2),
    "kernel_overhead_us": (0.0, 100.0),
}
COMPUTE_INFO = ("source", "fitted_on", "held_out", "stack", "notes", "residuals", "fp8_fit")


def check_calibration(calibration: Mapping[str, Any], context: str = "calibration") -> None:
    """Raise SpecError for an unknown section or a bad compute/ranges entry (nccl checks its own)."""
    if not isinstance(calibration, Mapping):
        raise SpecError("calibration", calibration, "a mapping with sections " + ", ".join(SECTIONS), context)
    for key in calibration:
        if key not in SECTIONS:
            raise SpecError(f"calibration.{key}", calibration[key], "unknown section; valid: " + ", ".join(SECTIONS),
                            context)
    if "compute" in calibration:
        ComputeCalibration.from_mapping(calibration["compute"], context)
    if "ranges" in calibration:
        from echo_plan.cost.ranges import RangeTable

        RangeTable.from_mapping(calibration["ranges"], context)
    if "nccl" in calibration:
        from echo_plan.cost.collectives import params_from_calibration

        params_from_calibration(calibration, context=context)


def _number(name: str, value: Any, lo: float, hi: float, context: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"calibration.compute.{name}", value, f"a number in [{lo:g}, {hi:g}]", context) from None
    if not math.isfinite(x) or not lo <= x <= hi or isinstance(value, bool):
        raise SpecError(f"calibration.compute.{name}", value, f"a number in [{lo:g}, {hi:g}]", context)
    return x


@dataclass(frozen=True)
class ComputeCalibration:
    """Factors on the analytical kernel model (1.0 / None: the model as published)."""

    gemm_efficiency_scale: float = 1.0
    fp8_gemm_efficiency_scale: float = 1.0  # FP8 GEMMs, on top of gemm_efficiency_scale (fitted on fp8 rows)
    attention_efficiency_scale: float = 1.0
    memory_bandwidth_scale: float = 1.0
    kernel_overhead_us: float | None = None  # None: compute.yaml's launch overhead
    info: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # provenance: rows, source

    @property
    def is_identity(self) -> bool:
        return (self.gemm_efficiency_scale == self.attention_efficiency_scale == self.memory_bandwidth_scale == 1.0
                and self.fp8_gemm_efficiency_scale == 1.0 and self.kernel_overhead_us is None)

    def values(self) -> dict[str, float]:
        out = {"gemm_efficiency_scale": self.gemm_efficiency_scale,
               "attention_efficiency_scale": self.attention_efficiency_scale,
               "memory_bandwidth_scale": self.memory_bandwidth_scale}
        if self.kernel_overhead_us is not None:
            out["kernel_overhead_us"] = self.kernel_overhead_us
        if self.fp8_gemm_efficiency_scale != 1.0:
            out["fp8_gemm_efficiency_scale"] = self.fp8_gemm_efficiency_scale
        return out

    @classmethod
    def from_mapping(cls, data: Any, context: str = "calibration") -> "ComputeCalibration":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise SpecError("calibration.compute", data, "a mapping of " + ", ".join(COMPUTE_FIELDS), context)
        values: dict[str, Any] = {}
        for key, value in data.items():
            if key in COMPUTE_FIELDS:
                values[key] = _number(key, value, *COMPUTE_FIELDS[key], context)
            elif key not in COMPUTE_INFO:
                raise SpecError(f"calibration.compute.{key}", value,
                                "unknown key; valid: " + ", ".join(tuple(COMPUTE_FIELDS) + COMPUTE_INFO), context)
        info = MappingProxyType({k: data[k] for k in COMPUTE_INFO if k in data})
        return cls(**values, info=info)

    @classmethod
    def of(cls, cluster: Any) -> "ComputeCalibration":
        cal = getattr(cluster, "calibration", None) or {}
        return cls.from_mapping(cal.get("compute"), getattr(cluster, "name", "cluster"))

    def apply(self, constants: Any) -> Any:
        """Kernel-model constants with this calibration applied (``echo_plan.cost.compute``)."""
        if self.is_identity:
            return constants
        from echo_plan.trace.records import OpKind

        fp8 = self.gemm_efficiency_scale * self.fp8_gemm_efficiency_scale
        arch = {k: replace(a, asymptotic_eff=a.asymptotic_eff * self.gemm_efficiency_scale,
                           max_eff=a.max_eff * self.gemm_efficiency_scale,
                           fp8_asymptotic_eff=None if a.fp8_asymptotic_eff is None else a.fp8_asymptotic_eff * fp8,
                           fp8_max_eff=None if a.fp8_max_eff is None else a.fp8_max_eff * fp8,
                           attention_forward_eff=a.attention_forward_eff * self.attention_efficiency_scale,
                           attention_backward_eff=a.attention_backward_eff * self.attention_efficiency_scale,
                           fa2_forward_eff=_scaled(a.fa2_forward_eff, self.attention_efficiency_scale),
                           fa2_backward_eff=_scaled(a.fa2_backward_eff, self.attention_efficiency_scale))
                for k, a in constants.arch.items()}
        hbm: dict[OpKind, float] = {k: min(1.0, v * self.memory_bandwidth_scale)
                                    for k, v in constants.hbm_efficiency.items()}
        launch = constants.launch_overhead_s if self.kernel_overhead_us is None else self.kernel_overhead_us * 1e-6
        return replace(constants, arch=MappingProxyType(arch), hbm_efficiency=MappingProxyType(hbm),
                       launch_overhead_s=launch)


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale
