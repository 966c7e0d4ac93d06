"""The calibration a cluster file carries: what each section may hold, checked in one place.

``calibration:`` in a cluster YAML has up to three parts, each produced by a ``calibrate`` command and
each keeping the rows it was fitted on:

* ``compute``: what the analytical kernel model misses on this GPU generation under a real training
  load (``echo-plan calibrate steps``): a sustained GEMM efficiency scale, a fused-attention
  efficiency scale, an achieved-memory-bandwidth scale and the fixed cost of one kernel;
* ``nccl``: the collective model's fitted parameters (``echo-plan calibrate nccl``), by the names
  and shapes of :data:`CALIBRATABLE`;
* ``compute_by_kernels``: a ``compute`` block per kernel family (``SoftwareSpec.kernels``: ``pytorch``), fitted on
  runs of stacks of that family; its figures replace the ``compute`` block's for those stacks, and what it does not
  fit (the low-precision GEMM scales, say) stays the ``compute`` block's;
* ``ranges``: the spread of held-out prediction errors per software stack, from which every
  prediction's range comes;
* ``from``: a cluster preset whose ``compute`` and ``ranges`` this cluster takes (a cluster file of one's
  own naming a GPU that a preset has inherits them by itself; ``specs/presets.load_cluster``), and after
  loading, which preset they came from.

This module is the schema: a ClusterSpec checks its calibration here when it is built, so a bad
figure is an error that names the key and what is valid before anything runs. The cost models read
the checked figures (``cost/calibration.py``, ``cost/nccl_params.py``, ``cost/ranges.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from echo_plan.errors import SpecError
from echo_plan.specs.calibration_ranges import RangeTable
from echo_plan.specs.software_kinds import KernelFamily

SECTIONS = ("compute", "compute_by_kernels", "nccl", "ranges", "host", "from")  # from: where inherited sections came from (presets.load_cluster)
INHERITED = ("compute", "compute_by_kernels", "ranges")  # what a preset takes from the preset it names (calibration.from)
# what a cluster of one's own takes from the preset it names or that has its GPU: also the host's issue time, which a
# preset of another host (GB200's Grace, after dgx-h100's compute figures) does not take from its ``from``
USER_INHERITED = INHERITED + ("host",)
HOST_OP_US = (0.0, 5000.0)  # calibration.host.op_us: the host's issue time per traced kernel (calibrate/host_fit.py)
# field -> (lower bound, upper bound): a scale outside these is not a calibration but a mistake
COMPUTE_FIELDS: dict[str, tuple[float, float]] = {
    "gemm_efficiency_scale": (0.2, 1.5),
    "fp8_gemm_efficiency_scale": (0.2, 1.5),
    "mxfp8_gemm_efficiency_scale": (0.2, 1.5),
    "fp4_gemm_efficiency_scale": (0.2, 1.5),
    "attention_efficiency_scale": (0.2, 1.5),
    "memory_bandwidth_scale": (0.2, 1.2),
    "kernel_overhead_us": (0.0, 100.0),
}
COMPUTE_INFO = ("source", "fitted_on", "held_out", "stack", "notes", "residuals", "fp8_fit", "mxfp8_fit", "fp4_fit")


def check_calibration(calibration: Mapping[str, Any], context: str = "calibration") -> None:
    """Raise SpecError for an unknown section or a bad compute/ranges entry ."""
    if not isinstance(calibration, Mapping):
        raise SpecError("calibration", calibration, "a mapping with sections " + ", ".join(SECTIONS), context)
    for key in calibration:
        if key not in SECTIONS:
            raise SpecError(f"calibration.{key}", calibration[key], "unknown section; valid: " + ", ".join(SECTIONS),
                            context)
    if "compute" in calibration:
        ComputeCalibration.from_mapping(calibration["compute"], context)
    if "compute_by_kernels" in calibration:
        _check_by_kernels(calibration["compute_by_kernels"], context)
    if "ranges" in calibration:
        RangeTable.from_mapping(calibration["ranges"], context)
    if "from" in calibration and not isinstance(calibration["from"], str):
        raise SpecError("calibration.from", calibration["from"], "the name of a cluster preset", context)
    if "nccl" in calibration:
        check_nccl_section(calibration["nccl"], context)
    if "host" in calibration:
        host = calibration["host"]
        if not isinstance(host, Mapping) or "op_us" not in host:
            raise SpecError("calibration.host", host, "a mapping with op_us (microseconds per traced kernel)", context)
        op = host["op_us"]
        if isinstance(op, bool) or not isinstance(op, (int, float)) or not (HOST_OP_US[0] < op <= HOST_OP_US[1]):
            raise SpecError("calibration.host.op_us", op, f"a number in ({HOST_OP_US[0]:g}, {HOST_OP_US[1]:g}]",
                            context)


def family_block(cluster: Any, kernels: Any) -> tuple[str | None, Mapping[str, Any] | None]:
    """(the family's value, the cluster's ``compute_by_kernels`` block for it or None) for ``kernels``, a KernelFamily
    or its value (None: no family)."""
    family = getattr(kernels, "value", kernels)
    cal = getattr(cluster, "calibration", None) or {}
    return family, ((cal.get("compute_by_kernels") or {}).get(family) if family else None)


def _check_by_kernels(by_kernels: Any, context: str) -> None:
    valid = ", ".join(k.value for k in KernelFamily)
    if not isinstance(by_kernels, Mapping) or not by_kernels:
        raise SpecError("calibration.compute_by_kernels", by_kernels,
                        f"a mapping of kernel family ({valid}) to a compute block", context)
    for family, block in by_kernels.items():
        if family not in {k.value for k in KernelFamily}:
            raise SpecError("calibration.compute_by_kernels", family, f"a kernel family: {valid}", context)
        ComputeCalibration.from_mapping(block, f"{context}: calibration.compute_by_kernels.{family}")


def check_nccl_section(nccl: Any, context: str = "calibration") -> None:
    """``calibration.nccl``: a mapping whose ``params`` are fitted values of :data:`CALIBRATABLE`."""
    if not isinstance(nccl, Mapping) or not isinstance(nccl.get("params"), Mapping):
        raise SpecError("calibration.nccl.params", nccl, "a mapping of fitted NCCL model parameters", context)
    where = f"{context}: calibration.nccl.params"
    for name, value in nccl["params"].items():
        shape = CALIBRATABLE.get(name)
        if shape is None:
            raise SpecError(name, value, f"one of {', '.join(CALIBRATABLE)}", where)
        check_nccl_value(name, value, shape, where)


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
    mxfp8_gemm_efficiency_scale: float = 1.0  # MXFP8 GEMMs, on top of the FP8 ones (fitted on mxfp8 rows)
    fp4_gemm_efficiency_scale: float = 1.0  # NVFP4 GEMMs, on top of gemm_efficiency_scale (fitted on fp4 rows)
    attention_efficiency_scale: float = 1.0
    memory_bandwidth_scale: float = 1.0
    kernel_overhead_us: float | None = None  # None: compute.yaml's launch overhead
    info: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # provenance: rows, source

    @property
    def is_identity(self) -> bool:
        return (self.gemm_efficiency_scale == self.attention_efficiency_scale == self.memory_bandwidth_scale == 1.0
                and self.fp8_gemm_efficiency_scale == self.mxfp8_gemm_efficiency_scale
                == self.fp4_gemm_efficiency_scale == 1.0 and self.kernel_overhead_us is None)

    def values(self) -> dict[str, float]:
        out = {"gemm_efficiency_scale": self.gemm_efficiency_scale,
               "attention_efficiency_scale": self.attention_efficiency_scale,
               "memory_bandwidth_scale": self.memory_bandwidth_scale}
        if self.kernel_overhead_us is not None:
            out["kernel_overhead_us"] = self.kernel_overhead_us
        for name in ("fp8_gemm_efficiency_scale", "mxfp8_gemm_efficiency_scale", "fp4_gemm_efficiency_scale"):
            if getattr(self, name) != 1.0:
                out[name] = getattr(self, name)
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
    def of(cls, cluster: Any, kernels: Any = None) -> "ComputeCalibration":
        """The cluster's compute figures for stacks running ``kernels`` (a KernelFamily or its value; None: the
        ``compute`` block's): the family's block over the ``compute`` block where the cluster carries one."""
        cal = getattr(cluster, "calibration", None) or {}
        name = getattr(cluster, "name", "cluster")
        base = cls.from_mapping(cal.get("compute"), name)
        family, own = family_block(cluster, kernels)
        if own is None:
            return base
        got = cls.from_mapping(own, f"{name}: calibration.compute_by_kernels.{family}")
        values = {**base.values(), **{k: v for k, v in got.values().items() if k in own}}
        return cls(**values, info=got.info)


# ---- calibration.nccl: the collective model's parameters a fit may set, by shape

CALIBRATABLE: dict[str, str] = {
    "base_latency_scale": "triple",
    "nvlink_latency_scale": "triple",
    "net_latency_scale": "triple",
    "protocol_bw_scale": "triple",
    "nvlink_bw_efficiency": "scalar",
    "net_bw_efficiency": "scalar",
    "nvlink_group_loss": "fraction",
    "all_to_all_nvlink_efficiency": "efficiency",
    "all_to_all_net_efficiency": "efficiency",
}


def check_nccl_value(name: str, value: Any, shape: str, context: str) -> Any:
    def positive(v: Any) -> float:
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise SpecError(name, value, "positive numbers", context) from None
        if not x > 0 or x != x or x == float("inf"):
            raise SpecError(name, value, "positive finite numbers", context)
        return x

    if shape == "triple":
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise SpecError(name, value, "a list of 3 numbers [LL, LL128, Simple]", context)
        return tuple(positive(v) for v in value)
    if shape == "efficiency":
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise SpecError(name, value, "a number in (0, 1]", context) from None
        if not 0.0 < x <= 1.0:
            raise SpecError(name, value, "a number in (0, 1]", context)
        return x
    if shape == "fraction":
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise SpecError(name, value, "a number in [0, 0.9]", context) from None
        if not 0.0 <= x <= 0.9:
            raise SpecError(name, value, "a number in [0, 0.9]", context)
        return x
    return positive(value)


# What an uncalibrated prediction's error looked like on the visible suites (validate, leave-one-suite-out:
# the SC21 A100 rows with no A100 calibration left were 5-16% slow)
UNCALIBRATED_ERROR = "uncalibrated, the SC21 A100 runs were predicted 5-16% off"


def kernels_status(cluster: Any, kernels: Any) -> str | None:
    """One line on the compute figures the cluster carries for the stack's kernel family ``kernels``; where it carries
    none, for a family other than the default one, that its compute figures time them (fitted on which stack's
    runs); None for the default family without a block of its own (the compute figures are its)."""
    family, block = family_block(cluster, kernels)
    cal = getattr(cluster, "calibration", None) or {}
    if not block:
        if family in (None, KernelFamily.NVIDIA.value) or "compute" not in cal:
            return None
        fitted = (cal.get("compute") or {}).get("stack")
        source = str(cal.get("from") or "").split(" (")[0]
        whose = f", fitted on {fitted} runs" if fitted else (f", {source}'s" if source else "")
        return (f"no compute figures of this cluster's for {family} kernels (the stack's kernels): its compute "
                f"figures time them{whose} (on the Hopper presets PyTorch's own kernels have figures of their own: "
                "docs/validation.md)")
    figures = ", ".join(k for k in block if k in COMPUTE_FIELDS)
    fitted = block.get("fitted_on") or {}
    rows = sum(len(v) for v in fitted.values())
    return (f"compute figures for {family} kernels (the stack's kernels): {figures} fitted on {rows} runs of "
            f"{', '.join(fitted) or 'its own'}, the rest the GPU's (docs/validation.md)")


def calibration_status(cluster: Any) -> str:
    """One line on what the cluster's predictions rest on: its own fitted figures, a preset's it inherited,
    or none for its GPU (then the kernel model runs as published, and measured runs are usually slower)."""
    cal = getattr(cluster, "calibration", None) or {}
    gpu = cluster.gpu.name
    if "compute" not in cal:
        return (f"no calibration for GPU {gpu}: the kernel model runs as published, without the sustained rates "
                f"measured runs show ({UNCALIBRATED_ERROR}; calibrate with `echo-plan calibrate steps`, or name a "
                "preset of the same GPU with `calibration: {from: PRESET}`)")
    if cal.get("from"):
        return f"calibration inherited from {cal['from']}"
    return f"calibrated for GPU {gpu}"
