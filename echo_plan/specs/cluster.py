"""ClusterSpec: GPUs, servers and the network between them.

Units are in the field names: ``_GBps`` is gigabytes per second (1e9 B/s), ``_Gbps`` gigabits per
second, ``_GiB`` gibibytes, ``_us`` microseconds, ``_tflops`` 1e12 FLOP/s.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.specs.base import Spec
from echo_plan.specs.calibration import check_calibration
from echo_plan.errors import SpecError


class DType(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"
    FP4 = "fp4"  # E2M1, two per byte (NVFP4: Blackwell's 4-bit tensor cores)

    @property
    def nbytes(self) -> float:
        return {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4, DType.FP8: 1, DType.FP4: 0.5}[self]

    @property
    def low_precision(self) -> bool:
        """The GEMMs run quantised (FP8 or FP4) while the rest of training stays bf16 (Transformer Engine)."""
        return self in (DType.FP8, DType.FP4)


class Fabric(str, Enum):
    RAIL_OPTIMIZED = "rail-optimized"
    FAT_TREE = "fat-tree"


class Routing(str, Enum):
    """How flows that cross leaves pick a spine uplink (docs/traffic.md).

    ``none``: the leaf/spine layer is not modelled (every flow at its NIC's rate; a fat-tree's
    oversubscription charged on every inter-server hop), the model before fabric layers existed.
    ``ecmp``: each flow is hashed onto one of its leaf's uplinks; collisions share a link.
    ``planned``: flows are placed on disjoint uplinks, as C4P does (the collision-free bound).
    """

    NONE = "none"
    ECMP = "ecmp"
    PLANNED = "planned"


class Placement(str, Enum):
    """Which leaf a job's servers sit under: ``in-order`` fills each leaf before the next (what a
    topology-aware scheduler gives); ``round-robin`` puts server i under leaf i mod leaves, a
    deterministic stand-in for a job scattered over leaves by a busy scheduler (C4's setting)."""

    IN_ORDER = "in-order"
    ROUND_ROBIN = "round-robin"


DEFAULT_LEAF_RADIX = 64  # judgement: today's 400G InfiniBand/Ethernet leaves (NVIDIA QM9700, 64 ports)


class GPUSpec(Spec):
    name: str
    # ceilings ~1000x above today's parts (H100: ~2,000 TFLOP/s FP8, 80 GiB, 3.35 TB/s, 18 links)
    peak_bf16_tflops: float = Field(gt=0, le=1e6, description="dense BF16 tensor-core peak")
    peak_fp16_tflops: float = Field(gt=0, le=1e6, description="dense FP16 tensor-core peak")
    peak_fp32_tflops: float = Field(gt=0, le=1e6, description="FP32 (non tensor-core) peak")
    peak_fp8_tflops: float | None = Field(default=None, gt=0, le=1e6)
    peak_fp4_tflops: float | None = Field(default=None, gt=0, le=1e6, description="dense FP4 (NVFP4) tensor-core peak")
    hbm_GiB: float = Field(gt=0, le=1e5)
    hbm_bw_GBps: float = Field(gt=0, le=1e7)
    nvlink_bw_GBps: float = Field(ge=0, le=1e7, description="NVLink bandwidth per GPU, both directions together")
    nvlink_links: int = Field(ge=0, le=1024)
    nvlink_link_bw_GBps: float = Field(ge=0, le=1e6, description="NCCL's usable bandwidth per link and direction")
    sm_count: int = Field(gt=0, le=100_000)
    sm_arch: int = Field(gt=0, le=1000, description="compute capability x10, e.g. 80 for A100, 90 for Hopper")
    nvls: bool = Field(default=False, description="NVLink SHARP (NVSwitch reductions) available")
    tdp_W: float | None = Field(default=None, gt=0, le=1e5,
                                description="board power limit (TDP); energy estimates count each GPU at it")

    @property
    def compute_key(self) -> str:
        """What sets this GPU's kernel speeds, in one line: two GPUs with equal keys run the same kernels as fast
        (H800 and H100 SXM differ only in NVLink), so validation rows of one tell about the other
        (``calibration.ranges.gpus``)."""
        peaks = "/".join(f"{x or 0:g}" for x in (self.peak_bf16_tflops, self.peak_fp8_tflops, self.peak_fp4_tflops))
        power = f" {self.tdp_W:g} W" if self.tdp_W else ""
        return f"sm{self.sm_arch} x{self.sm_count}, {peaks} TFLOPS, {self.hbm_bw_GBps:g} GB/s{power}"

    def peak_tflops(self, dtype: DType) -> float:
        table = {
            DType.BF16: self.peak_bf16_tflops,
            DType.FP16: self.peak_fp16_tflops,
            DType.FP32: self.peak_fp32_tflops,
            DType.FP8: self.peak_fp8_tflops,
            DType.FP4: self.peak_fp4_tflops,
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
    # -- the leaf/spine layers (two tiers); only --routing ecmp|planned reads them (docs/traffic.md) --
    leaf_radix: int = Field(default=DEFAULT_LEAF_RADIX, ge=2, le=4096, description="ports of one leaf switch")
    uplinks_per_leaf: int | None = Field(
        default=None, ge=1, le=4096,
        description="leaf ports to the spines (default: radix / (1 + oversubscription)); the rest face NICs")
    uplink_bw_Gbps: float | None = Field(default=None, gt=0, le=1e7,
                                         description="rate of one uplink (default: the NIC's rate)")
    routing: Routing = Routing.NONE
    placement: Placement = Placement.IN_ORDER
    flows_per_connection: int = Field(default=1, ge=1, le=1024,
                                      description="flows (queue pairs) between two NICs; NCCL's default is 1")
    ecmp_seed: int = Field(default=0, ge=0, le=2**31 - 1, description="seed of the Monte Carlo ECMP estimate")
    failed_uplinks: tuple[tuple[int, int], ...] = Field(
        default=(), description="(leaf, uplinks down) pairs: flows move to the leaf's remaining uplinks")

    @model_validator(mode="after")
    def _leaf(self) -> "NetworkSpec":
        up = self.leaf_uplinks
        if up >= self.leaf_radix:
            raise ValueError(f"uplinks_per_leaf={up} leaves no port of the {self.leaf_radix}-port leaf for NICs")
        if self.uplinks_per_leaf is not None and self.oversubscription != 1.0:
            derived = (self.leaf_radix - up) / up
            if abs(derived - self.oversubscription) > 0.05 * self.oversubscription:
                raise ValueError(f"oversubscription={self.oversubscription:g} disagrees with the leaf's "
                                 f"{self.leaf_radix - up} down / {up} up ports ({derived:.3g}); give one of them")
        if self.fabric is Fabric.FAT_TREE and self.leaf_downlinks < self.nics_per_node:
            raise ValueError(f"a fat-tree leaf with {self.leaf_downlinks} NIC ports cannot hold one server's "
                             f"{self.nics_per_node} NICs; raise leaf_radix or lower uplinks_per_leaf")
        seen = set()
        for leaf, down in self.failed_uplinks:
            if leaf < 0 or leaf in seen:
                raise ValueError(f"failed_uplinks: leaf {leaf} must be a non-negative index given once")
            if not 1 <= down < up:
                raise ValueError(f"failed_uplinks: leaf {leaf} with {down} uplinks down; valid 1 to {up - 1} "
                                 f"(of its {up})")
            seen.add(leaf)
        return self

    @property
    def leaf_uplinks(self) -> int:
        if self.uplinks_per_leaf is not None:
            return self.uplinks_per_leaf
        return max(1, int(round(self.leaf_radix / (1.0 + self.oversubscription))))

    @property
    def leaf_downlinks(self) -> int:
        return self.leaf_radix - self.leaf_uplinks

    @property
    def servers_per_leaf(self) -> int:
        """Servers under one leaf: one NIC each per rail plane (rail-optimised), all their NICs (fat-tree)."""
        if self.fabric is Fabric.RAIL_OPTIMIZED:
            return self.leaf_downlinks
        return self.leaf_downlinks // self.nics_per_node

    @property
    def nic_GBps(self) -> float:
        return self.nic_bw_Gbps / 8.0

    @property
    def node_GBps(self) -> float:
        """Usable injection bandwidth of one server, one direction."""
        return self.nics_per_node * self.nic_GBps * self.nic_efficiency / self.oversubscription


class HostSpec(Spec):
    """A server's host side, read only when a plan offloads its optimizer to CPU memory (cost/offload.py).

    Figures per server unless the name says per GPU; presets give spec-sheet figures with their source and
    say which are judgements (the achievable share of a peak)."""

    memory_GiB: float = Field(gt=0, le=1e6, description="CPU memory of one server")
    memory_bw_GBps: float = Field(gt=0, le=1e6, description="CPU memory bandwidth one server's cores reach together "
                                                            "(STREAM-like, all sockets)")
    link_GBps: float = Field(gt=0, le=1e5, description="GPU-host copy bandwidth of one GPU, one direction, pinned "
                                                       "memory (PCIe, or NVLink-C2C on Grace)")
    usable_fraction: float = Field(default=0.9, gt=0, le=1, description="share of the CPU memory training may pin "
                                   "(the rest: the OS, the data loader, page cache); a judgement")


class ClusterSpec(Spec):
    name: str
    gpu: GPUSpec
    gpus_per_node: int = Field(gt=0, le=L.MAX_GPUS_PER_NODE, description="GPUs of one server (a compute tray)")
    num_nodes: int = Field(gt=0, le=L.MAX_GPUS)
    network: NetworkSpec
    nvlink_domain_gpus: int | None = Field(
        default=None, gt=0, le=L.MAX_GPUS,
        description="GPUs on one NVLink fabric, a whole number of servers: 72 for a GB200/GB300 NVL72 rack of "
                    "18 four-GPU trays; None: one server (HGX/DGX)")
    nvlink_latency_us: float = Field(default=0.6, ge=0, le=1e6)
    host: HostSpec | None = Field(default=None, description="the servers' CPU memory and GPU-host links; needed "
                                                            "only to offload the optimizer (--offload-optimizer)")
    sources: list[str] = Field(default_factory=list)
    calibration: dict = Field(
        default_factory=dict,
        description="fitted figures with provenance: compute (kernel model), nccl (collectives), ranges (errors)")

    @model_validator(mode="after")
    def _rules(self) -> "ClusterSpec":
        if self.gpus_per_node > 1 and self.gpu.nvlink_links == 0:
            raise ValueError("a server with several GPUs needs gpu.nvlink_links > 0")
        if self.domain_gpus > self.gpus_per_node and self.network.routing is not Routing.NONE:
            raise ValueError(f"routing {self.network.routing.value}: the leaf/spine model places flows per server; "
                             f"with an NVLink domain of {self.domain_gpus} GPUs use routing none")
        if self.nvlink_domain_gpus is not None and self.nvlink_domain_gpus % self.gpus_per_node:
            raise ValueError(f"nvlink_domain_gpus {self.nvlink_domain_gpus} must be a whole number of "
                             f"{self.gpus_per_node}-GPU servers")
        if self.num_gpus > L.MAX_GPUS:
            raise ValueError(f"{self.num_nodes:,} nodes x {self.gpus_per_node} GPUs = {self.num_gpus:,} GPUs; "
                             f"at most {L.MAX_GPUS:,}")
        if self.calibration:
            check_calibration(self.calibration, self.name)
        for leaf, _ in self.network.failed_uplinks:
            if leaf >= self.num_leaves:
                raise ValueError(f"failed_uplinks: leaf {leaf} does not exist; {self.name} has {self.num_leaves} "
                                 f"leaf switch(es) per plane (0 to {self.num_leaves - 1})")
        return self

    @property
    def num_leaves(self) -> int:
        """Leaf switches per plane (per rail on a rail-optimised fabric) that the job's servers use."""
        return -(-self.num_nodes // max(1, self.network.servers_per_leaf))

    def leaf_of(self, node):
        """The leaf above server ``node`` (an int or a numpy array of them), by ``network.placement``."""
        if self.network.placement is Placement.ROUND_ROBIN:
            return node % self.num_leaves
        return node // self.network.servers_per_leaf

    def servers_under(self, leaf: int) -> range:
        if self.network.placement is Placement.ROUND_ROBIN:
            return range(leaf, self.num_nodes, self.num_leaves)
        per = self.network.servers_per_leaf
        return range(leaf * per, min(self.num_nodes, (leaf + 1) * per))

    def with_routing(self, routing: str | None = None, flows_per_connection: int | None = None) -> "ClusterSpec":
        """The same cluster with another routing of cross-leaf flows (--routing, --flows-per-connection)."""
        changes: dict = {}
        if routing is not None:
            try:
                changes["routing"] = Routing(str(routing).lower())
            except ValueError:
                raise SpecError("--routing", routing, "one of " + ", ".join(r.value for r in Routing)) from None
        if flows_per_connection is not None:
            L.check_int("--flows-per-connection", flows_per_connection, 1, 1024, "flows between two NICs")
            changes["flows_per_connection"] = flows_per_connection
        if not changes:
            return self
        if changes.get("routing", Routing.NONE) is not Routing.NONE and self.domain_gpus > self.gpus_per_node:
            raise SpecError("--routing", routing, f"none on {self.name}: the leaf/spine model places flows per "
                                                  f"server, not yet across an NVLink domain of {self.domain_gpus} GPUs")
        return self.replace(network=self.network.replace(**changes).model_dump())

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def domain_gpus(self) -> int:
        """GPUs that reach each other over NVLink: the NVLink domain, or one server."""
        return int(self.nvlink_domain_gpus or self.gpus_per_node)

    @property
    def num_domains(self) -> int:
        """NVLink domains the job's GPUs span (the last may be partly used)."""
        return -(-self.num_gpus // self.domain_gpus)

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
                return self.replace(gpus_per_node=gpus, num_nodes=1, nvlink_domain_gpus=None)
            if gpus % self.gpus_per_node:
                raise SpecError(
                    "gpus", gpus,
                    f"a multiple of {self.gpus_per_node} (GPUs per server in {self.name}), "
                    f"or at most {self.gpus_per_node}",
                )
            return self.replace(num_nodes=gpus // self.gpus_per_node)
        return self
