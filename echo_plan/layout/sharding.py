"""How the data-parallel group shards a rank's training state: decided here, once, from the plan and
the software stack, and read by every stage (memory, the data-parallel collectives and the optimizer
step in the replay, the Chakra export, the checkpoint size of the goodput model).

The plan says how far the state is sharded (``sharding``: none, optimizer, gradients, parameters:
ZeRO's stages 0-3; ``distributed_optimizer``, Megatron-LM's name for ZeRO-1, stands for the stack's
own sharded level when ``sharding`` is not given: the stack's ``optimizer_sharding``). A sharded
level reduces gradients with a reduce-scatter to their shard's owner and gathers the updated
parameters with an all-gather; an unsharded one all-reduces them. States are sharded over the
gradient-reducing group: the data-and-context-parallel ranks for dense parameters (context-parallel
ranks hold the same weights), the expert-data-parallel ranks for experts; or, with a ``shard_degree``
(HSDP, Megatron's partial distributed optimizer), over groups of that many ranks, the groups
replicas of each other whose gradient shards are all-reduced across them. Sharding the parameters
(FSDP) gathers each block's parameters before its forward and (with ``reshard_after_forward``) again
before its backward, and reduce-scatters its gradients after its backward (replay/fsdp.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from echo_plan.specs.plan import PlanSpec, Sharding
from echo_plan.specs.software import GradientBuffers, OptimizerSharding, SoftwareSpec

ShardLevel = Sharding  # the plan's enum: none, optimizer, gradients, parameters

_STACK_LEVEL = {OptimizerSharding.STATES: Sharding.OPTIMIZER, OptimizerSharding.STATES_AND_GRADS: Sharding.GRADIENTS,
                OptimizerSharding.PARAMS: Sharding.PARAMETERS}


def stack_level(stack: SoftwareSpec | None) -> Sharding:
    """What ``distributed_optimizer`` shards on ``stack`` when a plan names no level (None: the optimizer states)."""
    return Sharding.OPTIMIZER if stack is None else _STACK_LEVEL.get(stack.optimizer_sharding, Sharding.OPTIMIZER)


@dataclass(frozen=True, slots=True)
class DataParallelSharding:
    level: ShardLevel
    degree: int  # dense parameters' sharded state is split over this many ranks (dp x cp, or the shard degree)
    expert_degree: int  # expert parameters' over the expert-data-parallel ranks (or a shard group of them)
    replicas: int = 1  # copies of each dense shard (HSDP: dp x cp / shard degree), all-reduced across
    expert_replicas: int = 1
    # DeepSpeed's BF16_Optimizer (stack gradient_buffers: deepspeed-bf16) holds the gradients: its own ZeRO 0 or 1 only
    # (ZeRO-2/3 run DeepSpeed's stage optimizers instead); with a sharded optimizer it all-reduces the whole buffer
    # before each rank steps its shard (reduce_all), not a reduce-scatter to the shard's owner
    bf16_buffers: bool = False

    @property
    def reduce_all(self) -> bool:
        return self.bf16_buffers and self.level is ShardLevel.OPTIMIZER

    @classmethod
    def of(cls, plan: PlanSpec, stack: SoftwareSpec | None) -> "DataParallelSharding":
        """The plan's sharding under ``stack`` (None: what any stack with a sharded optimizer shards,
        the optimizer states, unless the plan names its level: enough where only their count matters)."""
        bf16 = stack is not None and stack.gradient_buffers is GradientBuffers.DEEPSPEED_BF16
        if not plan.distributed_optimizer:
            return cls(ShardLevel.NONE, 1, 1, bf16_buffers=bf16)
        if plan.sharding is not None:
            level = plan.sharding
        else:
            level = stack_level(stack)
        degree = plan.shard_group_size
        if degree == 1:  # shards of one rank: every rank holds its whole state, all-reduced (plain DDP)
            return cls(ShardLevel.NONE, 1, 1, bf16_buffers=bf16)
        expert_degree = math.gcd(plan.edp, degree)
        return cls(level, degree, expert_degree, plan.grad_dp // degree, plan.edp // expert_degree,
                   bf16_buffers=bf16 and level is Sharding.OPTIMIZER)

    @property
    def parameters(self) -> bool:
        """The parameters themselves are sharded and gathered block by block when used (ZeRO-3, FSDP)."""
        return self.level is ShardLevel.PARAMETERS

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
        if self.level not in (ShardLevel.GRADIENTS, ShardLevel.PARAMETERS):
            return 1
        return self.expert_degree if expert else self.degree

    def parameter_shards(self, expert: bool = False) -> int:
        """How many ways the parameters themselves are split (1 unless sharded at the parameters level)."""
        if not self.parameters:
            return 1
        return self.expert_degree if expert else self.degree
