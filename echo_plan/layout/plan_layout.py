"""The plan's layout: what follows from (model, plan, stack) alone, derived once and read by the cost
models and the replay (in the spirit of torchtitan's ``ParallelDims``).

``PlanLayout.of`` derives, and checks that they agree with each other: the schedule the step runs
(interleaved with one chunk per rank is plain 1F1B), the layers of each virtual stage and their kinds
(dense, MoE, sliding-window attention), the layer kinds each pipeline rank holds, where the data-
parallel and expert-data-parallel groups sit among the ranks, and how the data-parallel group shards
gradients and optimizer states (sharding.py). ``simulate`` derives it once per plan and hands it to the
stage costs (replay/step_costs.py) and the memory model (cost/memory.py); each still derives it itself
when called alone, from the same function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from echo_plan.errors import SpecError
from echo_plan.layout.layer_mix import all_stage_kind_counts, kind_counts
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import LayerKind
from echo_plan.specs.plan import PlanSpec, Schedule
from echo_plan.specs.software import SoftwareSpec
from echo_plan.trace.records import CommGroup, GroupKind


def dp_group(plan: PlanSpec) -> CommGroup:
    """Megatron-LM's rank order is tp fastest, then cp, then dp: the gradient group is the
    data-and-context-parallel one (dp x cp ranks, stride tp), as CP ranks hold the same weights."""
    return CommGroup(GroupKind.DP, size=plan.grad_dp, stride=plan.tp, start=0)


def edp_group(plan: PlanSpec) -> CommGroup:
    """Megatron-Core's expert rank order is etp fastest, then ep, then expert dp: stride etp x ep."""
    return CommGroup(GroupKind.EDP, size=plan.edp, stride=plan.expert_tp * plan.ep, start=0)


def step_schedule(plan: PlanSpec) -> Schedule:
    """The schedule the step runs: the interleaved one with one chunk per rank is plain 1F1B."""
    if plan.virtual_stages == 1 and plan.schedule is Schedule.INTERLEAVED:
        return Schedule.ONE_F_ONE_B
    return plan.schedule


@dataclass(frozen=True)
class PlanLayout:
    schedule: Schedule
    layers_per_virtual_stage: tuple[int, ...]  # in model order
    first_layer: tuple[int, ...]  # of each virtual stage
    kinds_per_virtual_stage: tuple[tuple[tuple[LayerKind, int], ...], ...]  # (kind, layers) in order
    kinds_per_rank: tuple[Mapping[LayerKind, int], ...]  # each pipeline rank's layers, all its chunks
    dp_group: CommGroup
    edp_group: CommGroup
    sharding: DataParallelSharding

    @classmethod
    def of(cls, model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec | None) -> "PlanLayout":
        layers = tuple(plan.virtual_layers(model.num_layers))
        if sum(layers) != model.num_layers:
            raise SpecError("layer_split", layers, f"layer counts that add up to the model's {model.num_layers} "
                                                   f"layers")
        first = tuple(sum(layers[:vs]) for vs in range(len(layers)))
        return cls(step_schedule(plan), layers, first,
                   tuple(kind_counts(model, f, n, plan.recompute_layers) for f, n in zip(first, layers)),
                   all_stage_kind_counts(model, plan), dp_group(plan), edp_group(plan),
                   DataParallelSharding.of(plan, stack))
