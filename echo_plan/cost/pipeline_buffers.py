"""What a pipeline runtime holds between micro-batches beyond the saved activations (stack ``pipeline_runtime``).

Megatron-Core's schedules receive each transfer into a fresh tensor and free every output with its backward:
nothing beyond the activations (``megatron``). torch.distributed.pipelining (``torch``, torchtitan's pipeline),
read in ``torch/distributed/pipelining/stage.py`` (PyTorch 2.5 to 2.13):

* every stage but the first makes a receive buffer for each micro-batch of the step before the step runs
  (``_prepare_forward_infra``: ``_make_tensor_from_meta`` per micro-batch), and every stage but the last one for
  each micro-batch's output gradient (``_create_grad_recv_info``). A received activation is the stage's input,
  which the activations already count while its micro-batch is in flight; the others are held besides;
* the last stage appends each micro-batch's output to ``output_chunks`` (the logits, for the schedule to return),
  cleared only when the next step begins (``clear_runtime_states``): the micro-batches whose backward has run
  still hold theirs.

The tensor between stages is one micro-batch's hidden states, split over the tensor-parallel ranks when the
plan shards the sequence (torchtitan's TP plan hands its stages the sequence-sharded local tensor); the output is
the logits, split over the vocabulary with TP (torchtitan's loss_parallel). Under an interleaved plan each of a
rank's chunks is a stage of its own (torchtitan's "loop" placement: rank r holds stages r, r + pp, ...).
"""

from __future__ import annotations

from echo_plan.cost.schedule_memory import inflight_on_chunk
from echo_plan.layout.layer_mix import rank_virtual_stages
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.software import PipelineRuntime, SoftwareSpec


def pipeline_runtime_bytes(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, stage: int) -> int:
    """Bytes pipeline rank ``stage`` holds for its runtime beyond the activations (the module docstring)."""
    if plan.pp == 1 or stack.pipeline_runtime is not PipelineRuntime.TORCH:
        return 0
    m, v, e = plan.num_microbatches, plan.virtual_stages, plan.param_dtype.nbytes
    tokens = plan.micro_batch_size * (model.seq_length // plan.cp)
    boundary = tokens * model.hidden_size * e // (plan.tp if plan.sequence_parallel else 1)
    held = 0
    for chunk, vs in enumerate(rank_virtual_stages(plan, stage)):
        first, last = vs == 0, vs == plan.pp * v - 1
        if not first:  # received activations not already held as an in-flight input
            held += (m - min(m, inflight_on_chunk(plan, stage, chunk))) * boundary
        if not last:
            held += m * boundary
        else:
            logits = tokens * model.vocab_size * e // plan.tp
            held += (m - min(m, inflight_on_chunk(plan, stage, chunk))) * logits
    return held
