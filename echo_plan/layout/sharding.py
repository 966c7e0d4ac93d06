"""How the data-parallel group shards a rank's training state: decided here, once, from the plan and
the software stack, and read by every stage (memory, the data-parallel collectives and the optimizer
step in the replay, the Chakra export, the checkpoint size of the goodput model).

The plan says whether the optimizer is sharded (``distributed_optimizer``, Megatron-LM's name for
ZeRO-1); the stack says what its sharded optimizer shards (``optimizer_sharding``: the states, or the
states and the gradient buffer as Apex's DistributedFusedAdam and ZeRO-2 do). A sharded level reduces
gradients with a reduce-scatter to their shard's owner and gathers the updated parameters with an
all-gather; an unsharded one all-reduces them. States are sharded over the gradient-reducing group:
the data-and-context-parallel ranks for dense parameters (context-parallel ranks hold the same
weights), the expert-data-parallel ranks for experts. Sharding the parameters themselves (ZeRO-3,
FSDP, HSDP with a shard degree) is issue 34's and adds its level here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.software import OptimizerSharding, SoftwareSpec


class ShardLevel(str, Enum):
    NONE = "none"  # every data-parallel rank holds all its gradients and optimizer states (DDP)
    OPTIMIZER = "optimizer"  # fp32 master weights and Adam moments sharded (ZeRO-1, distributed optimizer)
    GRADIENTS = "gradients"  # the gradient buffer too (ZeRO-2)


@dataclass(frozen=True, slots=True)
class DataParallelSharding:
    level: ShardLevel
    degree: int  # dense parameters' sharded state is split over this many ranks (dp x cp)
    expert_degree: int  # expert parameters' over the expert-data-parallel ranks

    @classmethod
    def of(cls, plan: PlanSpec, stack: SoftwareSpec | None) -> "DataParallelSharding":
        """The plan's sharding under ``stack`` (None: what any stack with a sharded optimizer shards,
        the optimizer states: enough where only their count matters)."""
        if not plan.distributed_optimizer:
            return cls(ShardLevel.NONE, 1, 1)
        grads = stack is not None and stack.optimizer_sharding is OptimizerSharding.STATES_AND_GRADS
        return cls(ShardLevel.GRADIENTS if grads else ShardLevel.OPTIMIZER, plan.grad_dp, plan.edp)

    @property
    def sharded(self) -> bool:
        """Gradients reduce-scattered to their shard's owner, parameters all-gathered after the step."""
        return self.level is not ShardLevel.NONE

    def optimizer_shards(self, expert: bool = False) -> int:
        """How many ways the optimizer states of dense (or expert) parameters are split."""
        if not self.sharded:
            return 1
        return self.expert_degree if expert else self.degree

    def gradient_shards(self, expert: bool = False) -> int:
        """How many ways the gradient buffer of dense (or expert) parameters is split."""
        if self.level is not ShardLevel.GRADIENTS:
            return 1
        return self.expert_degree if expert else self.degree
