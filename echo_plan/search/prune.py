"""Checking every candidate of a space before any simulation, and counting what is pruned and why.

Rules run in a fixed order and a candidate is counted under the first one it breaks, so the
counts add up to the size of the space. Cheap arithmetic rules come first; the memory estimate
(``echo_plan.cost.memory.estimate_memory``) runs only on candidates that pass all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.cost.stage_memory import StageMemory
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import (balanced_split, every_nth_layer, PlanSpec, Recompute, Schedule, Sharding,
                                  schedule_rule)
from echo_plan.specs.plan_checks import validate_plan
from echo_plan.specs.software import SoftwareSpec
from echo_plan.specs.software_checks import check_plan_supported, check_precision
from echo_plan.search.space import Knob, SearchSpace
from echo_plan.cost.memory import estimate_memory, load_memory_constants
from echo_plan.layout.sharding import stack_level
from echo_plan.search.activation_scale import TracedActivationScale
from echo_plan.specs.presets import load_stack
from echo_plan.trace.cache import TraceCache

MemoryEstimator = Callable[[ModelSpec, PlanSpec, ClusterSpec], tuple[StageMemory, ...]]


class PruneReason(str, Enum):
    """Stable categories; the value is what users see (and what is stored with pruned trials)."""

    GPUS = "tp x cp x pp does not divide the GPUs"
    BATCH = "global batch not divisible by dp x micro-batch"
    TP_MODEL = "tp does not divide the model's heads or FFN"
    TP_NODE = "tp exceeds a node"
    LAYERS = "pp x virtual stages does not divide the layers"
    SCHEDULE = "schedule does not fit the virtual stages"
    INTERLEAVE_BATCH = "interleaving needs micro-batches a multiple of pp"
    SEQUENCE_PARALLEL = "sequence parallel needs seq divisible by tp"
    CP_SEQUENCE = "cp does not split the sequence into 2 x cp chunks"
    NEEDS_CP = "out of memory at this sequence length without context parallelism (estimate)"
    STACK = "the software stack lacks the feature"
    PRECISION = "the GPU has no tensor cores for the dtype"
    DUPLICATE = "same plan as another candidate"
    OOM_ESTIMATE = "out of memory (estimate)"
    INVALID = "invalid plan (other rule)"


_SPLIT = (Schedule.ZB_H1.value, Schedule.ZB_V.value, Schedule.DUALPIPE.value)

# validate_plan names the field it rejects; this maps that field to a category.
_FIELD_REASON = {
    "tp x pp x dp": PruneReason.GPUS,
    "tp x cp x pp x dp": PruneReason.GPUS,
    "cp": PruneReason.CP_SEQUENCE,
    "tp": PruneReason.TP_MODEL,
    "pp": PruneReason.LAYERS,
    "pp x virtual_stages": PruneReason.LAYERS,
    "virtual_stages": PruneReason.INTERLEAVE_BATCH,
    "sequence_parallel": PruneReason.SEQUENCE_PARALLEL,
    "dtype": PruneReason.PRECISION,  # fp8 on a GPU without FP8 tensor cores (A100)
    "schedule": PruneReason.SCHEDULE,  # zb-v / dualpipe shape rules (specs/plan.py schedule_rule)
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the checks say about one combination of knob values."""

    combo: dict[str, Any]  # the knob values as the space gave them
    plan: PlanSpec | None  # the canonical plan (None when no plan can be built)
    reason: PruneReason | None  # None: simulate it
    detail: str = ""
    memory: tuple[StageMemory, ...] = ()
    same_as: int | None = None  # for a duplicate: the index of the first combination with its plan


