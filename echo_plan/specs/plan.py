"""PlanSpec: how the job is laid out (parallel degrees, batch, schedule, memory savers)."""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from pydantic import Field, model_validator

from echo_plan import limits as L
from echo_plan.errors import SpecError
from echo_plan.specs.base import Spec
from echo_plan.specs.cluster import DType


class Recompute(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"  # Korthikanti et al. 2022: recompute only the attention core
    FULL = "full"  # every layer re-runs its forward during backward


class Schedule(str, Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"  # Qi et al. 2024: 1F1B with backward split into B and W, W deferred (1F1B's memory)
    ZB_V = "zb-v"  # Qi et al. 2024: two chunks per rank in a V, B and W split
    DUALPIPE = "dualpipe"  # DeepSeek-V3 (arXiv 2412.19437): two directions, overlapped F&B pairs

    @property
    def split_backward(self) -> bool:
        """The schedule runs the input and weight gradients as separate passes."""
        return self in (Schedule.ZB_H1, Schedule.ZB_V, Schedule.DUALPIPE)


def schedule_rule(schedule: Schedule, pp: int, virtual_stages: int, microbatches: int) -> str | None:
    """Why ``schedule`` cannot run this shape (one line), or None when it can.

    ZB-H1 is 1F1B's order (no virtual stages). ZB-V puts exactly two chunks on every rank in a V
    (virtual_stages 2; pp >= 2 so the V has two arms). DualPipe (DeepSeek's reference
    implementation, ``dualpipe.py``) pairs rank s with rank pp - 1 - s and feeds half the
    micro-batches from each end: pp even, micro-batches even and at least 2 x pp; its two chunks
    are two copies of the model, so the plan's own layers are split over pp stages (virtual_stages 1)."""
    if schedule is Schedule.ZB_H1 and virtual_stages != 1:
        return f"zb-h1 is 1F1B's order without virtual stages (virtual_stages {virtual_stages}); use zb-v"
    if schedule is Schedule.ZB_V:
        if virtual_stages != 2:
            return f"zb-v runs exactly two chunks per rank (virtual_stages 2, not {virtual_stages})"
        if pp < 2:
            return "zb-v needs pp >= 2 (a V over the pipeline ranks)"
    if schedule is Schedule.DUALPIPE:
        if virtual_stages != 1:
            return (f"dualpipe holds two copies of the model's stages, not virtual stages "
                    f"(virtual_stages {virtual_stages})")
        if pp < 2 or pp % 2:
            return f"dualpipe needs an even number of pipeline stages (pp {pp})"
        if microbatches % 2 or microbatches < 2 * pp:
            return (f"dualpipe needs an even number of micro-batches, at least 2 x pp = {2 * pp} "
                    f"(got {microbatches})")
    return None


class DpComm(str, Enum):
    """How data-parallel gradients are exchanged (``cost/dp_comm.py``; docs/sparsification.md)."""

    DENSE = "dense"  # all-reduce (or reduce-scatter with the distributed optimizer)
    TOPK = "topk"  # local Top-k, all-gather of indices, union, all-reduce of the union's values
    CLTK = "cltk"  # cyclic local Top-k: a rotating leader's indices broadcast, values all-reduced
    HARD_THRESHOLD = "hard-threshold"  # one threshold pass over the whole gradient, no density control
    EXDYNA = "exdyna"  # threshold selection inside each worker's own partition (Yoon and Oh 2024)

    @property
    def sparse(self) -> bool:
        return self is not DpComm.DENSE


class Sharding(str, Enum):
    """How the data-parallel group shards a rank's training state (ZeRO's stages; layout/sharding.py)."""

    NONE = "none"  # every data-parallel rank holds all its state (DDP)
    OPTIMIZER = "optimizer"  # master weights and Adam moments (ZeRO-1, Megatron's distributed optimizer)
    GRADIENTS = "gradients"  # the gradient buffer too (ZeRO-2)
    PARAMETERS = "parameters"  # the parameters too, gathered block by block when used (ZeRO-3, FSDP full shard)


TRAINING_DTYPES = (DType.BF16, DType.FP16, DType.FP8, DType.FP4)
FP8_MIN_SM_ARCH = 89  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) onwards (NVIDIA Transformer Engine docs)
FP4_MIN_SM_ARCH = 100  # NVFP4 tensor cores: Blackwell (sm100) onwards (Transformer Engine's NVFP4BlockScaling)


class PlanSpec(Spec):
    tp: int = Field(default=1, gt=0, le=L.MAX_GPUS, description="tensor-parallel degree")
    pp: int = Field(default=1, gt=0, le=L.MAX_GPUS, description="pipeline-parallel degree")
    dp: int = Field(default=1, gt=0, le=L.MAX_GPUS, description="data-parallel degree")
    cp: int = Field(default=1, gt=0, le=L.MAX_GPUS,
                    description="context-parallel degree: each rank holds 2 of the sequence's 2 x cp chunks")
    micro_batch_size: int = Field(default=1, gt=0, le=L.MAX_GLOBAL_BATCH)
    global_batch_size: int = Field(default=1, gt=0, le=L.MAX_GLOBAL_BATCH)
    virtual_stages: int = Field(default=1, gt=0, le=L.MAX_LAYERS,
                                description="model chunks per pipeline rank (interleaving)")
    schedule: Schedule = Schedule.ONE_F_ONE_B
    recompute: Recompute = Recompute.NONE
    recompute_layers: int = Field(
        default=0, ge=0, le=L.MAX_LAYERS,
        description="full recompute of the first N layers of each model chunk, the others as `recompute` says "
                    "(Megatron-Core's --recompute-method block --recompute-num-layers N; torchtitan's layer "
                    "checkpointing); 0: none")
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    dtype: DType = DType.BF16
    layer_split: tuple[int, ...] | None = Field(
        default=None, description="layers per pipeline stage when uneven; defaults to an even split"
    )
    ep: int = Field(default=1, gt=0, le=L.MAX_GPUS, description="expert-parallel degree (MoE models)")
    etp: int | None = Field(default=None, gt=0, le=L.MAX_GPUS,
                            description="expert tensor-parallel degree; None: tp (Megatron-Core's default)")
    expert_imbalance: float = Field(default=1.0, ge=1.0, le=1024.0,
                                    description="tokens of the busiest expert over the balanced mean")
    dp_comm: DpComm = DpComm.DENSE
    density: float = Field(default=1.0, gt=0.0, le=1.0,
                           description="share of gradient elements a sparse dp_comm exchanges, in (0, 1]")
    sharding: Sharding | None = Field(
        default=None, description="data-parallel sharding; None: from distributed_optimizer and the stack's "
                                  "optimizer_sharding (distributed_optimizer is the name of 'optimizer' and up)")
    shard_degree: int | None = Field(
        default=None, gt=0, le=L.MAX_GPUS,
        description="ranks a shard group spans (HSDP: shard within groups of N, replicate across dp x cp / N); "
                    "None: the whole data-parallel group")
    reshard_after_forward: bool | None = Field(
        default=None, description="parameters sharding: free a block's gathered parameters after its forward and "
                                  "gather them again for its backward (FSDP's reshard_after_forward); None: "
                                  "torchtitan's default policy, true without a pipeline and false with one")
    offload_optimizer: bool = Field(
        default=False, description="keep the optimizer states in CPU memory and run the optimizer step on the CPU "
                                   "(Megatron-Core's --optimizer-cpu-offload, DeepSpeed's offload_optimizer); needs "
                                   "a sharded optimizer and a stack and cluster that say how (cost/offload.py)")
    offload_fraction: float = Field(
        default=1.0, gt=0.0, le=1.0, description="offload_optimizer: the share of the rank's optimizer shard moved "
                                                 "to the CPU, the rest stepped on the GPU at the same time "
                                                 "(Megatron-Core's --optimizer-offload-fraction)")

    @model_validator(mode="after")
    def _rules(self) -> "PlanSpec":
        if self.dtype not in TRAINING_DTYPES:
            raise ValueError(f"dtype must be bf16, fp16, fp8 or fp4 for training, not {self.dtype.value}")
        if self.virtual_stages > 1 and self.schedule is Schedule.ONE_F_ONE_B:
            object.__setattr__(self, "schedule", Schedule.INTERLEAVED)
        if self.schedule is Schedule.ZB_V and self.virtual_stages == 1:
            object.__setattr__(self, "virtual_stages", 2)  # ZB-V is two chunks per rank by definition
        if self.schedule is Schedule.INTERLEAVED and self.virtual_stages == 1 and self.pp > 1:
            raise ValueError("the interleaved schedule needs virtual_stages > 1")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ValueError(
                f"global_batch_size {self.global_batch_size} must be divisible by "
                f"dp x micro_batch_size = {self.dp} x {self.micro_batch_size}"
            )
        if self.num_microbatches > L.MAX_MICROBATCHES:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is {self.num_microbatches:,} micro-batches per step "
                f"(dp {self.dp} x micro-batch {self.micro_batch_size}); at most {L.MAX_MICROBATCHES:,}: "
                f"use a smaller global batch or a larger micro-batch"
            )
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.dp_comm is DpComm.DENSE and self.density != 1.0:
            raise ValueError(f"density {self.density} needs a sparse dp_comm (topk, cltk, hard-threshold or exdyna)")
        self._sharding_rules()
        if self.recompute_layers and self.recompute is Recompute.FULL:
            raise ValueError(f"recompute_layers {self.recompute_layers} with recompute full: full recomputes every "
                             "layer already; use recompute none or selective for the other layers")
        if self.dp_comm.sparse and self.distributed_optimizer:
            raise ValueError(f"dp_comm {self.dp_comm.value} exchanges sparse whole-gradient values, which the "
                             "distributed optimizer's reduce-scatter into dense shards cannot take: use dp_comm "
                             "dense with the distributed optimizer, or no distributed optimizer")
        if (self.tp * self.cp * self.dp) % (self.ep * self.expert_tp):
            raise ValueError(
                f"ep x etp = {self.ep} x {self.expert_tp} must divide tp x cp x dp = {self.tp} x {self.cp} x {self.dp} (the GPUs of "
                f"one pipeline stage; Megatron-Core's expert data-parallel size is their quotient)")
        if self.world_size > L.MAX_GPUS:
            raise ValueError(f"tp x cp x pp x dp = {self.world_size:,} GPUs; at most {L.MAX_GPUS:,}")
        return self

    def _sharding_rules(self) -> None:
        if self.sharding is not None:
            if self.sharding is Sharding.NONE and self.distributed_optimizer:
                raise ValueError("sharding none contradicts distributed_optimizer (the name of sharding optimizer): "
                                 "give one of them")
            object.__setattr__(self, "distributed_optimizer", self.sharding is not Sharding.NONE)
        if self.shard_degree is not None:
            if not self.distributed_optimizer:
                raise ValueError(f"shard_degree {self.shard_degree} needs sharding optimizer, gradients or parameters")
            if self.grad_dp % self.shard_degree:
                valid = [d for d in range(1, self.grad_dp + 1) if self.grad_dp % d == 0]
                raise ValueError(f"shard_degree {self.shard_degree} must divide dp x cp = {self.grad_dp}; valid: "
                                 f"{', '.join(map(str, valid))}")
        if self.offload_fraction != 1.0 and not self.offload_optimizer:
            raise ValueError(f"offload_fraction {self.offload_fraction:g} needs offload_optimizer")
        if self.offload_optimizer and not self.distributed_optimizer:
            raise ValueError("offload_optimizer moves each rank's optimizer shard to the CPU: it needs sharding "
                             "optimizer, gradients or parameters (--distributed-optimizer); Megatron-Core and "
                             "DeepSpeed offload only a sharded optimizer")
        if self.sharding is Sharding.PARAMETERS and self.schedule.split_backward:
            raise ValueError(f"sharding parameters gathers each block for its backward, which the {self.schedule.value} "
                             "schedule splits into passes run apart: use gpipe, 1f1b or interleaved")

    @property
    def reshards_after_forward(self) -> bool:
        """Whether parameters sharding gathers a block again for its backward (torchtitan's default policy:
        yes without a pipeline; with one the stage keeps its gathered parameters for all micro-batches)."""
        return self.pp == 1 if self.reshard_after_forward is None else self.reshard_after_forward

    @property
    def shard_group_size(self) -> int:
        """Ranks one shard of the data-parallel state spans (the whole dp x cp group unless HSDP)."""
        return self.shard_degree or self.grad_dp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def grad_dp(self) -> int:
        """The data-parallel gradient group: dp x cp (Megatron-Core reduces gradients over the
        data-and-context-parallel group, as CP ranks hold the same weights)."""
        return self.dp * self.cp

    @property
    def stage_ranks(self) -> int:
        """GPUs of one pipeline stage: tp x cp x dp (Megatron-Core's rank order tp-cp-dp-pp)."""
        return self.tp * self.cp * self.dp

    @property
    def param_dtype(self) -> DType:
        """The dtype of weights, activations and gradients: bf16 under fp8 and fp4 (FP8/NVFP4 is for the GEMMs
        only, as Transformer Engine runs it: bf16 master flow, casts at each linear layer)."""
        return DType.BF16 if self.dtype.low_precision else self.dtype

    @property
    def expert_tp(self) -> int:
        return int(self.etp or self.tp)

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: the GPUs of a pipeline stage over ep x etp (Megatron-Core)."""
        return self.tp * self.cp * self.dp // (self.ep * self.expert_tp)

    @property
    def is_expert_parallel(self) -> bool:
        return self.ep > 1 or self.expert_tp != self.tp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers on each pipeline stage (all its virtual chunks together)."""
        if self.layer_split is not None and len(self.layer_split) == self.pp * self.virtual_stages > self.pp:
            per_vs = self.layer_split
            return tuple(sum(per_vs[c * self.pp + r] for c in range(self.virtual_stages)) for r in range(self.pp))
        if self.layer_split is not None:
            return self.layer_split
        base = num_layers // self.pp
        return tuple([base] * self.pp)

    def virtual_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers on each virtual stage, in model order (virtual stage c x pp + r is chunk c of rank r).

        ``layer_split`` gives either one count per pipeline stage (split evenly over its chunks) or one
        per virtual stage (uneven interleaving, as Llama 3 405B's 126 layers on 16 stages)."""
        nvs = self.pp * self.virtual_stages
        if self.layer_split is not None and len(self.layer_split) == nvs:
            return self.layer_split
        split = self.stage_layers(num_layers)
        return tuple(split[vs % self.pp] // self.virtual_stages for vs in range(nvs))

    def short(self) -> str:
        """A compact human label, e.g. ``tp8 pp8 dp16 mbs1 vpp2 sel sp dopt``."""
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + [
            f"pp{self.pp}", f"dp{self.dp}", f"mbs{self.micro_batch_size}"]
        if self.virtual_stages > 1:
            parts.append(f"vpp{self.virtual_stages}")
        if self.schedule in (Schedule.GPIPE, Schedule.ZB_H1, Schedule.ZB_V, Schedule.DUALPIPE):
            parts.append(self.schedule.value)
        if self.recompute is not Recompute.NONE:
            parts.append({Recompute.SELECTIVE: "sel-recompute", Recompute.FULL: "full-recompute"}[self.recompute])
        if self.recompute_layers:
            parts.append(f"recompute{self.recompute_layers}L")
        if self.is_expert_parallel:
            parts.append(f"ep{self.ep}" + (f" etp{self.expert_tp}" if self.expert_tp != self.tp else ""))
        if self.expert_imbalance > 1.0:
            parts.append(f"imb{self.expert_imbalance:g}")
        if self.dp_comm.sparse:
            parts.append(f"{self.dp_comm.value}@{self.density:g}")
        if self.dtype.low_precision:
            parts.append(self.dtype.value)
        if self.sequence_parallel:
            parts.append("sp")
        return " ".join(parts + self.sharding_parts())

    def sharding_parts(self) -> list[str]:
        """The data-parallel sharding in words for a label (``short`` and simulate's header)."""
        parts = []
        if self.sharding in (Sharding.GRADIENTS, Sharding.PARAMETERS):
            parts.append({Sharding.GRADIENTS: "zero2", Sharding.PARAMETERS: "fsdp"}[self.sharding])
        elif self.distributed_optimizer:
            parts.append("dist-opt")
        if self.shard_degree is not None and self.shard_degree != self.grad_dp:
            parts.append(f"shard{self.shard_degree}")
        if self.sharding is Sharding.PARAMETERS and self.reshard_after_forward is not None \
                and self.reshard_after_forward != (self.pp == 1):
            parts.append("reshard" if self.reshard_after_forward else "keep-fwd")
        if self.offload_optimizer:
            parts.append("opt-offload" + (f"{self.offload_fraction:g}" if self.offload_fraction != 1.0 else ""))
        return parts


def balanced_split(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage when ``pp`` does not divide them: as even as possible, the shorter stages first
    the first and last (they also hold the embedding and the loss, as Megatron-Core's
    ``account_for_embedding/loss_in_pipeline_split`` intends), then from the end backwards."""
    if pp < 1 or num_layers < pp:
        raise SpecError("pp", pp, f"at most num_layers {num_layers} stages")
    base = -(-num_layers // pp)
    short = base * pp - num_layers
    order = [0, pp - 1] + list(range(pp - 2, 0, -1)) if pp > 1 else [0]
    split = [base] * pp
    for i in order[:short]:
        split[i] -= 1
    return tuple(split)


def every_nth_layer(chunk_layers: Iterable[int], n: int) -> int | None:
    """``recompute_layers`` of checkpointing every n-th layer (torchtitan's layer checkpointing, a search space's
    "1/n"): each chunk's layers / n, or None where the chunks differ in length or n divides them not (a plan
    recomputes one count of every chunk)."""
    sizes = set(chunk_layers)
    if len(sizes) != 1 or n < 1 or next(iter(sizes)) % n:
        return None
    return next(iter(sizes)) // n
