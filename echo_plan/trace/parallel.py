"""Megatron-LM's tensor/sequence-parallel communication, as autograd functions over c10d.

Each function issues real functional collectives (``torch.ops._c10d_functional``) on the fake TP
group, so the tracer records them with their true sizes. Tensors are laid out [seq, batch, ...]
as in Megatron-LM, so sequence-parallel gathers and scatters work on dimension 0. DTensor (stack ``tp_runtime``
torch: torchtitan) keeps activations batch-first and shards them on the sequence, dim 1, while NCCL gathers and
scatters on dim 0: with more than one sequence a micro-batch, PyTorch's functional collectives copy each
all-gather's output into sequence order (``_maybe_view_chunk_cat``: a view for one sequence) and each
reduce-scatter's input into rank order (``_chunk_or_narrow_cat``), ``torch/distributed/_functional_collectives.py``.
Such a group ``rearranges``: a copy after each all-gather the layer waits for at once and before each
reduce-scatter. Not after the input re-gathers of a linear's backward (launched without waiting): DTensor keeps the
gathered input instead, so the re-gather this trace records (Megatron's way) stands for no collective there. Async
TP's fused kernels (``overlap.py``, ``torch/distributed/_symmetric_memory``) keep half of them: the fused
all-gather-matmul takes the shards as they are (ring exchanges, no copy), the fused matmul-reduce-scatter copies its
input once unless it already is in rank order (its docstring), which the reduce-scatters here stand for.

Conjugate pairs (Shoeybi et al. 2019, Fig. 3; Korthikanti et al. 2022, Sec. 4.2.2):
  copy_to_tp       f: identity forward,      all-reduce backward
  reduce_from_tp   g: all-reduce forward,    identity backward
  gather_from_sp     all-gather forward,     reduce-scatter backward
  reduce_scatter_sp  reduce-scatter forward, all-gather backward
  scatter_to_sp      split forward,          all-gather backward
"""

from __future__ import annotations

import torch

from echo_plan.trace import kernels
from echo_plan.trace.fake_pg import TPGroup

_c10d = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, group: TPGroup | None, op: str = "sum", wait: bool = True) -> torch.Tensor:
    """Reduce ``x`` over the group. With ``wait=False`` the collective is only launched: pass the
    result to :func:`wait` before use (Megatron-LM's ``async_op=True`` + ``handle.wait()``)."""
    if group is None:
        return x
    out = _c10d.all_reduce(x.contiguous(), op, group.name)
    return _c10d.wait_tensor(out) if wait else out


def all_gather(x: torch.Tensor, group: TPGroup | None, wait: bool = True) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dimension 0."""
    if group is None:
        return x
    out = _c10d.all_gather_into_tensor(x.contiguous(), group.size, group.name)
    if not wait:
        return out
    out = _c10d.wait_tensor(out)
    return out.clone() if group.rearranges else out


def reduce_scatter(x: torch.Tensor, group: TPGroup | None, wait: bool = True) -> torch.Tensor:
    """Sum over ranks, keep this rank's 1/size slice of dimension 0."""
    if group is None:
        return x
    x = x.clone() if group.rearranges else x.contiguous()
    out = _c10d.reduce_scatter_tensor(x, "sum", group.size, group.name)
    return _c10d.wait_tensor(out) if wait else out