def canonical(combo: dict[str, Any], dp: int | None = None) -> dict[str, Any]:
    """The combination with settings that change nothing normalised, so equal plans compare equal.

    Sequence parallelism needs tp > 1; overlapping the parameter all-gather needs a distributed
    optimizer (Megatron-LM); a single pipeline stage has no schedule to choose, so it is 1F1B;
    1F1B with virtual stages is the interleaved 1F1B schedule. With ``dp`` 1 (when known) there is
    no data-parallel communication and nothing to shard: the distributed optimizer and both DP
    overlap switches change nothing, so they take their plain values (off, off, and the default on), unless the
    optimizer is offloaded (what Megatron and DeepSpeed move to the CPU is their sharded optimizer, here of one
    rank). Without a sharded optimizer nothing is offloaded.
    """
    c = dict(combo)
    if c.get("sharding") is not None:  # the level named: distributed_optimizer is its name for optimizer and up
        c["distributed_optimizer"] = c["sharding"] != Sharding.NONE.value
    if dp == 1 and not c.get("offload_optimizer"):
        c["distributed_optimizer"] = False
        c["overlap_grad_reduce"] = True
        c["sharding"] = None if c.get("sharding") is None else Sharding.NONE.value
    elif dp == 1:  # offloaded: Megatron and DeepSpeed move only their sharded optimizer, here of one rank
        c["overlap_grad_reduce"] = True
    if not c["distributed_optimizer"]:
        c["shard_degree"] = 0  # nothing sharded
        if c.get("offload_optimizer"):
            c["offload_optimizer"] = False  # nothing sharded, nothing offloaded: the same plan as without
    if not c.get("offload_optimizer") and "offload_fraction" in c:
        c["offload_fraction"] = 1.0
    if c.get("recompute") == Recompute.FULL.value:
        c["recompute_layers"] = 0  # every layer recomputed already
    if c["tp"] == 1:
        c["sequence_parallel"] = False
    if not c["distributed_optimizer"]:
        c["overlap_param_gather"] = False
    if c["schedule"] == Schedule.ZB_V.value and c["virtual_stages"] == 1:
        c["virtual_stages"] = 2  # ZB-V is two chunks per rank by definition
    if c["pp"] == 1 and c["virtual_stages"] == 1:
        c["schedule"] = Schedule.ONE_F_ONE_B.value
    if c["virtual_stages"] > 1 and c["schedule"] == Schedule.ONE_F_ONE_B.value:
        c["schedule"] = Schedule.INTERLEAVED.value
    return c


