"""Data-parallel gradient buckets and the optimizer step of one pipeline rank.

Bucketing follows Megatron-LM's DistributedDataParallel (megatron/core/distributed/
distributed_data_parallel.py): with ``overlap_grad_reduce`` the gradients of each model chunk are
packed, in the order backward produces them, into buckets of ``max(40e6, 1e6 x dp)`` parameters
and each bucket is reduced as soon as it is complete; without overlap there is one bucket per
chunk, reduced after the backward pass. The buffer being reduced is the main-grad buffer: fp32
for bf16 training (Megatron-LM forces ``accumulate_allreduce_grads_in_fp32`` with bf16) and the
parameter dtype (2 bytes) for fp16, its default. With the distributed optimizer (ZeRO-1 style) a
bucket is reduce-scattered and, after the optimizer, its parameters (2 bytes each) are
all-gathered; otherwise it is all-reduced.

The optimizer is Adam as Megatron-LM's fused multi-tensor kernels run it: memory-bound, per
parameter it reads the fp32 gradient, master weight and two moments (16 B) plus the gradient
again for the global norm (4 B), and writes the master weight and moments (12 B) and the 2-byte
model copy: 20 B read, 14 B written. With the distributed optimizer each rank updates 1/dp of
its parameters (1/(dp x cp) with context parallelism).
"""

from __future__ import annotations

from typing import Callable

from echo_plan.layout.plan_layout import dp_group
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.pipeline import DpBucket
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind, OpKind, OpRecord, Phase, Stream
from echo_plan.cost.dp_comm import exchange

BUCKET_MIN_PARAMS = 40_000_000  # Megatron-LM DDP default bucket_size = max(40000000, 1000000 * dp)
BUCKET_PARAMS_PER_DP_RANK = 1_000_000
PARAM_BYTES = 2  # bf16/fp16 model weights
OPT_READ_BYTES_PER_PARAM = 20
OPT_WRITE_BYTES_PER_PARAM = 14

CommTime = Callable[[CollectiveKind, int, CommGroup], float]


def bucket_sizes(params: int, dp: int, overlap: bool) -> tuple[int, ...]:
    """Parameters per bucket of one chunk, in the order they are reduced."""
    if params <= 0:
        return ()
    if not overlap:
        return (params,)
    size = max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * dp)
    full, rest = divmod(params, size)
    return tuple([size] * full + ([rest] if rest else []))


def chunk_buckets(params: int, plan: PlanSpec, comm_time: CommTime, gb: int, overlap: bool, sharding: DataParallelSharding,
                  group: CommGroup | None = None, op_time=None, param_bytes: float = PARAM_BYTES) -> tuple[DpBucket, ...]:
    """The DP buckets of one chunk of ``params`` parameters (of this rank), with their times;
    ``gb`` bytes per gradient element, ``overlap``: reduced during the backward pass; ``sharding``:
    reduce-scattered and all-gathered when sharded (all-reduced whole, then all-gathered, where the sharding
    says ``reduce_all``: DeepSpeed's BF16_Optimizer), all-reduced when not. ``group``: the group that
    reduces them (default the data-parallel group; MoE experts: the expert one). ``param_bytes``:
    mean bytes per parameter of the all-gather (under 2 when FP8 weights are gathered)."""
    group = group if group is not None else dp_group(plan)
    if group.size <= 1 or params <= 0:
        return ()
    out = []
    expert = group.kind is GroupKind.EDP
    if plan.dp_comm.sparse:  # the reference sparsifiers exchange the whole gradient after backward

        ex = exchange(plan.dp_comm, params, group, plan.density, comm_time, op_time)
        return (DpBucket(params, ex.total_s, TaskKind.ALL_GATHER, expert=expert, sparse=ex),)
    made: dict[int, DpBucket] = {}  # buckets of one size are the same (immutable) bucket
    shard, replica = shard_groups(group, sharding)
    for n in bucket_sizes(params, group.size, overlap):
        b = made.get(n)
        if b is None:
            if sharding.sharded:
                reduce = (comm_time(CollectiveKind.ALL_REDUCE, n * gb, group) if sharding.reduce_all
                          else sharded_reduce_s(n, gb, shard, replica, comm_time))
                b = DpBucket(n, reduce, TaskKind.ALL_REDUCE if sharding.reduce_all else TaskKind.REDUCE_SCATTER,
                             comm_time(CollectiveKind.ALL_GATHER, int(n * param_bytes), shard), expert=expert)
            else:
                b = DpBucket(n, comm_time(CollectiveKind.ALL_REDUCE, n * gb, group), TaskKind.ALL_REDUCE,
                             expert=expert)
            made[n] = b
        out.append(b)
    return tuple(out)


