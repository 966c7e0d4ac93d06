"""The narrow interfaces between cost models and their callers (replay, CLI, calibration).

A measured kernel database or a new collective algorithm drops in by implementing one of these
protocols; callers never look behind them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from echo_plan.specs.cluster import ClusterSpec, DType, GPUSpec
from echo_plan.trace.records import CollectiveKind, CommGroup, OpRecord


class Algorithm(str, Enum):
    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"
    P2P = "p2p"  # point-to-point send/recv, and all-to-all as pairwise exchanges
    LOCAL = "local"  # a group of one: nothing moves
    CUSTOM = "custom"  # a user-supplied algorithm (MSCCL-IR)


class Protocol_(str, Enum):
    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


@dataclass(frozen=True, slots=True)
class CollectiveEstimate:
    time_s: float
    algorithm: Algorithm
    protocol: Protocol_
    algbw_GBps: float  # nccl-tests' algbw: size / time
    busbw_GBps: float  # nccl-tests' busbw: algbw x the collective's bus factor


@runtime_checkable
class ComputeModel(Protocol):
    def op_time(self, op: OpRecord, gpu: GPUSpec, dtype: DType) -> float:
        """Seconds one compute op takes on ``gpu`` when it runs alone."""
        ...


def with_stack_kernels(compute: Any, stack: Any, fp8_gemm_sms_held: int = 0) -> Any:
    """``compute`` timing the kernels ``stack`` runs: its fused-attention library (``attention_library``),
    its FP8 recipe's scaling (blockwise: the experts' grouped GEMMs too) and the SMs its FP8 GEMMs leave to
    communication (``fp8_gemm_sms_held``: ``SoftwareSpec.fp8_gemm_sms_held``). A model that has no notion of
    them (a user's own ComputeModel) is returned as it is."""
    kernels = getattr(compute, "with_kernels", None)
    if kernels is not None:
        blockwise = stack.fp8_recipe.value == "blockwise"
        if fp8_gemm_sms_held:
            return kernels(stack.attention_library.value, blockwise, fp8_gemm_sms_held)
        return kernels(stack.attention_library.value, blockwise)
    pick = getattr(compute, "with_attention_library", None)
    return compute if pick is None else pick(stack.attention_library.value)


@runtime_checkable
class CollectiveModel(Protocol):
    def time(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> CollectiveEstimate:
        """How long a collective of ``nbytes`` (nccl-tests size convention) takes on ``group``."""
        ...
