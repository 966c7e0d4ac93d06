"""Peak memory of each pipeline stage's GPU: model states, activations and buffers.

* Parameters per rank from the ModelSpec: the stage's layers with their linears split over tp
  (norms and row-parallel biases replicated), the vocab-parallel embedding on the first stage,
  the output head on the last (with pp > 1 the last stage holds its own copy of a tied embedding,
  as Megatron-LM does).
* Weights, gradients and Adam states at the bytes per parameter Megatron-LM documents
  (``echo_plan/data/memory.yaml``); the optimizer states shard over dp with the distributed optimizer.
* Activations: the saved bytes of one layer (from the trace, or the closed form of Korthikanti et
  al. 2022 generalised to GQA, SwiGLU, fused attention and the stack's dropout and recompute
  modules) x layers on the stage x micro-batches in flight under the schedule, plus the embedding
  and loss stages' own saved bytes, plus with recomputation (full or selective) the recomputed
  part of one layer, live during that layer's backward.
* Weights, gradients (in the stack's gradient dtype, sharded too when the stack's distributed
  optimizer shards them; with DeepSpeed's BF16_Optimizer, ``gradient_buffers: deepspeed-bf16``, each
  weight's bf16 gradient too, which stays allocated between backward passes, and at the step's end the
  flattened fp32 copy its engine all-reduces, when that outgrows the activations) and optimizer states.
* FP8 or NVFP4 training (plan dtype fp8, fp4): each transformer layer's weights also live as quantised
  copies (Transformer Engine casts them on a step's first micro-batch and keeps them for the others: an
  FP8 weight and its transpose on Hopper, the weight alone on Blackwell, two block-scaled copies under
  MXFP8 and NVFP4; ``cost/weight_copies.py``); with the stack's ``fp8_param_gather`` /
  ``fp4_param_gather`` they replace the bf16 weight. Master weights, gradients and Adam states are
  unchanged. Quantised activations saved for backward come with the trace's saved bytes.
* Buffers: CUDA context, NCCL buffers per communicator, allocator fragmentation, and the loss's
  transient logits on the last stage (per loss kernel, stack ``cross_entropy``: the unfused loss's fp32
  copy; none for Transformer Engine's, which writes the gradient over the logits), and under
  torch.distributed.pipelining its receive buffers and kept outputs (``cost/pipeline_buffers.py``).
* Headroom: a plan fits when every GPU keeps ``headroom_bytes`` free below capacity
  (``--memory-headroom``; default a share of the GPU's memory, memory.yaml).

Micro-batches in flight (``cost/schedule_memory.py``), from each schedule's order of forward and backward passes:
GPipe runs all m forwards first (m in flight); 1F1B (Narayanan et al. 2021) lets stage i of p run
p - i - 1 warm-up forwards and one more before its first backward, so min(p - i, m); Megatron-LM's
interleaved schedule gives rank i (p - i - 1) x 2 + (v - 1) x p warm-up model-chunk forwards,
plus one, each chunk holding layers / v (capped at m x v chunk passes).

The schedules that split the backward (ZB-H1, ZB-V, DualPipe) are walked pass by pass over the
rank's action list (``layout/schedules_zb.py``): a forward adds its chunk's saved bytes; a whole
backward frees them; an input-gradient pass frees them but keeps what the deferred weight-gradient
pass reads (``retained``: the linears' inputs and the gradients of their outputs, measured from the
trace by ``layout/backward_split.py``) until that W runs. The peak of that walk is the rank's activations.
DualPipe's ranks hold two copies' stages (s and pp - 1 - s): twice the parameters, gradients and
optimizer states of a one-copy stage, as DeepSeek-V3's report states (section 3.2.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol

from echo_plan.files import safe_load
import yaml

from echo_plan.errors import FileFormatError
from echo_plan.cost.offload import host_share_bytes, offloaded_states
from echo_plan.cost.stage_memory import StageMemory
from echo_plan.cost.fsdp_memory import fsdp_states
from echo_plan.cost.pipeline_buffers import pipeline_runtime_bytes
from echo_plan.cost.weight_copies import layer_weight_extra_bytes
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.model import ModelSpec, PositionEmbedding
from echo_plan.specs.moe import DENSE, LayerKind
from echo_plan.specs.plan import PlanSpec, Recompute, Schedule
from echo_plan.specs.software import CrossEntropy, CudaAllocator, SoftwareSpec
from echo_plan.cost.activation_memory import (embedding_activation_bytes, layer_activation_bytes,
                                               output_activation_bytes)
from echo_plan.trace.records import LayerTrace
from echo_plan.layout.backward_split import retained_bytes, split_backward
from echo_plan.layout.layer_mix import (all_stage_kind_counts, layer_params_per_rank as mixed, output_rank,
                                        plan_kinds, stage_kind_counts)
from echo_plan.layout.schedules_zb import split_layout
from echo_plan.layout.plan_layout import PlanLayout
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.cost.schedule_memory import (held_profile, inflight_chunk_passes, inflight_on_chunk,
                                            profile_microbatches, walk_stage)

GiB = 2**30


class ModelTracesLike(Protocol):
    """What the memory model reads from the tracer's ModelTraces."""

    block: LayerTrace
    embedding: LayerTrace
    output: LayerTrace


