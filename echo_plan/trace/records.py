"""What the tracer produces: an ordered op graph for one stage of the model on one rank.

These records are the contract between trace/, cost/ and replay/. They are frozen dataclasses
(not pydantic) because a trace holds hundreds of them and the replay reads them in a hot loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Stream(str, Enum):
    """Where an op runs on the GPU."""

    COMPUTE = "compute"
    TP_COMM = "tp_comm"  # tensor/sequence-parallel collectives (on the critical path in Megatron-LM)
    DP_COMM = "dp_comm"  # data-parallel gradient reduction / parameter gathering
    PP_COMM = "pp_comm"  # pipeline point-to-point
    CP_COMM = "cp_comm"  # context-parallel ring exchanges of K/V chunks (their own stream, beside attention)


class OpKind(str, Enum):
    """The kind of kernel, which decides the cost model and the interference it suffers."""

    GEMM = "gemm"
    ATTENTION = "attention"  # fused attention (flash/SDPA) forward or backward
    ELEMENTWISE = "elementwise"
    NORM = "norm"
    SOFTMAX = "softmax"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"  # gathers and scatter-adds of embedding rows
    COPY = "copy"  # materialising copies, concatenations, transposes that move data
    VIEW = "view"  # metadata-only ops (views, reshapes); no kernel
    COLLECTIVE = "collective"
    OTHER = "other"


class Phase(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # forward ops re-run during backward
    STEP = "step"  # once per training step, not per micro-batch (FP8 weight casts on the first micro-batch)


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


class GroupKind(str, Enum):
    TP = "tp"
    DP = "dp"
    PP = "pp"
    EP = "ep"  # expert parallel: the MoE token dispatch and combine
    ETP = "etp"  # expert tensor parallel
    EDP = "edp"  # expert data parallel: the experts' gradient reduction
    CP = "cp"  # context parallel: the ring that passes K/V chunks (stride tp, Megatron-Core's tp-cp-dp-pp order)
    WORLD = "world"


class StageKind(str, Enum):
    """Which part of the model a trace covers."""

    BLOCK = "block"  # one transformer layer
    EMBEDDING = "embedding"  # token (+ position) embedding, first pipeline stage
    OUTPUT = "output"  # final norm, output projection and cross-entropy loss, last stage


@dataclass(frozen=True, slots=True)
class CommGroup:
    """A regular group of ranks: ``start, start+stride, ...`` (``size`` ranks).

    Megatron-LM orders ranks tp-fastest, then dp, then pp, so a TP group has stride 1, a DP group
    stride tp and a PP group stride tp*dp. ``placement`` says how the group lands on servers.
    """

    kind: GroupKind
    size: int
    stride: int = 1
    start: int = 0

    def ranks(self) -> tuple[int, ...]:
        return tuple(self.start + i * self.stride for i in range(self.size))

    def placement(self, gpus_per_node: int) -> tuple[int, int]:
        """(ranks of the group per server, servers spanned), assuming ranks fill servers in order."""
        if self.size <= 1:
            return (1, 1)
        if self.stride >= gpus_per_node:
            per_node = 1
        else:
            per_node = min(self.size, max(1, gpus_per_node // self.stride))
        nodes = -(-self.size // per_node)
        return (per_node, nodes)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class CollectiveInfo:
    """A collective issued by the traced code. ``nbytes`` follows nccl-tests' "size" convention:

    all_reduce / broadcast: the buffer; all_gather: the gathered output (all ranks' parts);
    reduce_scatter: the input (all ranks' parts); all_to_all: all a rank sends; send_recv: the message.
    """

    kind: CollectiveKind
    nbytes: int
    group: CommGroup


@dataclass(frozen=True, slots=True)
class OpRecord:
    index: int
    name: str  # aten op name, e.g. "aten.mm.default", or "c10d.all_reduce" for a collective
    kind: OpKind
    phase: Phase
    stream: Stream
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    flops: float
    bytes_read: int
    bytes_written: int
    deps: tuple[int, ...]  # indices of earlier ops in the same trace whose outputs this op reads
    collective: CollectiveInfo | None = None
    module: str = ""  # dotted name of the module that issued it, e.g. "attention.qkv"


@dataclass(frozen=True, slots=True)
class TraceKey:
    """Everything that changes a trace; its digest names the cache entry."""

    stage: StageKind
    structure: str  # canonical description of the module structure (sizes, activation, norm, ...)
    tp: int
    sequence_parallel: bool
    micro_batch_size: int
    seq_length: int
    dtype: str
    recompute: str
    code_version: str
    software: str = ""  # SoftwareSpec.trace_signature(): the stack's kernels, dropout, overlap, recompute modules
    variant: str = ""  # the layer kind and expert layout of a block that is not a dense full-attention layer

    def digest(self) -> str:
        import hashlib

        text = "|".join(str(getattr(self, f)) for f in self.__dataclass_fields__)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class LayerTrace:
    """One stage (a transformer layer, the embedding, or the output+loss) on one rank, one micro-batch."""

    key: TraceKey
    ops: tuple[OpRecord, ...]
    saved_bytes: int  # activation bytes kept from forward to backward under key.recompute
    saved_bytes_by_mode: dict[str, int] = field(default_factory=dict)  # recompute mode -> bytes
    param_count: int = 0  # parameters held by this rank for this stage
    from_cache: bool = False

    def by_phase(self, phase: Phase) -> tuple[OpRecord, ...]:
        return tuple(op for op in self.ops if op.phase is phase)

    @property
    def collectives(self) -> tuple[OpRecord, ...]:
        return tuple(op for op in self.ops if op.collective is not None)

    @property
    def total_flops(self) -> float:
        return sum(op.flops for op in self.ops)
