"""ClusterSpec: GPUs, servers and the network between them.

Units are in the field names: ``_GBps`` is gigabytes per second (1e9 B/s), ``_Gbps`` gigabits per
second, ``_GiB`` gibibytes, ``_us`` microseconds, ``_tflops`` 1e12 FLOP/s.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.specs.base import Spec
from echo_plan.errors import SpecError


class DType(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"

    @property
    def nbytes(self) -> int:
        return {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4, DType.FP8: 1}[self]


class Fabric(str, Enum):
    RAIL_OPTIMIZED = "rail-optimized"
    FAT_TREE = "fat-tree"


class GPUSpec(Spec):
    name: str
    # ceilings ~1000x above today's parts (H100: ~2,000 TFLOP/s FP8, 80 GiB, 3.35 TB/s, 18 links)
    peak_bf16_tflops: float = Field(gt=0, le=1e6, description="dense BF16 tensor-core peak")
    peak_fp16_tflops: float = Field(gt=0, le=1e6, description="dense FP16 tensor-core peak")
    peak_fp32_tflops: float = Field(gt=0, le=1e6, description="FP32 (non tensor-core) peak")
    peak_fp8_tflops: float | None = Field(default=None, gt=0, le=1e6)
    hbm_GiB: float = Field(gt=0, le=1e5)
    hbm_bw_GBps: float = Field(gt=0, le=1e7)
    nvlink_bw_GBps: float = Field(ge=0, le=1e7, description="NVLink bandwidth per GPU, both directions together")
    nvlink_links: int = Field(ge=0, le=1024)
    nvlink_link_bw_GBps: float = Field(ge=0, le=1e6, description="NCCL's usable bandwidth per link and direction")
    sm_count: int = Field(gt=0, le=100_000)
    sm_arch: int = Field(gt=0, le=1000, description="compute capability x10, e.g. 80 for A100, 90 for Hopper")
    nvls: bool = Field(default=False, description="NVLink SHARP (NVSwitch reductions) available")

    def peak_tflops(self, dtype: DType) -> float:
        table = {
            DType.BF16: self.peak_bf16_tflops,
            DType.FP16: self.peak_fp16_tflops,
            DType.FP32: self.peak_fp32_tflops,
            DType.FP8: self.peak_fp8_tflops,
        }
        value = table[dtype]
        if value is None:
            raise SpecError("dtype", dtype.value, f"GPU {self.name} has no {dtype.value} peak in its spec")
        return value

    @property
    def nvlink_uni_GBps(self) -> float:
        """What NCCL can push one way over NVLink: links x per-link rate."""
        return self.nvlink_links * self.nvlink_link_bw_GBps


class NetworkSpec(Spec):
    nics_per_node: int = Field(gt=0, le=1024)
    nic_bw_Gbps: float = Field(gt=0, le=1e7, description="line rate of one NIC, one direction")
    nic_efficiency: float = Field(default=0.94, gt=0, le=1, description="achievable fraction of line rate")
    fabric: Fabric = Fabric.RAIL_OPTIMIZED
    oversubscription: float = Field(default=1.0, ge=1.0, le=1e3,
                                    description="fabric oversubscription ratio, 1 = non-blocking")
    latency_us: float = Field(default=5.0, ge=0, le=1e6, description="one network hop's latency")

    @property
    def nic_GBps(self) -> float:
        return self.nic_bw_Gbps / 8.0

    @property
    def node_GBps(self) -> float:
        """Usable injection bandwidth of one server, one direction."""
        return self.nics_per_node * self.nic_GBps * self.nic_efficiency / self.oversubscription


class ClusterSpec(Spec):
    name: str
    gpu: GPUSpec
    gpus_per_node: int = Field(gt=0, le=L.MAX_GPUS_PER_NODE)
    num_nodes: int = Field(gt=0, le=L.MAX_GPUS)
    network: NetworkSpec
    nvlink_latency_us: float = Field(default=0.6, ge=0, le=1e6)
    sources: list[str] = Field(default_factory=list)
    calibration: dict = Field(
        default_factory=dict,
        description="fitted figures with provenance: compute (kernel model), nccl (collectives), ranges (errors)")

    @model_validator(mode="after")
    def _rules(self) -> "ClusterSpec":
        if self.gpus_per_node > 1 and self.gpu.nvlink_links == 0:
            raise ValueError("a server with several GPUs needs gpu.nvlink_links > 0")
        if self.num_gpus > L.MAX_GPUS:
            raise ValueError(f"{self.num_nodes:,} nodes x {self.gpus_per_node} GPUs = {self.num_gpus:,} GPUs; "
                             f"at most {L.MAX_GPUS:,}")
        if self.calibration:
            from echo_plan.cost.calibration import check_calibration

            check_calibration(self.calibration, self.name)
        return self

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def resized(self, nodes: int | None = None, gpus: int | None = None) -> "ClusterSpec":
        """The same cluster with another size; ``gpus`` must fill whole servers (or be one server or less)."""
        if nodes is not None and gpus is not None:
            raise SpecError("--nodes/--gpus", f"{nodes}/{gpus}", "give one of --nodes or --gpus, not both")
        if nodes is not None:
            L.check_int("nodes", nodes, 1, L.MAX_GPUS // self.gpus_per_node, "servers")
            return self.replace(num_nodes=nodes)
        if gpus is not None:
            L.check_int("gpus", gpus, 1, L.MAX_GPUS, "GPUs")
            if gpus < self.gpus_per_node:
                return self.replace(gpus_per_node=gpus, num_nodes=1)
            if gpus % self.gpus_per_node:
                raise SpecError(
                    "gpus", gpus,
                    f"a multiple of {self.gpus_per_node} (GPUs per server in {self.name}), "
                    f"or at most {self.gpus_per_node}",
                )
            return self.replace(num_nodes=gpus // self.gpus_per_node)
        return self
