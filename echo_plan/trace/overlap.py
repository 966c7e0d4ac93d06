"""Tensor-parallel communication pipelined with the GEMMs, as Transformer Engine's userbuffers run it.

With sequence parallelism a column-parallel linear needs its input all-gathered and a
row-parallel linear reduce-scatters its output. NeMo's ``tp_comm_overlap`` (documentation,
"Tensor-parallel Communication Overlap"; per-GEMM settings in its userbuffers configs for H100)
hides them:

* AG + GEMM (QKV and FC1 forward, projection and FC2 input-gradient): the all-gather becomes
  tp - 1 ring exchanges; at each step the GEMM runs on the chunk in hand while the next chunk
  travels (``RingExchangeOverlapCfg``).
* GEMM + RS (projection and FC2 forward): the GEMM is split into ``RS_SPLITS`` chunks along the
  sequence and each chunk's reduce-scatter starts as soon as the chunk is done, so only the last
  one is exposed (``PipelineOverlapCfg(num_splits=4)``).
* The other two (the input re-gather beside the input-gradient GEMM, the input-gradient
  reduce-scatter beside the weight-gradient GEMM) are bulk overlaps, which the plain linear's
  backward already arranges (``parallel.linear_backward``).

The chunked ops are recorded like any other: smaller GEMMs (the compute model sees their shapes),
point-to-point transfers and chunked reduce-scatters on the TP stream, and the dependencies that
let the level-1 replay run them side by side.
"""

from __future__ import annotations

import torch

from echo_plan.trace import kernels, parallel
from echo_plan.trace.fake_pg import TPGroup

RS_SPLITS = 4  # NeMo userbuffers configs (H100): PipelineOverlapCfg(num_splits=4) for proj_fprop / fc2_fprop


def _ring_gemm(chunk: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup,
               transpose_weight: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """GEMMs over the tp chunks of a ring all-gather, each writing its rows of one output buffer.

    Returns the output and the chunks as they arrived (the gathered tensor, chunk by chunk)."""
    tp = group.size
    rows = chunk.shape[0]
    w = weight.t() if transpose_weight else weight
    n = w.shape[1]
    out = chunk.new_empty((rows * tp, *chunk.shape[1:-1], n))
    arrived = []
    cur = chunk
    for i in range(tp):
        nxt = kernels.ring_exchange(cur, tp) if i + 1 < tp else None
        dst = out[i * rows:(i + 1) * rows].view(-1, n)
        a = cur.reshape(-1, cur.shape[-1])
        if bias is not None:
            torch.addmm(bias, a, w, out=dst)
        else:
            torch.mm(a, w, out=dst)
        arrived.append(cur)
        cur = nxt
    return out, arrived


class _RingGatherLinear(torch.autograd.Function):
    """Column-parallel linear whose input all-gather is pipelined with the GEMM (ring exchange)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, accumulate_unfused):
        ctx.group, ctx.gather_input, ctx.reduce_grad = group, True, "reduce_scatter"
        ctx.has_bias, ctx.main_grad = bias is not None, parallel.unfused_main_grad(weight, accumulate_unfused)
        ctx.save_for_backward(x, weight)
        return _ring_gemm(x, weight, bias, group)[0]

    @staticmethod
    def backward(ctx, grad_out):
        return parallel.linear_backward(ctx, grad_out)  # bulk overlaps, as without userbuffers


class _PipelinedReduceScatterLinear(torch.autograd.Function):
    """Row-parallel linear whose output reduce-scatter is pipelined with the GEMM in chunks; in
    backward the incoming gradient's all-gather is pipelined with the input-gradient GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group, accumulate_unfused):
        ctx.group, ctx.main_grad = group, parallel.unfused_main_grad(weight, accumulate_unfused)
        ctx.save_for_backward(x, weight)
        s = x.shape[0]
        splits = RS_SPLITS if s % (RS_SPLITS * group.size) == 0 else 1
        rows = s // splits
        pending = [parallel.reduce_scatter(parallel.linear(x[i * rows:(i + 1) * rows], weight, None), group,
                                           wait=False) for i in range(splits)]
        return kernels.assemble([parallel.wait(p, group) for p in pending])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in, arrived = _ring_gemm(grad_out, weight, None, ctx.group, transpose_weight=False)
        full = kernels.assemble(arrived)  # the gathered gradient, kept for the weight gradient
        g2 = full.reshape(-1, full.shape[-1])
        grad_w = parallel.accumulate_grad(ctx.main_grad, g2.t().matmul(x.reshape(-1, x.shape[-1])))
        return grad_in, grad_w, None, None


def ring_gather_linear(x, weight, bias, group: TPGroup, accumulate_unfused: bool):
    return _RingGatherLinear.apply(x, weight, bias, group, accumulate_unfused)


def pipelined_reduce_scatter_linear(x, weight, group: TPGroup, accumulate_unfused: bool):
    return _PipelinedReduceScatterLinear.apply(x, weight, group, accumulate_unfused)