@dataclass(frozen=True)
class MemoryConstants:
    bytes_per_param: Mapping[DType, tuple[int, int, int]]  # weights, gradients, optimizer
    cuda_context_bytes: int
    nccl_per_communicator_bytes: int
    fragmentation_fraction: Mapping[str, float]  # per CudaAllocator value: reserved-but-free share of activations
    logits_transient_bytes_per_element: Mapping[str, float]  # per CrossEntropy value
    default_headroom_fraction: float
    loss_parallel_transient_bytes_per_element: float  # CrossEntropy.TORCH with TP > 1

    def loss_transient_bytes_per_logit(self, plan: PlanSpec, kernel: CrossEntropy) -> float:
        """What the loss holds per logit at its peak beyond what it saves (memory.yaml)."""
        if kernel is CrossEntropy.TORCH and plan.tp > 1:
            return self.loss_parallel_transient_bytes_per_element
        return self.logits_transient_bytes_per_element[kernel.value]


def load_memory_constants(text: str | None = None, origin: str = "memory.yaml",
                          packaged: bool = False) -> MemoryConstants:
    """Parse memory-model constants; the packaged file is parsed once (it is read-only package data)."""
    if text is None:
        return _packaged_constants()
    try:
        raw = safe_load(text, packaged=packaged)
        bpp = {DType(k): (int(v["weights"]), int(v["gradients"]), int(v["optimizer"]))
               for k, v in raw["bytes_per_param"].items()}
        b = raw["buffers"]
        return MemoryConstants(
            bytes_per_param=MappingProxyType(bpp),
            cuda_context_bytes=int(float(b["cuda_context_GiB"]) * GiB),
            nccl_per_communicator_bytes=int(float(b["nccl_per_communicator_GiB"]) * GiB),
            fragmentation_fraction=MappingProxyType(_per_setting(
                b["fragmentation_fraction"], CudaAllocator, "fragmentation_fraction", "a fraction in [0, 1)",
                lambda v: 0.0 <= v < 1.0)),
            logits_transient_bytes_per_element=MappingProxyType(_per_setting(
                b["logits_transient_bytes_per_element"], CrossEntropy, "logits_transient_bytes_per_element",
                "bytes >= 0", lambda v: v >= 0.0, one_for_all=True)),
            default_headroom_fraction=float(raw["default_headroom_fraction"]),
            loss_parallel_transient_bytes_per_element=_non_negative(
                b["loss_parallel_transient_bytes_per_element"], "loss_parallel_transient_bytes_per_element"),
        )
    except (KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError) as exc:
        raise FileFormatError(origin, f"invalid memory-model constants: {exc!r}") from None


def _non_negative(raw: Any, field: str) -> float:
    value = float(raw)
    if not value >= 0.0:
        raise ValueError(f"{field} needs bytes >= 0; got {raw!r}")
    return value


def _per_setting(raw: Any, enum: Any, field: str, want: str, ok: Callable[[float], bool],
                 one_for_all: bool = False) -> dict[str, float]:
    """memory.yaml's ``field``: a number for every value of ``enum`` and no other, each ``want`` (``ok``);
    ``one_for_all``: a single number stands for every value."""
    valid = [e.value for e in enum]
    if one_for_all and not isinstance(raw, dict):
        return {v: float(raw) for v in valid}
    got = {str(k): float(v) for k, v in dict(raw).items()}
    if set(got) != set(valid) or not all(ok(v) for v in got.values()):
        raise ValueError(f"{field} needs {want} for each of {', '.join(valid)} and nothing else; got {got}")
    return got


@lru_cache(maxsize=1)
def _packaged_constants() -> MemoryConstants:
    text = (resources.files("echo_plan") / "data" / "memory.yaml").read_text(encoding="utf-8")
    return load_memory_constants(text, "echo_plan/data/memory.yaml", packaged=True)