def wait(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    """Block until a collective launched with ``wait=False`` has produced ``x``."""
    return x if group is None else _c10d.wait_tensor(x)


def _local_slice(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    if group is None:
        return x
    return x.chunk(group.size, dim=0)[0].contiguous()  # rank 0's shard


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return x if group is None else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return x if group is None else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: TPGroup | None) -> torch.Tensor:
    return x if group is None else _ScatterToSP.apply(x, group)


class _ParallelLinear(torch.autograd.Function):
    """y = x W^T (+ b) on this rank's weight shard, with Megatron-LM's communication.

    Mirrors Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``: with sequence
    parallelism the input shard is all-gathered in forward and only the shard is saved; backward
    launches the re-gather of the input while it computes the input gradient, then launches the
    input gradient's reduction (all-reduce, or reduce-scatter with sequence parallelism) and
    computes the weight gradient before waiting for it, so the trace's op order lets both
    collectives overlap a GEMM as they do in Megatron-LM. A bias is added by the GEMM itself
    (cuBLAS epilogue, one ``addmm``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, gather_input, reduce_grad, accumulate_unfused):
        ctx.group, ctx.gather_input, ctx.reduce_grad = group, gather_input, reduce_grad
        ctx.has_bias, ctx.main_grad = bias is not None, unfused_main_grad(weight, accumulate_unfused)
        total = all_gather(x, group) if gather_input else x
        ctx.save_for_backward(x, weight)
        return linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return (*linear_backward(ctx, grad_out), None, None)


def ring_gather_gemms(chunk: torch.Tensor, group: TPGroup, gemms) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The input's all-gather as tp - 1 ring exchanges, each arriving chunk multiplied by every weight that reads it
    while the next travels (Transformer Engine's userbuffers ring, or async TP's fused all-gather-matmul with
    several weights); returns each GEMM's output assembled from its chunks, and the chunks as they arrived."""
    tp = group.size
    parts: list[list[torch.Tensor]] = [[] for _ in gemms]
    arrived, cur = [], chunk
    for i in range(tp):
        nxt = kernels.ring_exchange(cur, tp) if i + 1 < tp else None
        for out, gemm in zip(parts, gemms):
            out.append(gemm(cur))
        arrived.append(cur)
        cur = nxt
    return [kernels.assemble(p) for p in parts], arrived


def column_comm(group: TPGroup | None, sequence_parallel: bool) -> tuple[bool, str | None]:
    """A column-parallel linear's communication: (whether its input's sequence shards are all-gathered, how its
    input gradient is reduced: reduce-scatter with sequence parallelism, all-reduce without, none without TP)."""
    if group is None:
        return False, None
    return sequence_parallel, "reduce_scatter" if sequence_parallel else "all_reduce"


class _SharedInputLinears(torch.autograd.Function):
    """Several column-parallel linears on one input, a GEMM and a weight each (``params``: weight, bias or None,
    weight, bias ...), with one linear's communication: the input's shard all-gathered once in forward (with
    ``overlap``, ring exchanges beside the GEMMs) and only the shard saved; backward gathers it again beside the
    input-gradient GEMMs, sums those, and launches the sum's reduction (reduce-scatter with sequence parallelism,
    else all-reduce) beside the weight-gradient GEMMs."""

    @staticmethod
    def forward(ctx, x, group, gather_input, reduce_grad, accumulate_unfused, overlap, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.gather_input, ctx.reduce_grad = group, gather_input, reduce_grad
        ctx.has_bias = [b is not None for b in biases]
        ctx.main_grads = [unfused_main_grad(w, accumulate_unfused) for w in weights]
        ctx.save_for_backward(x, *weights)
        if overlap:
            return tuple(ring_gather_gemms(x, group, [lambda a, w=w, b=b: linear(a, w, b)
                                                      for w, b in zip(weights, biases)])[0])
        total = all_gather(x, group) if gather_input else x
        return tuple(linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grad_outs):
        x, *weights = ctx.saved_tensors
        group = ctx.group
        gathering = all_gather(x, group, wait=False) if ctx.gather_input else None
        grad_in = None
        for g, w in zip(grad_outs, weights):
            part = g.matmul(w)
            grad_in = part if grad_in is None else grad_in + part
        total = wait(gathering, group) if gathering is not None else x
        grad_in = reducing(ctx, grad_in)
        t2 = total.reshape(-1, total.shape[-1])
        grads = []
        for g, main_grad, has_bias in zip(grad_outs, ctx.main_grads, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])
            grads += [accumulate_grad(main_grad, g2.t().matmul(t2)), g2.sum(dim=0) if has_bias else None]
        if ctx.reduce_grad is not None:
            grad_in = wait(grad_in, group)
        return (grad_in, None, None, None, None, None, *grads)


def shared_input_linears(x, weights, biases, group: TPGroup | None, sequence_parallel: bool,
                         accumulate_unfused: bool, overlap: bool = False) -> tuple:
    """``_SharedInputLinears``: column-parallel linears that read one input (``overlap``: its gather as a ring)."""
    params = [p for pair in zip(weights, biases) for p in pair]
    gather, reduce_grad = column_comm(group, sequence_parallel)
    return _SharedInputLinears.apply(x, group, gather, reduce_grad, accumulate_unfused, bool(overlap and gather),
                                     *params)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One GEMM kernel: x W^T, plus the bias in the GEMM's epilogue when there is one."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.addmm(bias, x2, weight.t()) if bias is not None else x2.mm(weight.t())
    return out.view(*x.shape[:-1], weight.shape[0])


def unfused_main_grad(weight: torch.Tensor, accumulate_unfused: bool) -> torch.Tensor | None:
    """The fp32 buffer a weight's gradient is added into after its GEMM, when the stack has no
    gradient-accumulation fusion (kept on the autograd ctx: saved tensors lose attributes)."""
    return getattr(weight, "main_grad", None) if accumulate_unfused else None


CAST_COPY = "echo_plan_cast_copy"  # a main_grad marked so is added into through an fp32 copy of the gradient


def accumulate_grad(main_grad: torch.Tensor | None, grad_w: torch.Tensor) -> torch.Tensor:
    """Without gradient-accumulation fusion, the DDP hook adds each weight gradient into the fp32
    ``main_grad`` buffer (one elementwise kernel per weight per micro-batch); with it, the GEMM's
    epilogue already did and ``main_grad`` is None here. DeepSpeed's BF16_Optimizer casts the gradient
    to an fp32 copy first and adds that (``hp_grad.add_(lp.grad.to(hp_grad.dtype))``: two kernels),
    where capture marked the buffer (``CAST_COPY``)."""
    if main_grad is not None:
        main_grad.add_(grad_w.to(main_grad.dtype) if getattr(main_grad, CAST_COPY, False) else grad_w)
    return grad_w


def reducing(ctx, grad_in: torch.Tensor) -> torch.Tensor:
    """Launch the reduction of a column-parallel linear's input gradient (``ctx.reduce_grad``: reduce-scatter with
    sequence parallelism, all-reduce without, or none) without waiting: the weight-gradient GEMMs run beside it."""
    if ctx.reduce_grad == "reduce_scatter":
        return reduce_scatter(grad_in, ctx.group, wait=False)
    if ctx.reduce_grad == "all_reduce":
        return all_reduce(grad_in, ctx.group, wait=False)
    return grad_in


def linear_backward(ctx, grad_out):
    """(grad input, grad weight, grad bias, None, None) of a parallel linear, bulk-overlapped as
    Megatron-LM does it (see :class:`_ParallelLinear`)."""
    x, weight = ctx.saved_tensors
    group = ctx.group
    gathering = all_gather(x, group, wait=False) if ctx.gather_input else None
    grad_in = grad_out.matmul(weight)
    total = wait(gathering, group) if gathering is not None else x
    grad_in = reducing(ctx, grad_in)
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    t2 = total.reshape(-1, total.shape[-1])
    grad_w = accumulate_grad(ctx.main_grad, g2.t().matmul(t2))
    grad_b = g2.sum(dim=0) if ctx.has_bias else None
    if ctx.reduce_grad is not None:
        grad_in = wait(grad_in, group)
    return grad_in, grad_w, grad_b, None, None
