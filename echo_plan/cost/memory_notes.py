"""What the memory model counts, in words for ``simulate``'s notes: the caching allocator's fragmentation, what
the loss holds on the last stage and what the pipeline runtime holds, from what ``cost/memory.py`` counts with."""

from __future__ import annotations

from echo_plan.cost.activation_memory import loss_saved_bytes_per_logit
from echo_plan.cost.memory import MemoryConstants, load_memory_constants
from echo_plan.cost.pipeline_buffers import pipeline_runtime_bytes
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.software import CrossEntropy, CudaAllocator, SoftwareSpec

__all__ = ["allocator_note", "loss_note", "pipeline_note"]


def allocator_note(stack: SoftwareSpec, consts: MemoryConstants | None = None) -> str:
    """What the memory counts for the caching allocator, and the launch setting that counts on (in words)."""
    c = consts or load_memory_constants()
    share = c.fragmentation_fraction[stack.cuda_allocator.value]
    if stack.cuda_allocator is CudaAllocator.EXPANDABLE_SEGMENTS:
        return (f"memory counts the allocator's fragmentation at {share:.1%} of the activations (stack {stack.name}: "
                f"expandable segments; launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, without it "
                f"{c.fragmentation_fraction[CudaAllocator.DEFAULT.value]:.1%})")
    return (f"memory counts the allocator's fragmentation at {share:.1%} of the activations (stack {stack.name}: "
            f"PyTorch's default allocator)")


def loss_note(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec, consts: MemoryConstants | None = None) -> str:
    """What the loss holds on the last stage per micro-batch (what it saves and its transient at the peak), in
    words, where the choice of loss kernel moves it by a GiB or more ("" otherwise); an unfused one names the
    fused alternative its framework has."""
    c = consts or load_memory_constants()
    logits = model.seq_length // plan.cp * plan.micro_batch_size * model.vocab_size / plan.tp

    def held_gib(kernel: CrossEntropy) -> float:
        per_logit = loss_saved_bytes_per_logit(plan, kernel) + c.loss_transient_bytes_per_logit(plan, kernel)
        return per_logit * logits / 2**30

    kernel = stack.cross_entropy
    alternative = {CrossEntropy.UNFUSED: CrossEntropy.TE, CrossEntropy.TE: CrossEntropy.UNFUSED,
                   CrossEntropy.TORCH: CrossEntropy.TORCH_COMPILED,
                   CrossEntropy.TORCH_COMPILED: CrossEntropy.TORCH}[kernel]
    held, other = held_gib(kernel), held_gib(alternative)
    if abs(held - other) < 1.0:
        return ""
    where = f"{held:.1f} GiB per micro-batch on the last stage (stack {stack.name}: cross_entropy {kernel.value})"
    if kernel is CrossEntropy.TE:
        return f"loss: Transformer Engine's fused cross entropy keeps the bf16 logits, {where}"
    if kernel is CrossEntropy.TORCH_COMPILED:
        return (f"loss: the compiled cross entropy keeps the bf16 logits and writes a bf16 gradient, {where}; "
                f"eager ({CrossEntropy.TORCH.value}) {other:.1f} GiB")
    if kernel is CrossEntropy.TORCH:
        parallel = " through loss_parallel's log-softmax" if plan.tp > 1 else ""
        return (f"loss: PyTorch's cross entropy on an fp32 copy of the logits{parallel} holds its fp32 log-softmax and "
                f"gradients, {where}; compiled with the model ({CrossEntropy.TORCH_COMPILED.value}) {other:.1f} GiB")
    return (f"loss: the unfused cross entropy keeps an fp32 softmax and briefly an fp32 copy of the logits, "
            f"{held:.1f} GiB per micro-batch on the last stage (stack {stack.name}); Transformer "
            f"Engine's fused loss, which Megatron-Bridge's recipes run (stack field cross_entropy: te), keeps "
            f"{other:.1f} GiB")


def pipeline_note(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec) -> str:
    """What the pipeline runtime holds beyond the activations on the rank that holds most, in words ("" for none)."""
    held = [pipeline_runtime_bytes(model, plan, stack, i) for i in range(plan.pp)]
    most = max(held, default=0)
    if most <= 0:
        return ""
    return (f"pipeline: torch.distributed.pipelining (stack {stack.name}: pipeline_runtime "
            f"{stack.pipeline_runtime.value}) keeps a receive buffer for each of the {plan.num_microbatches} "
            f"micro-batches and the last stage's outputs until the step ends: up to {most / 2**30:.1f} GiB "
            f"(stage {held.index(most)})")