# -- parameters ---------------------------------------------------------------------------------

def layer_params_per_rank(model: ModelSpec, tp: int) -> int:
    """Parameters of one transformer block held by one tensor-parallel rank."""
    h, f = model.hidden_size, model.ffn_size
    kv = model.kv_heads * model.head_dim
    fc1_out = 2 * f if model.activation.gated else f
    sharded = h * (h + 2 * kv) + h * h  # QKV (column parallel) and output projection (row parallel)
    sharded += h * fc1_out + f * h
    if model.has_bias:
        sharded += (h + 2 * kv) + fc1_out  # column-parallel biases are split
    replicated = (2 * h if model.has_bias else 0) + 2 * model.norm_params  # row-parallel biases, two norms
    return math.ceil(sharded / tp) + replicated


def stage_params(model: ModelSpec, plan: PlanSpec, stage: int) -> int:
    return sum(stage_params_split(model, plan, stage))


def stage_params_split(model: ModelSpec, plan: PlanSpec, stage: int,
                       counts: Mapping[LayerKind, int] | None = None) -> tuple[int, int]:
    """(parameters sharded like dense ones, routed-expert parameters) of pipeline rank ``stage``;
    ``counts``: its layers of each kind when the caller has them (layer_mix.stage_kind_counts)."""

    n = experts = 0
    counts = counts if counts is not None else stage_kind_counts(model, plan, stage)
    for kind, count in counts.items():
        if kind.moe:
            dense, expert = mixed(model, plan, kind)
            n, experts = n + count * dense, experts + count * expert
        else:
            n += count * layer_params_per_rank(model, plan.tp)
    word = math.ceil(model.vocab_size * model.hidden_size / plan.tp)  # vocab-parallel
    if stage == 0:
        n += word
        if model.position_embedding is PositionEmbedding.LEARNED:
            n += model.seq_length * model.hidden_size
    if stage == output_rank(plan):
        n += model.norm_params
        if not model.tied_embeddings or stage != 0:  # tied: one copy where the embedding is on the same rank
            n += word
        if model.mtp_layers:
            dense, expert = mixed(model, plan, model.mtp_kind)
            n += model.mtp_layers * (dense + math.ceil(2 * model.hidden_size ** 2 / plan.tp) + 2 * model.norm_params)
            experts += model.mtp_layers * expert
    return n, experts


def fp8_weight_bytes(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, stage: int, bf16_bytes: float) -> float:
    """What FP8 or NVFP4 training changes in pipeline rank ``stage``'s weight memory (0 for bf16): the quantised
    copies of its transformer layers' weights, less their bf16 copies where the copies are the parameters
    (``cost/weight_copies.py``)."""
    if not plan.dtype.low_precision:
        return 0.0

    layer = sum(count * sum(mixed(model, plan, kind)) for kind, count in stage_kind_counts(model, plan, stage).items())
    if stage == output_rank(plan) and model.mtp_layers:
        layer += model.mtp_layers * sum(mixed(model, plan, model.mtp_kind))
    return layer * layer_weight_extra_bytes(plan.dtype, stack, bf16_bytes)


# -- assembly -----------------------------------------------------------------------------------

def stage_memory(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec, traces: ModelTracesLike,
                 stack: SoftwareSpec, headroom_bytes: int | None = None,
                 layout: PlanLayout | None = None) -> tuple[StageMemory, ...]:
    """Per-stage peak memory with activations from the traces' saved bytes (one micro-batch each);
    ``layout``: the plan's layout (layout/plan_layout.py), derived here when not given."""
    retained = None
    if plan.schedule.split_backward:

        def keep(trace) -> int:
            return retained_bytes(trace, split_backward(trace)[1])
        blocks = getattr(traces, "blocks", ()) or ((DENSE, traces.block),)
        retained = ({kind: keep(t) for kind, t in blocks}, keep(traces.embedding), keep(traces.output))
    saved: dict[LayerKind, tuple[int, int]] = {}
    for kind, block in (getattr(traces, "blocks", ()) or ((DENSE, traces.block),)):
        full_layer = block.saved_bytes_by_mode.get(Recompute.NONE.value)
        if full_layer is None:
            full_layer = layer_activation_bytes(model, plan, Recompute.NONE, stack, kind)
        saved[kind] = (block.saved_bytes, full_layer)
    return _assemble(model, plan, cluster, stack, saved,
                     traces.embedding.saved_bytes, traces.output.saved_bytes, headroom_bytes=headroom_bytes,
                     retained=retained, layout=layout if layout is not None else PlanLayout.of(model, plan, stack))


