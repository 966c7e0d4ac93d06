"""The parameter record of the NCCL collective model: NCCL's published constants plus the
calibratable scales, loaded from ``echo_plan/data/nccl.yaml`` (which cites NCCL tuning.cc).

Protocol-indexed values are tuples in the order of :data:`PROTOCOLS` (LL, LL128, Simple).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import Any, Mapping

from echo_plan.files import safe_load
import yaml

from echo_plan.cost.base import Protocol_
from echo_plan.errors import FileFormatError, SpecError
from echo_plan.specs.calibration import CALIBRATABLE, check_nccl_value

PROTOCOLS: tuple[Protocol_, ...] = (Protocol_.LL, Protocol_.LL128, Protocol_.SIMPLE)
PROTO_INDEX: dict[Protocol_, int] = {p: i for i, p in enumerate(PROTOCOLS)}
Triple = tuple[float, float, float]

# The fields a calibration may set, with their shape: "triple" (per protocol) or "scalar".
@dataclass(frozen=True, slots=True)
class NcclParams:
    # NCCL's constants (see nccl.yaml for each one's meaning and source)
    base_latency_us: Mapping[str, Triple]
    nvlink_hop_us: Mapping[str, Triple]
    net_hop_us: Mapping[str, Triple]
    reference_nvlink_latency_us: float
    reference_net_latency_us: float
    net_overhead_us: float
    net_overhead_simple_multiplier: float
    ring_plateau_pre_sm80: float
    ring_plateau_sm80_plus: float
    ring_protocol_factor: Triple
    tree_allreduce_factor: float
    tree_protocol_factor_single: Triple
    tree_protocol_factor_multi: Triple
    tree_algbw_ratio: float
    ll_max_bw_single: Mapping[int, float]
    ll_max_bw_two_nodes: float
    ll_max_bw_more_nodes: float
    nvls_efficiency: Mapping[int, float]
    tree_correction: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    p2p_ll_threshold_bytes: int
    # calibratable (defaults reproduce NCCL's own model)
    base_latency_scale: Triple = (1.0, 1.0, 1.0)
    nvlink_latency_scale: Triple = (1.0, 1.0, 1.0)
    net_latency_scale: Triple = (1.0, 1.0, 1.0)
    protocol_bw_scale: Triple = (1.0, 1.0, 1.0)
    nvlink_bw_efficiency: float = 1.0
    net_bw_efficiency: float = 1.0
    nvlink_group_loss: float = 0.0  # c in B x (1 - c / p): a ring over p GPUs of a server reaches less (fitted)
    # the share of each tier's bandwidth an all-to-all reaches inside a training step (1: what
    # nccl-tests' alltoall_perf reaches, NCCL's own model; calibrated per cluster, nccl.yaml)
    all_to_all_nvlink_efficiency: float = 1.0
    all_to_all_net_efficiency: float = 1.0
    source: str = ""

    def calibratable(self) -> dict[str, Any]:
        """The calibratable values as plain JSON/YAML data."""
        return {name: (list(getattr(self, name)) if shape == "triple" else getattr(self, name))
                for name, shape in CALIBRATABLE.items()}

    def with_calibration(self, values: Mapping[str, Any], context: str = "calibration") -> "NcclParams":
        """A copy with calibratable fields replaced; unknown names or bad values raise SpecError."""
        changes: dict[str, Any] = {}
        for name, value in values.items():
            shape = CALIBRATABLE.get(name)
            if shape is None:
                raise SpecError(name, value, f"one of {', '.join(CALIBRATABLE)}", context)
            changes[name] = check_nccl_value(name, value, shape, context)
        return replace(self, **changes)

    def identity(self) -> tuple:
        """A hashable summary (for caches keyed on the parameters)."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name in CALIBRATABLE)




def _triple(data: Any, where: str) -> Triple:
    if not isinstance(data, (list, tuple)) or len(data) != 3:
        raise FileFormatError(where, "expected a list of 3 numbers [LL, LL128, Simple]")
    return (float(data[0]), float(data[1]), float(data[2]))


def load_default_params(text: str | None = None) -> NcclParams:
    """NcclParams from ``echo_plan/data/nccl.yaml`` (or the given YAML text)."""
    where = "echo_plan/data/nccl.yaml"
    packaged = text is None
    if text is None:
        text = (resources.files("echo_plan") / "data" / "nccl.yaml").read_text(encoding="utf-8")
    try:
        d = safe_load(text, packaged=packaged)
        hop = d["hop_latency_us"]
        tc = d["tree_correction"]
        defaults = d.get("defaults", {})
        params = NcclParams(
            base_latency_us={k: _triple(v, where) for k, v in d["base_latency_us"].items()},
            nvlink_hop_us={k: _triple(v, where) for k, v in hop["nvlink"].items()},
            net_hop_us={k: _triple(v, where) for k, v in hop["net"].items()},
            reference_nvlink_latency_us=float(d["reference_nvlink_latency_us"]),
            reference_net_latency_us=float(d["reference_net_latency_us"]),
            net_overhead_us=float(d["net_overhead_us"]),
            net_overhead_simple_multiplier=float(d["net_overhead_simple_multiplier"]),
            ring_plateau_pre_sm80=float(d["ring_plateau_factor"]["pre_sm80"]),
            ring_plateau_sm80_plus=float(d["ring_plateau_factor"]["sm80_plus"]),
            ring_protocol_factor=_triple(d["ring_protocol_factor"], where),
            tree_allreduce_factor=float(d["tree_allreduce_factor"]),
            tree_protocol_factor_single=_triple(d["tree_protocol_factor"]["single_node"], where),
            tree_protocol_factor_multi=_triple(d["tree_protocol_factor"]["multi_node"], where),
            tree_algbw_ratio=float(d["tree_algbw_ratio"]),
            ll_max_bw_single={int(k): float(v) for k, v in d["ll_max_bw_GBps"]["single_node"].items()},
            ll_max_bw_two_nodes=float(d["ll_max_bw_GBps"]["two_nodes"]),
            ll_max_bw_more_nodes=float(d["ll_max_bw_GBps"]["more_nodes"]),
            nvls_efficiency={int(k): float(v) for k, v in d["nvls_efficiency"].items()},
            tree_correction=(tuple(map(float, tc["LL"])), tuple(map(float, tc["LL128"])),
                             tuple(map(float, tc["Simple"]))),
            p2p_ll_threshold_bytes=int(d["p2p_ll_threshold_bytes"]),
            source=str(d.get("source", "")),
        )
    except (KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError) as exc:
        raise FileFormatError(where, f"malformed NCCL constants: {exc!r}") from None
    return params.with_calibration(defaults, context=where) if defaults else params
