"""Model-state memory of a pipeline rank whose data parallelism shards the parameters (ZeRO-3, FSDP).

Sharded state, each split over the shard group (``layout/sharding.py``): the optimizer states (master
weights and moments), the parameters at the stack's ``sharded_param_bytes`` beside them (0 for FSDP2
with mixed precision, whose fp32 shards are the master weights; 2 for DeepSpeed ZeRO-3's bf16 shards
beside fp32 masters), and the sharded gradients in the sharded parameters' dtype (fp32 for FSDP2 and FSDP1 even
with a bf16 reduce: torch 2.13 ``_fsdp_collectives.foreach_reduce`` casts the reduce-scatter's output back to it).

Unsharded working set, as PyTorch's FSDP2 holds it (replay/fsdp.py says when it gathers):

* without a pipeline, or with ``reshard_after_forward``: the larger of the rank's end units (the token
  embedding; the final norm with the output layer, which torchtitan does not reshard after forward:
  the rank's embedding and output parameters split evenly between the two when it has both) and two
  blocks (the current one and the one prefetched beside it, or at the start of backward the last
  block and its prefetched neighbour), in the gathered dtype (the plan's parameter dtype, 1 byte per block weight
  with FP8 all-gather); and two blocks' unsharded gradients in the reduce dtype, the one being
  reduce-scattered and the one being produced (a judgement of FSDP2's reduce-scatter buffering, no
  measurement behind it; say so where it matters);
* with a pipeline: the stage's whole gathered parameters and its unsharded gradients in the reduce dtype.
  torch.distributed.pipelining turns off resharding after backward and the gradient sync for every
  micro-batch but the last (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``
  in ``stage.py``), so after a backward every block stays gathered, and FSDP2 accumulates the unsharded
  gradients upcast to the reduce dtype (``to_accumulated_grad_if_needed``) until the last backward
  reduce-scatters them. Hence with a pipeline, sharding the parameters holds more than sharding the
  gradients (ZeRO-2) does: a property of FSDP2 under pipelining, which the planner shows as it is.
"""

from __future__ import annotations

from typing import Mapping

from echo_plan.layout.layer_mix import layer_params_per_rank
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.cost.weight_copies import layer_gather_bytes
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import LayerKind
from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.software import SoftwareSpec

WORKING_BLOCKS = 2  # FSDP2's implicit prefetch: the current unit and the next one
FP32_BYTES = 4


def fsdp_states(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, sharding: DataParallelSharding,
                counts: Mapping[LayerKind, int], dense: int, experts: int, param_bytes: float, grad_bytes: float,
                optimizer_bytes: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) in bytes of a rank holding ``dense`` and ``experts``
    parameters (its layers ``counts`` plus, where it has them, the embedding and output layer)."""
    layers = {kind: sum(layer_params_per_rank(model, plan, kind)) for kind in counts}
    layer_total = sum(layers[kind] * n for kind, n in counts.items())
    block = max(layers.values(), default=0)
    root = max(0, dense + experts - layer_total)
    gathered = layer_gather_bytes(plan.dtype, stack) if plan.dtype.low_precision else plan.param_dtype.nbytes
    stored = stack.sharded_param_bytes
    ends = 2 if plan.pp == 1 else 1  # a pipeline's first rank has the embedding, its last the output layer
    shard, eshard = sharding.parameter_shards(), sharding.parameter_shards(expert=True)
    weights = dense * stored / shard + experts * stored / eshard
    # the sharded gradients take the sharded parameters' dtype whatever the reduce dtype (FSDP2's foreach_reduce
    # casts the reduce-scatter's output to it; FSDP1 likewise): fp32 where the shards are the fp32 masters
    sharded_grad = 0.0 if stack.optimizer_in_backward else stored or FP32_BYTES  # stepped and freed in the backward
    grads = dense * sharded_grad / sharding.gradient_shards() + experts * sharded_grad / \
        sharding.gradient_shards(True)
    if plan.pp > 1:
        weights += layer_total * gathered + root * plan.param_dtype.nbytes
        grads += (layer_total + root) * grad_bytes
    else:
        weights += root / max(1, ends) * plan.param_dtype.nbytes + WORKING_BLOCKS * block * gathered
        grads += WORKING_BLOCKS * block * grad_bytes
    optimizer = dense * optimizer_bytes / sharding.optimizer_shards() + experts * optimizer_bytes / \
        sharding.optimizer_shards(expert=True)
    return weights, grads, optimizer