RETAINED = "retained"  # activation_scale's key for what a split backward keeps from B until W


def estimate_memory(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec, stack: SoftwareSpec,
                    headroom_bytes: int | None = None, consts: MemoryConstants | None = None,
                    activation_scale=None) -> tuple[StageMemory, ...]:
    """Per-stage peak memory without a trace (closed-form activations), for fast pruning.
    ``activation_scale(kind, recompute)``: what multiplies a layer's closed form to give its traced bytes
    (search/activation_scale.py measures it for low-precision plans; recompute RETAINED: what a split backward
    keeps for W); None: 1."""
    def scaled(kind, closed, mode):
        return closed if activation_scale is None else int(closed * activation_scale(kind.traced, mode))

    without = {kind: layer_activation_bytes(model, plan, Recompute.NONE, stack, kind.traced)
               for kind in plan_kinds(model, plan)}  # each kind's closed form without recompute, once
    saved = {}
    for kind, none in without.items():
        mode = Recompute.FULL if kind.recomputed else plan.recompute
        part = none if mode is Recompute.NONE else layer_activation_bytes(model, plan, mode, stack, kind.traced)
        saved[kind] = (scaled(kind, part, mode), scaled(kind, none, Recompute.NONE))
    retained = None
    if plan.schedule.split_backward:
        # Judgement for the estimate: W reads every linear's input and its output's gradient, about
        # what a layer saves without recomputation (the traced llama3-8b and mixtral-8x7b layers:
        # 0.98-1.02 of it); the embedding keeps its output gradient, the output stage half its saved bytes.
        e = plan.dtype.nbytes
        rep = 1.0 / plan.tp if plan.sequence_parallel else 1.0
        retained = ({k: scaled(k, none, RETAINED) for k, none in without.items()},  # traced ratio if given
                    int(e * model.seq_length * plan.micro_batch_size * model.hidden_size * rep),
                    output_activation_bytes(model, plan, stack) // 2)
    return _assemble(model, plan, cluster, stack, saved,
                     embedding_activation_bytes(model, plan, stack),
                     output_activation_bytes(model, plan, stack), consts=consts, headroom_bytes=headroom_bytes,
                     retained=retained)


def default_headroom_bytes(cluster: ClusterSpec, consts: MemoryConstants | None = None) -> int:
    """The headroom kept when the user gives none: a fraction of the GPU's memory (memory.yaml)."""
    c = consts or load_memory_constants()
    return int(c.default_headroom_fraction * cluster.gpu.hbm_GiB * GiB)


def _assemble(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec, stack: SoftwareSpec,
              saved: Mapping[LayerKind, tuple[int, int]], embed_saved: int, output_saved: int,
              consts: MemoryConstants | None = None, headroom_bytes: int | None = None,
              retained=None, layout: PlanLayout | None = None) -> tuple[StageMemory, ...]:
    """``saved``: per layer kind, (bytes one layer saves under the plan's recompute, without recompute);
    ``retained``: for schedules that split the backward, (per kind, embedding, output) bytes kept
    from an input-gradient pass until its weight-gradient pass. ``layout``: the plan's layout, or None for
    the estimate of a search's candidates, which derives only the parts it reads."""

    stack = stack.as_run(plan, cluster.gpu.sm_arch)  # as simulate has it: FP8 parameters only with the distributed
    # optimizer, FP8 transposes only where the GPU's FP8 GEMMs take the TN layout alone
    c = consts or load_memory_constants()
    w_b, _, o_b = c.bytes_per_param[plan.param_dtype]
    if stack.optimizer_state_bytes is not None:
        o_b = stack.optimizer_state_bytes
    g_b = stack.grad_bytes(plan.param_dtype)
    sharding = layout.sharding if layout is not None else DataParallelSharding.of(plan, stack)  # dp x cp ranks
    shard, eshard = sharding.optimizer_shards(), sharding.optimizer_shards(expert=True)
    gshard, egshard = sharding.gradient_shards(), sharding.gradient_shards(expert=True)
    capacity = int(cluster.gpu.hbm_GiB * GiB)
    headroom = default_headroom_bytes(cluster, c) if headroom_bytes is None else headroom_bytes
    v = plan.virtual_stages
    comms = sum(1 for n in (plan.tp, plan.cp, plan.grad_dp) if n > 1) + (2 if plan.pp > 1 else 0)  # PP: two neighbours
    comms += sum(1 for n in (plan.ep, plan.edp) if n > 1) if model.is_moe else 0
    first = next(iter(saved.values()))
    out: list[StageMemory] = []
    dual = plan.schedule is Schedule.DUALPIPE
    sched = None
    if plan.schedule.split_backward:

        sched = split_layout(plan.schedule, plan.pp, plan.virtual_stages)
        profile = held_profile(plan.schedule, plan.pp, profile_microbatches(plan.schedule, plan.pp,
                                                                           plan.num_microbatches), plan.virtual_stages)
    stage_counts = layout.kinds_per_rank if layout is not None else all_stage_kind_counts(model, plan)
    split_of: dict[tuple, tuple[int, int]] = {}  # stages with the same layers and ends hold the same parameters

    def params_split(stage: int) -> tuple[int, int]:
        counts = stage_counts[stage]
        key = (tuple(counts.items()), stage == 0, stage == output_rank(plan))
        hit = split_of.get(key)
        if hit is None:
            hit = split_of[key] = stage_params_split(model, plan, stage, counts)
        return hit

    walk_cache: dict = {}
    for i in range(plan.pp):
        counts = stage_counts[i]
        dense, experts = params_split(i)
        if dual:  # the reverse direction's copy of stage pp - 1 - i
            d2, e2 = params_split(plan.pp - 1 - i)
            dense, experts = dense + d2, experts + e2
        params = dense + experts
        optimizer = dense * o_b / shard + experts * o_b / eshard
        grads = buffer = dense * g_b / gshard + experts * g_b / egshard  # the (fp32) gradient buffer
        if sharding.bf16_buffers:  # DeepSpeed's BF16_Optimizer: each weight's bf16 gradient beside the buffer
            grads += params * w_b
        weights = params * w_b + fp8_weight_bytes(model, plan, stack, i, w_b)
        if sharding.parameters:
            weights, grads, optimizer = fsdp_states(model, plan, stack, sharding, counts, dense, experts, w_b, g_b, o_b)
        host = 0.0
        if plan.offload_optimizer:  # the optimizer shard (master weights, moments), or a share, in CPU memory
            grads, optimizer, host = offloaded_states(plan, stack, optimizer, grads, buffer,
                                                      dense / shard + experts / eshard)
        if sched is not None:
            act = walk_stage(model, plan, sched, profile[i], i, saved, first, retained, embed_saved, output_saved,
                             walk_cache)
        else:
            chunks_held = inflight_chunk_passes(plan, i)
            act = sum(saved.get(k, first)[0] * n for k, n in counts.items()) / v * chunks_held
        if plan.recompute is not Recompute.NONE or plan.recompute_layers:  # a layer's recomputed part, live in its backward
            act += max(max(0, full - part) for part, full in saved.values())
        if i == 0 and sched is None:
            act += embed_saved * inflight_on_chunk(plan, i, 0)
        transient = 0.0
        if i == output_rank(plan) or (dual and i == 0):
            mtp = model.mtp_layers * (saved.get(model.mtp_kind, first)[0] + output_saved) if model.mtp_layers else 0
            if sched is None:
                act += (output_saved + mtp) * inflight_on_chunk(plan, i, v - 1)
            transient = (c.loss_transient_bytes_per_logit(plan, stack.cross_entropy)
                         * (model.seq_length // plan.cp) * plan.micro_batch_size * model.vocab_size / plan.tp)
        transient += pipeline_runtime_bytes(model, plan, stack, i)
        outside = c.cuda_context_bytes + comms * c.nccl_per_communicator_bytes  # not the caching allocator's
        frag = c.fragmentation_fraction[stack.cuda_allocator.value]
        cached_extra = 0.0
        if sharding.bf16_buffers:
            # at the step's end, the activations freed, DeepSpeed's engine all-reduces a flattened copy of the fp32
            # gradient buffer (engine.py allreduce_bucket: flatten, all_reduce, copy back): the stage's peak if larger;
            # one block the size of the buffer, which the activations' freed (cached) blocks cannot serve
            raised = max(0.0, buffer - act * (1 + frag) - transient)
            transient += raised
            cached_extra = buffer - raised
        buffers = outside + frag * act + transient
        out.append(StageMemory(
            stage=i,
            weights_bytes=int(weights),
            gradients_bytes=int(grads),
            optimizer_bytes=int(optimizer),
            activations_bytes=int(act),
            buffers_bytes=int(buffers),
            capacity_bytes=capacity,
            headroom_bytes=headroom,
            outside_allocator_bytes=int(outside),
            cached_extra_bytes=int(cached_extra),
            host_bytes=int(host),
            host_capacity_bytes=int(host_share_bytes(cluster)) if plan.offload_optimizer else 0,
        ))
    return tuple(out)