def shard_groups(group: CommGroup, sharding: DataParallelSharding) -> tuple[CommGroup, CommGroup]:
    """The ranks one shard spans within the gradient-reducing ``group`` (its first ``degree`` ranks, the
    innermost: torchtitan's mesh puts dp_shard inside dp_replicate), and the replicas of a shard."""
    degree = sharding.expert_degree if group.kind is GroupKind.EDP else sharding.degree
    degree = max(1, min(degree, group.size)) if sharding.sharded else group.size
    shard = CommGroup(group.kind, size=degree, stride=group.stride, start=group.start)
    replica = CommGroup(group.kind, size=group.size // degree, stride=group.stride * degree, start=group.start)
    return shard, replica


def sharded_reduce_s(params: int, gb: int, shard: CommGroup, replica: CommGroup, comm_time: CommTime) -> float:
    """Reduce-scatter of ``params`` gradients (``gb`` bytes each) over the shard group, then (HSDP, a
    partial distributed optimizer) the all-reduce of the shard over its replicas."""
    t = comm_time(CollectiveKind.REDUCE_SCATTER, params * gb, shard) if shard.size > 1 else 0.0
    if replica.size > 1:
        t += comm_time(CollectiveKind.ALL_REDUCE, -(-params * gb // shard.size), replica)
    return t


def fsdp_units(units: list[tuple[int, int, float, float, bool, float]], gb: int, comm_time: CommTime,
               group: CommGroup, expert_group: CommGroup, sharding: DataParallelSharding,
               copy_time: Callable[[float, float], float] | None = None,
               host_copies: Callable[[float, float], tuple[float, float]] | None = None) -> tuple[DpBucket, ...]:
    """A chunk's FSDP units in backward order (replay/fsdp.py) from ``units`` in forward order, each (dense
    parameters, expert parameters, forward seconds, backward seconds, kept for backward, bytes per parameter
    its all-gather moves). A unit's reduce-scatter moves ``gb`` bytes per gradient, plus the replicas'
    all-reduce in HSDP. ``copy_time(bytes read, bytes written)``, FSDP2's runtime (stack
    ``fsdp_copy_kernels``): each gathered unit's copy-out (the gathered bytes read and written again as the
    unsharded parameters) and each reduced unit's copy-in (bf16 gradients read, written in the reduce dtype),
    both on the compute stream. ``host_copies(shard parameters, gradient bytes each)``, FSDP2 under CPUOffloadPolicy:
    (each unit's fp32 shard copied in from the host before its all-gather, its reduced gradient shard copied out
    after its reduce-scatter), on those collectives' streams."""
    shard, replica = shard_groups(group, sharding)
    eshard, ereplica = shard_groups(expert_group, sharding)
    made: dict[tuple, DpBucket] = {}
    out = []
    for key in units:
        b = made.get(key)
        if b is None:
            dense, experts, fwd, bwd, kept, pb = key
            gather = comm_time(CollectiveKind.ALL_GATHER, int(dense * pb), shard) if shard.size > 1 else 0.0
            reduce = sharded_reduce_s(dense, gb, shard, replica, comm_time)
            if experts:
                gather += comm_time(CollectiveKind.ALL_GATHER, int(experts * pb), eshard) if eshard.size > 1 else 0.0
                reduce += sharded_reduce_s(experts, gb, eshard, ereplica, comm_time)
            if host_copies is not None:
                copy_in, copy_out = host_copies(dense / shard.size + experts / eshard.size, float(gb))
                gather, reduce = gather + copy_in, reduce + copy_out
            out_s = in_s = 0.0
            if copy_time is not None and shard.size > 1:  # FSDP2: the gathered bytes out, the bf16 gradients in
                n = dense + experts
                out_s, in_s = copy_time(n * pb, n * pb), copy_time(2.0 * n, float(gb * n))
            b = made[key] = DpBucket(dense + experts, reduce, TaskKind.REDUCE_SCATTER, gather, fwd_share=fwd,
                                     bwd_share=bwd, kept=kept, copy_out_s=out_s, copy_in_s=in_s)
        out.append(b)
    return tuple(reversed(out))


def fsdp_copy_op(bytes_read: float, bytes_written: float) -> OpRecord:
    """One of FSDP2's copy kernels (all-gather copy-out, reduce-scatter copy-in) as a memory-bound op for the
    compute model."""
    return OpRecord(
        index=0, name="fsdp.copy", kind=OpKind.ELEMENTWISE, phase=Phase.BACKWARD, stream=Stream.COMPUTE,
        inputs=(), outputs=(), flops=0.0, bytes_read=float(bytes_read), bytes_written=float(bytes_written), deps=(),
        module="fsdp",
    )


def optimizer_shard_params(params: int, sharding: DataParallelSharding, expert_params: int = 0) -> int:
    """Parameters whose optimizer states this rank holds: its ``params`` dense and ``expert_params`` expert
    parameters, each over its shards."""
    return -(-params // sharding.optimizer_shards()) + -(-expert_params // sharding.optimizer_shards(expert=True))


def optimizer_op(params: int, sharding: DataParallelSharding, expert_params: int = 0) -> OpRecord:
    """The Adam step of ``params`` dense and ``expert_params`` expert parameters of this rank as one
    memory-bound op for the compute model (each on its shard of the optimizer states)."""
    n = optimizer_shard_params(params, sharding, expert_params)
    return OpRecord(
        index=0, name="optimizer.adam", kind=OpKind.ELEMENTWISE, phase=Phase.BACKWARD, stream=Stream.COMPUTE,
        inputs=(), outputs=(), flops=12.0 * n, bytes_read=OPT_READ_BYTES_PER_PARAM * n,
        bytes_written=OPT_WRITE_BYTES_PER_PARAM * n, deps=(), module="optimizer",
    )


def dp_exchange_summary(plan: PlanSpec, costs) -> dict | None:
    """Per step, on the pipeline rank whose exchange takes longest: the sparse method's selection,
    index exchange, value exchange and error-feedback seconds, and the bytes it moves."""
    if not plan.dp_comm.sparse:
        return None
    best = None
    for st in costs.stages:
        parts = [b.sparse for bs in st.buckets for b in bs if b.sparse is not None]
        total = sum(p.total_s for p in parts)
        if parts and (best is None or total > best[0]):
            best = (total, parts)
    if best is None:
        return None
    parts = best[1]
    return {"method": plan.dp_comm.value, "density": plan.density,
            "select_s": sum(p.select_s for p in parts), "index_exchange_s": sum(p.index_s for p in parts),
            "value_exchange_s": sum(p.value_s for p in parts), "error_feedback_s": sum(p.feedback_s for p in parts),
            "index_bytes": sum(p.index_bytes for p in parts), "value_bytes": sum(p.value_bytes for p in parts),
            "selected": sum(p.selected for p in parts), "exchanged_values": sum(p.union for p in parts)}
