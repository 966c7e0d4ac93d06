"""The kinds of replay task, as far as interference is concerned.

A compute kernel is slowed by a collective beside it according to what limits the kernel (tensor
cores for a GEMM, a mix for fused attention, HBM bandwidth for memory-bound kernels), and a
collective is slowed by compute according to the collective. So the replay engine classifies
every task by one of these kinds; the interference model (``interference.py``) holds a factor per
(compute kind, communication kind) pair.
"""

from __future__ import annotations

from enum import Enum

from echo_plan.trace.records import CollectiveKind, OpKind


class TaskKind(str, Enum):
    # compute kernels
    GEMM = "gemm"
    ATTENTION = "attention"
    MEMORY = "memory"  # memory-bound compute: elementwise, norms, softmax, copies, optimizer
    # communication kernels (NCCL collectives and point-to-point transfers)
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    P2P = "p2p"
    # time that occupies a stream but no GPU resources (a host-side gap, a fixed latency):
    # it neither suffers nor causes interference
    DELAY = "delay"

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self in COMM_KINDS

    @staticmethod
    def from_collective(kind: CollectiveKind) -> "TaskKind":
        return _FROM_COLLECTIVE[kind]

    @staticmethod
    def from_op_kind(kind: OpKind) -> "TaskKind":
        """The interference class of a traced compute op (collectives: use ``from_collective``)."""
        if kind is OpKind.COLLECTIVE:
            raise ValueError("a collective op's kind comes from its CollectiveInfo: use TaskKind.from_collective")
        return _FROM_OP.get(kind, TaskKind.MEMORY)


COMPUTE_KINDS = frozenset({TaskKind.GEMM, TaskKind.ATTENTION, TaskKind.MEMORY})
COMM_KINDS = frozenset({
    TaskKind.ALL_REDUCE, TaskKind.ALL_GATHER, TaskKind.REDUCE_SCATTER,
    TaskKind.ALL_TO_ALL, TaskKind.BROADCAST, TaskKind.P2P,
})

_FROM_COLLECTIVE = {
    CollectiveKind.ALL_REDUCE: TaskKind.ALL_REDUCE,
    CollectiveKind.ALL_GATHER: TaskKind.ALL_GATHER,
    CollectiveKind.REDUCE_SCATTER: TaskKind.REDUCE_SCATTER,
    CollectiveKind.ALL_TO_ALL: TaskKind.ALL_TO_ALL,
    CollectiveKind.BROADCAST: TaskKind.BROADCAST,
    CollectiveKind.SEND_RECV: TaskKind.P2P,
}

# Everything that is neither a GEMM nor fused attention is bandwidth-bound on current GPUs.
_FROM_OP = {OpKind.GEMM: TaskKind.GEMM, OpKind.ATTENTION: TaskKind.ATTENTION}