def _resolve_layer_share(fields: dict[str, Any], layers: int, chunks: int) -> str | None:
    """Turn a share of each chunk's layers ("1/n", search_spaces/README.md) into the count it is, in place; why not
    when the chunks differ in length or n does not divide them (a share that is no whole count of every chunk is
    not the every-n-th-layer checkpointing it stands for)."""
    n = int(str(fields["recompute_layers"]).split("/")[1])
    sizes = set(fields.get("layer_split") or ()) or ({layers // chunks} if layers % chunks == 0 else set())
    count = every_nth_layer(sizes, n)
    if count is None:
        have = ", ".join(map(str, sorted(sizes))) if sizes else f"{layers} layers over {chunks}"
        return f"recompute_layers 1/{n}: every {n}-th layer is no whole count of each model chunk ({have})"
    fields["recompute_layers"] = count
    return None


def plan_key(plan_fields: dict[str, Any]) -> tuple:
    """A hashable identity of a plan from its knob fields (and dp)."""
    return tuple((k.value, plan_fields[k.value]) for k in Knob) + (("dp", plan_fields.get("dp")),)


class Pruner:
    """Checks candidates of one (model, cluster, global batch, space); keeps no hidden state."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, global_batch_size: int, space: SearchSpace,
                 memory: MemoryEstimator | None = None, stack: SoftwareSpec | None = None,
                 memory_headroom_bytes: int | None = None, trace_cache_dir: str | None = None) -> None:
        if global_batch_size < 1:
            raise SpecError("gbs", global_batch_size, "a positive global batch size (sequences)")

        self.model = model
        self.cluster = cluster
        self.gbs = global_batch_size
        self.space = space
        self.stack = stack if stack is not None else load_stack()
        self.headroom = memory_headroom_bytes
        self.trace_cache_dir = trace_cache_dir  # where the low-precision reference traces go (the search's cache)
        self._memory = memory

    def memory_estimator(self) -> MemoryEstimator:
        if self._memory is None:
            scale = TracedActivationScale(self.model, self.cluster, self.stack, TraceCache(self.trace_cache_dir))
            self._memory = closed_form_memory(self.stack, self.headroom, scale)
        return self._memory

    def check(self, combo: dict[str, Any]) -> Verdict:
        """Every rule, in order, on one combination; a plan only when all arithmetic rules pass."""
        c = canonical(combo)
        gpus = self.cluster.num_gpus
        tp, pp, vpp, mbs = c["tp"], c["pp"], c["virtual_stages"], c["micro_batch_size"]
        cp = c.get("cp", 1)
        if gpus % (tp * cp * pp):
            what = f"tp x cp x pp = {tp * cp * pp}" if cp > 1 else f"tp x pp = {tp * pp}"
            return Verdict(combo, None, PruneReason.GPUS, f"{what} does not divide {gpus} GPUs")
        dp = gpus // (tp * cp * pp)
        if dp * cp == 1:
            c = canonical(combo, dp)
        if c.get("shard_degree", 0) >= dp * cp:
            c["shard_degree"] = 0  # one shard group: the whole data-parallel group
        if self.gbs % (dp * mbs):
            return Verdict(combo, None, PruneReason.BATCH,
                           f"global batch {self.gbs} is not a multiple of dp x mbs = {dp} x {mbs}")
        dom = self.cluster.domain_gpus
        if self.space.tp_within_node and (tp > dom or dom % tp):
            return Verdict(combo, None, PruneReason.TP_NODE,
                           f"tp {tp} does not fit in a {dom}-GPU NVLink domain")
        schedule = c["schedule"]
        if schedule in _SPLIT:
            why = schedule_rule(Schedule(schedule), pp, vpp, self.gbs // (dp * mbs))
            if why is not None:
                return Verdict(combo, None, PruneReason.SCHEDULE, why)
        if vpp > 1 and (pp == 1 or schedule == Schedule.GPIPE.value):
            why = "interleaving needs pp > 1" if pp == 1 else "GPipe is not interleaved"
            return Verdict(combo, None, PruneReason.SCHEDULE, f"virtual_stages {vpp}: {why}")
        if schedule == Schedule.INTERLEAVED.value and vpp == 1:
            return Verdict(combo, None, PruneReason.SCHEDULE, "the interleaved schedule needs virtual_stages > 1")
        fields = dict(c, dp=dp, global_batch_size=self.gbs, **dict(self.space.fixed))
        if not self.model.is_moe:  # expert knobs mean nothing for a dense model
            for k in ("ep", "etp"):
                fields.pop(k, None)
        if not fields.get("shard_degree"):
            fields.pop("shard_degree", None)  # 0: the whole data-parallel group
        if fields.get("sharding") is None and fields.get("distributed_optimizer") and self.stack is not None:
            # the stack's own level named when it is more than the optimizer's (a space written for Megatron, such
            # as long-context, on a ZeRO-2 or FSDP stack): the plan then reads as what it runs ("fsdp", not
            # "dist-opt") in every label, report and export
            level = stack_level(self.stack)  # Megatron's own, the optimizer states, stays distributed_optimizer
            if level is not Sharding.OPTIMIZER:
                fields["sharding"] = level.value
        if fields.get("sharding") is None:
            fields.pop("sharding", None)
        if fields.get("dp_comm", "dense") == "dense":
            fields["density"] = 1.0  # a dense exchange has no density
        if not fields.get("offload_optimizer"):
            fields["offload_fraction"] = 1.0  # nothing offloaded has no share
        nvs, layers = pp * vpp, self.model.num_layers
        short = -layers % nvs  # layers missing for an even split
        if schedule == Schedule.DUALPIPE.value:
            nvs = pp  # two copies of pp stages, not virtual stages
        if pp > 1 and short and nvs <= layers and (vpp == 1 or short <= 2):
            # as even as possible: without interleaving any shortfall (DeepSeek-V3's 61 layers on 8
            # stages); with it, one layer fewer on the first and last virtual stage (Llama 3 405B's
            # 126 layers on 16 x 2 virtual stages)
            fields["layer_split"] = balanced_split(layers, nvs)
        if isinstance(fields.get("recompute_layers"), str):
            why = _resolve_layer_share(fields, layers, nvs)
            if why is not None:
                return Verdict(combo, None, PruneReason.INVALID, why)
        try:
            plan = PlanSpec.build(fields, context="candidate plan")
            validate_plan(plan, self.model, self.cluster)
        except SpecError as exc:
            reason = _FIELD_REASON.get(exc.field, PruneReason.INVALID)
            return Verdict(combo, None, reason, str(exc).split(": ", 1)[-1])
        try:
            check_plan_supported(self.stack, plan)
        except SpecError as exc:
            return Verdict(combo, None, PruneReason.STACK, str(exc).split(": ", 1)[-1])
        try:
            check_precision(self.stack, plan.dtype, self.cluster.gpu, self.model.is_moe)
        except SpecError as exc:
            reason = PruneReason.PRECISION if exc.field == "fp8_recipe" else PruneReason.INVALID
            return Verdict(combo, None, reason, str(exc).split(": ", 1)[-1])
        return Verdict(combo, plan, None)

    def _activations_decide(self, worst: StageMemory) -> bool:
        return _long_sequence_oom(self.model, worst)

    def check_memory(self, verdict: Verdict) -> Verdict:
        """The memory estimate of a plan that passed the arithmetic rules."""
        if verdict.plan is None or verdict.reason is not None:
            return verdict
        try:
            memory = tuple(self.memory_estimator()(self.model, verdict.plan, self.cluster))
        except EchoPlanError as exc:
            return Verdict(verdict.combo, None, PruneReason.INVALID, str(exc))
        over = [m for m in memory if not m.fits]
        if over:
            worst = max(over, key=lambda m: m.overflow_bytes)
            detail = (f"stage {worst.stage} needs {worst.total_bytes / 2**30:.1f} GiB of "
                      f"{worst.capacity_bytes / 2**30:.1f} GiB") if worst.overflow_bytes else (
                      f"stage {worst.stage}'s offloaded optimizer needs {worst.host_bytes / 2**30:.1f} GiB of host "
                      f"memory per GPU, {worst.host_capacity_bytes / 2**30:.1f} GiB usable")
            if verdict.plan.cp == 1 and worst.overflow_bytes and self._activations_decide(worst):
                detail += (f", {worst.activations_bytes / 2**30:.1f} GiB of it activations of {self.model.seq_length:,}"
                           "-token sequences: context parallelism would split them")
                return Verdict(verdict.combo, verdict.plan, PruneReason.NEEDS_CP, detail, memory)
            return Verdict(verdict.combo, verdict.plan, PruneReason.OOM_ESTIMATE, detail, memory)
        return Verdict(verdict.combo, verdict.plan, None, "", memory)


LONG_SEQUENCE = 16384  # tokens: the sequence lengths at which context parallelism is the usual answer


def _long_sequence_oom(model: ModelSpec, worst: StageMemory) -> bool:
    """A plan without CP is out of memory because of its long sequence: the sequence is long and its
    activations, which context parallelism divides, are more than the overflow."""
    return model.seq_length > LONG_SEQUENCE and worst.activations_bytes >= worst.overflow_bytes


def closed_form_memory(stack: SoftwareSpec | None = None, memory_headroom_bytes: int | None = None,
                       activation_scale=None) -> MemoryEstimator:
    """``echo_plan.cost.memory.estimate_memory`` for ``stack`` (default: megatron-core) with the given
    headroom (default: memory.yaml's fraction of the GPU), as a MemoryEstimator. ``activation_scale(plan)``:
    None or the (kind, recompute) -> factor that makes the plan's closed-form activations the traced ones
    (search/activation_scale.py)."""
    stack = stack if stack is not None else load_stack()
    consts = load_memory_constants()

    def estimate(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec) -> tuple[StageMemory, ...]:
        scale = activation_scale(plan) if activation_scale is not None else None
        return estimate_memory(model, plan, cluster, stack, memory_headroom_bytes, consts, scale)

    return estimate


@dataclass(frozen=True, slots=True)
class PrunedSpace:
    """Every combination of a space with its verdict; ``valid`` are the distinct plans to simulate."""

    verdicts: tuple[Verdict, ...]
    valid: tuple[Verdict, ...]  # in enumeration order, one per distinct plan

    @property
    def total(self) -> int:
        return len(self.verdicts)

    def counts(self) -> dict[str, int]:
        """Reason -> combinations pruned for it (stable order: the order of PruneReason)."""
        raw: dict[PruneReason, int] = {}
        for v in self.verdicts:
            if v.reason is not None:
                raw[v.reason] = raw.get(v.reason, 0) + 1
        return {r.value: raw[r] for r in PruneReason if r in raw}


def prune_space(pruner: Pruner) -> PrunedSpace:
    """Check every combination of the pruner's space: arithmetic rules, duplicates, then memory."""
    verdicts: list[Verdict] = []
    seen: dict[tuple, int] = {}
    for combo in pruner.space.combos():
        v = pruner.check(combo)
        if v.plan is not None:
            fields = v.plan.model_dump(mode="json")
            key = plan_key(fields)
            if key in seen:
                first = seen[key]
                v = Verdict(combo, v.plan, PruneReason.DUPLICATE, f"same plan as {v.plan.short()}", same_as=first)
            else:
                seen[key] = len(verdicts)
                v = pruner.check_memory(v)
        verdicts.append(v)
    valid = tuple(v for v in verdicts if v.reason is None)
    return PrunedSpace(tuple(verdicts), valid)
