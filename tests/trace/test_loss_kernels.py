"""Transformer Engine's fused cross entropy (stack ``cross_entropy: te``): its kernels compute the loss and the
gradient of the unfused loss, keep 2 bytes per logit instead of an fp32 softmax, and write the gradient in place."""

from __future__ import annotations

import pytest
import torch

from echo_plan.specs import DType, Recompute, load_stack
from echo_plan.trace.layers import padded_vocab
from echo_plan.trace.loss_kernels import te_ce_loss_grad_, te_ce_scale_, te_ce_stats
from echo_plan.trace.records import StageKind
from echo_plan.trace.tracer import trace_stage

UNFUSED = load_stack()
TE = load_stack("megatron-core", {"cross_entropy": "te"})


def _reference(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    x = logits.detach().float().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x.view(-1, x.shape[-1]), target.view(-1), reduction="none")
    (loss * weights.view(-1)).sum().backward()
    return loss.view(target.shape), x.grad


@pytest.mark.parametrize("shards", [1, 4])
def test_the_kernels_give_the_loss_and_its_gradient(shards):
    """Every vocabulary shard's stats, gathered rank-major, give each rank the exact loss; each rank's logits
    become its part of the gradient, scaled by the incoming gradient."""
    torch.manual_seed(0)
    s, b, v = 5, 3, 64
    logits = torch.randn(s, b, v, dtype=torch.float64)
    target = torch.randint(0, v, (s, b))
    weights = torch.rand(s, b, dtype=torch.float64)
    want_loss, want_grad = _reference(logits, target, weights)
    per = v // shards
    parts = [logits[..., r * per:(r + 1) * per].clone() for r in range(shards)]
    stats = torch.cat([te_ce_stats(p, target, r * per) for r, p in enumerate(parts)])
    for r, part in enumerate(parts):
        loss = te_ce_loss_grad_(part, target, stats, r * per)
        torch.testing.assert_close(loss, want_loss.to(loss.dtype))
        te_ce_scale_(part, weights.float())
        torch.testing.assert_close(part, want_grad[..., r * per:(r + 1) * per].to(part.dtype))


def _output(model, stack, tp=1):
    return trace_stage(model, StageKind.OUTPUT, tp=tp, sequence_parallel=tp > 1, micro_batch_size=2,
                       dtype=DType.BF16, recompute=Recompute.NONE, stack=stack)


@pytest.mark.parametrize("tp", [1, 2])
def test_the_te_loss_keeps_the_bf16_logits_and_moves_less(llama_small, tp):
    """The unfused loss saves an fp32 softmax (4 bytes per logit), Transformer Engine's the bf16 logits holding
    their gradient (2): the difference is exactly 2 bytes per logit; its three kernels (stats, loss and gradient,
    scale) read and write less than the unfused chain."""
    unfused, te = _output(llama_small, UNFUSED, tp), _output(llama_small, TE, tp)
    rows = llama_small.seq_length * 2
    logits = rows * padded_vocab(llama_small.vocab_size, tp) // tp
    # the unfused loss also keeps, per row, whether another rank holds the target (bool) and its column (int64)
    assert unfused.saved_bytes - te.saved_bytes == 2 * logits + 9 * rows
    names = [op.name for op in te.ops if "te_ce" in op.name]
    assert names == ["echo_plan.te_ce_stats.default", "echo_plan.te_ce_loss_grad_.default",
                     "echo_plan.te_ce_scale_.default"]
    for field in ("bytes_read", "bytes_written"):
        assert sum(getattr(o, field) for o in te.ops) < sum(getattr(o, field) for o in unfused.ops)
    stats = next(o.index for o in te.ops if "te_ce_stats" in o.name)
    gathers = [o for o in te.ops if o.collective is not None and o.phase.value == "forward" and o.index > stats]
    assert [g.collective.nbytes for g in gathers] == ([3 * 4 * rows * tp] if tp > 1 else [])  # every rank's row stats


def test_the_in_place_gradient_is_counted_as_written(llama_small):
    """The loss kernel writes the gradient over the logits: its bytes count as written, and the backward's scale
    depends on it."""
    ops = _output(llama_small, TE).ops
    kernel = next(o for o in ops if "te_ce_loss_grad_" in o.name)
    logits_bytes = llama_small.seq_length * 2 * padded_vocab(llama_small.vocab_size, 1) * 2
    assert kernel.bytes_written >= logits_bytes
    scale = next(o for o in ops if "te_ce_scale_" in o.name)
    assert kernel.index in scale.deps or any(ops[d].index > kernel.index for d in scale.deps)


def test_the_loss_kernel_is_part_of_the_trace_key(llama_small):
    assert _output(llama_small, UNFUSED).key.digest() != _output(llama_small, TE).key.digest()
    assert "ce=te" in TE.trace_signature() and "ce=" not in UNFUSED.trace_signature()
