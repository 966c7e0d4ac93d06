"""Tensor-parallel linear layers with FP8 (or NVFP4) GEMMs, as Transformer Engine runs them under Megatron-Core.

With ``--dtype fp8`` the transformer layers' linears (QKV, projection, FC1, FC2, MLA's projections,
shared experts) run their three GEMMs in FP8 (``torch._scaled_mm``) and everything else stays bf16
(norms, attention, activations, the embedding and output layer, as Megatron-Core keeps them):

* forward: the input is cast to E4M3 (``fp8_kernels``); with sequence parallelism the FP8 shard is
  all-gathered (half the bytes of bf16), the fprop GEMM takes the FP8 weight and writes bf16, and
  the FP8 input (not the bf16 one) is what autograd saves for backward;
* backward: the output gradient is cast to E5M2 with its transpose (cast-transpose); the dgrad GEMM
  takes the weight's FP8 transpose; the saved FP8 input is re-gathered (sequence parallel) and
  transposed, and the wgrad GEMM multiplies the two transposes (Hopper's FP8 tensor cores take only
  the TN layout);
* the weights are cast (weight and transpose) once per step, on the first micro-batch, and cached
  for the others: ``Fp8State.weight``; with ``fp8_param_gather`` the weight already is FP8 (the
  optimizer writes it) and only its transpose is made;
* the recipe decides the casts: delayed scaling fuses the amax into the cast; current scaling runs
  an amax pass first (and all-reduces it over the TP group when the tensor is then gathered, so all
  ranks share one scale); blockwise scaling writes one scale per 1 x 128 tile (128 x 128 weight
  blocks) and needs no amax pass.

Userbuffers overlap (``overlap.py``) keeps its structure: the ring exchanges carry FP8 chunks.

The recipe's own casts and layouts (Blackwell's transposes-free per-tensor FP8, MXFP8, NVFP4) live in
``quant_state.Fp8State``: the linears below ask it for the operands of their three GEMMs.
"""

from __future__ import annotations

import torch

from echo_plan.trace import fp8_kernels as fk
from echo_plan.trace import mx_kernels as mk
from echo_plan.trace import kernels, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.overlap import RS_SPLITS
from echo_plan.trace.quant_state import Fp8State

__all__ = ["Fp8State", "fp8_column_linear", "fp8_column_linears", "fp8_row_linear", "fp8_grouped_linear"]

Tensor = torch.Tensor


def _ring(q: Tensor, group: TPGroup, gemm) -> tuple[Tensor, list[Tensor]]:
    """GEMMs over the tp FP8 chunks of a userbuffers ring all-gather (``parallel.ring_gather_gemms`` with one
    weight); returns the assembled output and the chunks as they arrived."""
    (out,), arrived = parallel.ring_gather_gemms(q, group, [gemm])
    return out, arrived


def _save_input(ctx, fp8: Fp8State, x: Tensor, q: Tensor, sx: Tensor) -> None:
    """Save the FP8 input and its scales for backward, or the bf16 input itself where the stack keeps
    the original (``Fp8State.keep_original``)."""
    ctx.e5m6 = fp8.takes_e5m6(x)
    ctx.original = fp8.keeps_original(x) and not ctx.e5m6
    if ctx.e5m6:  # DeepSeek: the attention output kept once, as E5M6 (attention's backward reads it too)
        ctx.save_for_backward(fk.fp8_e5m6_cast(x))
        ctx.e5m6_width = x.shape[-1]
    elif ctx.original:
        fp8.save_original(ctx, x)
    else:
        ctx.save_for_backward(q, sx)


def _saved_input(ctx, amax_group: TPGroup | None = None, grouped: bool = False) -> tuple[Tensor, Tensor]:
    """(quantised input, its scales) for the weight-gradient GEMM: as saved, or cast again from the saved
    original (block-scaled recipes: its columnwise copy)."""
    if ctx.e5m6:
        (e,) = ctx.saved_tensors
        return ctx.fp8.e5m6_wgrad_operand(e, ctx.e5m6_width)
    if not ctx.original:
        return ctx.saved_tensors
    (x,) = ctx.saved_tensors
    fp8 = ctx.fp8
    q, qc, sx, sxc = fp8.cast(x if grouped else x.reshape(-1, x.shape[-1]), False, amax_group,
                              transpose=fp8.input_columnwise)
    return (qc, sxc) if fp8.input_columnwise else (q, sx)


def _forward_cast(fp8: Fp8State, x: Tensor, amax_group: TPGroup | None,
                  grouped: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(the forward GEMM's input, its scales, the copy saved for the weight gradient, its scales). A linear that
    keeps its bf16 input makes the weight-gradient copy in backward instead (TE: columnwise usage off).
    ``grouped``: the experts' [E, rows, K] tokens, quantised per expert."""
    columnwise = fp8.input_columnwise and not fp8.keeps_original(x)
    q, qc, sx, sxc = fp8.cast(x if grouped else x.reshape(-1, x.shape[-1]), False, amax_group, transpose=columnwise)
    return (q, sx, qc, sxc) if columnwise else (q, sx, q, sx)


def _gather_scales(fp8: Fp8State, s: Tensor, group: TPGroup) -> Tensor:
    """The scales of a gathered tensor: per-tensor ones are shared already; block scales travel with their rows
    (a second, small all-gather, as TE's MXFP8/NVFP4 all-gathers do)."""
    return parallel.all_gather(s, group) if fp8.block_scaled else s


def _wgrad(ctx, g_col: Tensor, g_scale: Tensor, total: Tensor, x_scale: Tensor) -> Tensor:
    """The weight gradient [N, K] from the gradient's weight-gradient copy and the (gathered) saved input."""
    a, b_t = ctx.fp8.wgrad_operands(g_col, total)
    grad_w = ctx.fp8.gemm(a, b_t, g_scale, x_scale, out_dtype=ctx.wdtype)
    return parallel.accumulate_grad(ctx.main_grad, grad_w)


def _regathered_and_reducing(ctx, gathering, q: Tensor, sx: Tensor, grad_in: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of a column-parallel FP8 linear: wait for the saved input's re-gather (its block scales too), then
    launch the input gradient's reduction, which the weight-gradient GEMMs overlap; returns (input, scales, the
    gradient being reduced)."""
    group = ctx.group
    total = parallel.wait(gathering, group) if gathering is not None else q
    if gathering is not None:
        sx = _gather_scales(ctx.fp8, sx, group)
    return total, sx, parallel.reducing(ctx, grad_in)


class _Fp8Linear(torch.autograd.Function):
    """Column- or row-parallel linear with FP8 GEMMs (see the module docstring); ``overlap``: the input
    all-gather pipelined with the fprop GEMM as userbuffers' ring exchanges (column-parallel only)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, gather_input, reduce_grad, accumulate_unfused, fp8, overlap):
        ctx.group, ctx.gather_input, ctx.reduce_grad, ctx.fp8 = group, gather_input, reduce_grad, fp8
        ctx.has_bias, ctx.main_grad = bias is not None, parallel.unfused_main_grad(weight, accumulate_unfused)
        ctx.wdtype = weight.dtype
        q, sx, kept, skept = _forward_cast(fp8, x, group if gather_input else None)
        w8, w8t, sw = fp8.weight(weight)
        n = weight.shape[0]
        if overlap:
            out, _ = _ring(q, group, lambda a: fp8.gemm(a, w8, sx, sw, bias, x.dtype, weight=True))
        else:
            total = parallel.all_gather(q, group) if gather_input else q
            s_total = _gather_scales(fp8, sx, group) if gather_input else sx
            out = fp8.gemm(total, w8, s_total, sw, bias, x.dtype, weight=True)
        ctx.fp8_weight = (w8t, sw)  # a per-step copy, not an activation: kept off the saved tensors
        _save_input(ctx, fp8, x, kept, skept)
        return out.view(-1, *x.shape[1:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        group, fp8 = ctx.group, ctx.fp8
        q, sx = _saved_input(ctx, group if ctx.gather_input else None)
        w8t, sw = ctx.fp8_weight
        w8t = ctx.fp8.dgrad_weight(w8t)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq, g_t, sg, sg_t = fp8.cast(g2, True, transpose=True)
        gathering = parallel.all_gather(q, group, wait=False) if ctx.gather_input else None
        grad_in = fp8.gemm(gq, w8t, sg, sw, out_dtype=grad_out.dtype, weight=True)
        grad_in = grad_in.view(*grad_out.shape[:-1], w8t.shape[0])
        total, sx, grad_in = _regathered_and_reducing(ctx, gathering, q, sx, grad_in)
        grad_w = _wgrad(ctx, g_t, sg_t, total, sx)
        grad_b = g2.sum(dim=0) if ctx.has_bias else None
        if ctx.reduce_grad is not None:
            grad_in = parallel.wait(grad_in, group)
        return grad_in, grad_w, grad_b, None, None, None, None, None, None


class _Fp8PipelinedReduceScatterLinear(torch.autograd.Function):
    """Row-parallel FP8 linear with userbuffers: the output reduce-scatter pipelined with the fprop GEMM
    in chunks; in backward the FP8 output gradient is ring-gathered beside the dgrad GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, group, accumulate_unfused, fp8):
        ctx.group, ctx.fp8, ctx.wdtype = group, fp8, weight.dtype
        ctx.main_grad = parallel.unfused_main_grad(weight, accumulate_unfused)
        q, sx, kept, skept = _forward_cast(fp8, x, None)
        w8, w8t, sw = fp8.weight(weight)
        s = x.shape[0]
        splits = RS_SPLITS if s % (RS_SPLITS * group.size) == 0 else 1
        rows = q.shape[0] // splits
        block_rows = sx.dim() >= 1 and sx.shape[0] == q.shape[0]  # block scales: one row of them per row of q
        pending = [parallel.reduce_scatter(fp8.gemm(q[i * rows:(i + 1) * rows], w8,
                                                    sx[i * rows:(i + 1) * rows] if block_rows else sx, sw, None,
                                                    x.dtype, weight=True)
                                           .view(s // splits, *x.shape[1:-1], weight.shape[0]), group, wait=False)
                   for i in range(splits)]
        ctx.fp8_weight = (w8t, sw)
        _save_input(ctx, fp8, x, kept, skept)
        return kernels.assemble([parallel.wait(p, group) for p in pending])

    @staticmethod
    def backward(ctx, grad_out):
        q, sx = _saved_input(ctx)
        w8t, sw = ctx.fp8_weight
        w8t = ctx.fp8.dgrad_weight(w8t)
        group, fp8 = ctx.group, ctx.fp8
        gq, gc, sg, sgc = fp8.cast(grad_out.reshape(-1, grad_out.shape[-1]), True, group, transpose=fp8.block_scaled)
        k = w8t.shape[0]
        grad_in, arrived = _ring(gq, group, lambda a: fp8.gemm(a, w8t, sg, sw, out_dtype=grad_out.dtype, weight=True))
        full = kernels.assemble(arrived)  # the gathered FP8 gradient, kept for the weight gradient
        if fp8.block_scaled:  # the weight gradient reads its own (columnwise) copy, gathered beside the ring
            g_col, sg = parallel.all_gather(gc, group), _gather_scales(fp8, sgc, group)
        else:  # per-tensor: the gathered rows themselves, transposed where the GEMM takes only TN
            g_col = fk.fp8_transpose(full) if fp8.transposes else full
        grad_w = _wgrad(ctx, g_col, sg, q, sx)
        return grad_in.view(-1, *grad_out.shape[1:-1], k), grad_w, None, None, None


def fp8_column_linear(x, weight, bias, group: TPGroup | None, sequence_parallel: bool, accumulate_unfused: bool,
                      overlap: bool, fp8: Fp8State) -> Tensor:
    """``linears.column_parallel_linear`` with FP8 GEMMs."""
    gather, reduce_grad = parallel.column_comm(group, sequence_parallel)
    return _Fp8Linear.apply(x, weight, bias, group, gather, reduce_grad, accumulate_unfused, fp8, bool(overlap and gather))


def fp8_row_linear(x, weight, group: TPGroup | None, sequence_parallel: bool, accumulate_unfused: bool,
                   overlap: bool, fp8: Fp8State) -> Tensor:
    """``linears.row_parallel_linear`` with FP8 GEMMs (its output reduced as the bf16 one is)."""
    if overlap and sequence_parallel and group is not None:
        return _Fp8PipelinedReduceScatterLinear.apply(x, weight, group, accumulate_unfused, fp8)
    out = _Fp8Linear.apply(x, weight, None, group, False, None, accumulate_unfused, fp8, False)
    return parallel.reduce_scatter_to_sp(out, group) if sequence_parallel else parallel.reduce_from_tp(out, group)


class _Fp8SharedInputLinears(torch.autograd.Function):
    """Several column-parallel FP8 linears on one input, a GEMM and a weight each (``fused_projections`` off):
    the input is cast once (and with sequence parallelism all-gathered once, in FP8), as torchtitan's
    ``PrepareFloat8ModuleInput`` does for wq/wk/wv and w1/w3 under TP (and torch.compile's common-subexpression
    elimination of their identical casts without); one saved input serves every weight gradient, and the input
    gradients of the GEMMs are summed before one reduction."""

    @staticmethod
    def forward(ctx, x, group, gather_input, reduce_grad, accumulate_unfused, fp8, overlap, *weights):
        ctx.group, ctx.gather_input, ctx.reduce_grad, ctx.fp8 = group, gather_input, reduce_grad, fp8
        ctx.wdtype = weights[0].dtype
        ctx.main_grads = [parallel.unfused_main_grad(w, accumulate_unfused) for w in weights]
        q, sx, kept, skept = _forward_cast(fp8, x, group if gather_input else None)
        cast = [fp8.weight(w) for w in weights]
        ctx.fp8_weights = [(w8t, sw) for _, w8t, sw in cast]
        _save_input(ctx, fp8, x, kept, skept)
        if overlap:  # the FP8 chunks travel the ring beside every weight's GEMM (as ``_Fp8Linear`` with one)
            outs, _ = parallel.ring_gather_gemms(q, group, [lambda a, w8=w8, sw=sw: fp8.gemm(a, w8, sx, sw, None, x.dtype,
                                                                                             weight=True)
                                                            for w8, _, sw in cast])
        else:
            total = parallel.all_gather(q, group) if gather_input else q
            s_total = _gather_scales(fp8, sx, group) if gather_input else sx
            outs = [fp8.gemm(total, w8, s_total, sw, None, x.dtype, weight=True) for w8, _, sw in cast]
        return tuple(o.view(-1, *x.shape[1:-1], w.shape[0]) for o, w in zip(outs, weights))

    @staticmethod
    def backward(ctx, *grad_outs):
        group, fp8 = ctx.group, ctx.fp8
        q, sx = _saved_input(ctx, group if ctx.gather_input else None)
        gathering = parallel.all_gather(q, group, wait=False) if ctx.gather_input else None
        grad_in, wgrad_inputs = None, []
        for grad_out, (w8t, sw) in zip(grad_outs, ctx.fp8_weights):
            w8t = fp8.dgrad_weight(w8t)
            gq, g_t, sg, sg_t = fp8.cast(grad_out.reshape(-1, grad_out.shape[-1]), True, transpose=True)
            part = fp8.gemm(gq, w8t, sg, sw, out_dtype=grad_out.dtype, weight=True)
            grad_in = part if grad_in is None else grad_in + part
            wgrad_inputs.append((g_t, sg_t))
        grad_in = grad_in.view(*grad_outs[0].shape[:-1], ctx.fp8_weights[0][0].shape[0])
        total, sx, grad_in = _regathered_and_reducing(ctx, gathering, q, sx, grad_in)
        grad_ws = []
        for main_grad, (g_t, sg_t) in zip(ctx.main_grads, wgrad_inputs):
            a, b_t = fp8.wgrad_operands(g_t, total)
            grad_ws.append(parallel.accumulate_grad(main_grad, fp8.gemm(a, b_t, sg_t, sx, out_dtype=ctx.wdtype)))
        if ctx.reduce_grad is not None:
            grad_in = parallel.wait(grad_in, group)
        return (grad_in, None, None, None, None, None, None, *grad_ws)


def fp8_column_linears(x, weights, group: TPGroup | None, sequence_parallel: bool, accumulate_unfused: bool,
                       fp8: Fp8State, overlap: bool = False) -> tuple:
    """Column-parallel FP8 linears without biases that share one cast (and gather, with ``overlap`` a ring) of ``x``."""
    gather, reduce_grad = parallel.column_comm(group, sequence_parallel)
    return _Fp8SharedInputLinears.apply(x, group, gather, reduce_grad, accumulate_unfused, fp8, bool(overlap and gather),
                                        *weights)


class _Fp8GroupedLinear(torch.autograd.Function):
    """Local experts' linear in FP8, batched like the bf16 path's ``bmm`` (Transformer Engine's
    GroupedLinear): ``x`` [E, rows, K] @ ``weight`` [E, K, N]. One cast of every expert's tokens (its
    multi-tensor cast), one FP8 grouped GEMM (``torch._scaled_grouped_mm``); backward: one cast-transpose
    of the gradient, one transpose of the saved FP8 input, a grouped dgrad and a grouped wgrad GEMM.
    The grouped GEMMs take row-wise scale tensors whatever the recipe (what torch's grouped kernel
    accepts); the recipe still decides the casts."""

    @staticmethod
    def forward(ctx, x, weight, fp8):
        ctx.fp8, ctx.wdtype = fp8, weight.dtype
        if fp8.block_scaled:  # MXFP8 / NVFP4: both copies of the tokens from bf16, block-scaled grouped GEMMs
            q, sx, kept, skept = _forward_cast(fp8, x, None, grouped=True)
            w_t8, w8, sw = fp8.weight(weight, grouped=True)
            ctx.fp8_weight = (w8, sw)
            _save_input(ctx, fp8, x, kept, skept)
            return fp8.grouped_gemm(q, w_t8, sx, sw, x.dtype)
        q, sx = fp8.input_cast(x)
        w_t8, w8, _ = fp8.weight(weight, grouped=True)
        ctx.fp8_weight = w8
        _save_input(ctx, fp8, x, q, sx)
        return _grouped_gemm(q, w_t8, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.fp8.block_scaled:
            return _block_scaled_grouped_backward(ctx, grad_out)
        q, _ = _saved_input(ctx, grouped=True)
        fp8 = ctx.fp8
        gq, g_t, _, _ = fp8.cast(grad_out.contiguous(), True, transpose=True)
        # the gradient is E5M2 (HYBRID); torch's grouped FP8 kernel takes E4M3 only, so its operands are
        # reinterpreted (a view: same bytes, no kernel) to pass torch's checks
        gq, g_t = gq.view(fk.E4M3), g_t.view(fk.E4M3)
        grad_in = _grouped_gemm(gq, fp8.dgrad_weight(ctx.fp8_weight), grad_out.dtype)  # g [E, r, N] @ w[e]^T
        if not fp8.transposes:  # the grouped GEMM takes any layout: x^T and g as they are, no transposes
            scales = q.new_empty((q.shape[0],), dtype=torch.float32)  # one per expert
            grad_w = mk.mx_scaled_grouped_mm(q.transpose(-2, -1), g_t, scales, scales, ctx.wdtype, q.shape[-2])
        else:
            grad_w = _grouped_gemm(fk.fp8_transpose(q), g_t, ctx.wdtype)  # x^T [E, K, r] @ g [E, r, N]
        return grad_in, grad_w, None


def _block_scaled_grouped_backward(ctx, grad_out):
    """The experts' input and weight gradients in MXFP8 / NVFP4: the gradient's rowwise copy against the weight's
    columnwise one, and the two columnwise copies (tokens along the GEMM's depth) for the weight gradient."""
    fp8 = ctx.fp8
    q, sx = _saved_input(ctx, grouped=True)
    w8, sw = ctx.fp8_weight
    gq, gc, sg, sgc = fp8.cast(grad_out.contiguous(), True, transpose=True)
    grad_in = fp8.grouped_gemm(gq, w8, sg, sw, grad_out.dtype)  # g [E, r, N] @ w[e]^T
    grad_w = fp8.grouped_gemm(q.transpose(-2, -1), gc.transpose(-2, -1), sx, sgc, ctx.wdtype)  # x^T g
    return grad_in, grad_w, None


def _grouped_gemm(a: Tensor, b_t: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [E, M, K] @ b_t[e]^T for every group, b_t [E, N, K] row-major (the column-major operand)."""
    e, m, _ = a.shape
    n = b_t.shape[1]
    return torch._scaled_grouped_mm(a, b_t.transpose(-2, -1), a.new_empty((e, m), dtype=torch.float32),
                                    a.new_empty((e, n), dtype=torch.float32), out_dtype=out_dtype)


def fp8_grouped_linear(x: Tensor, weight: Tensor, fp8: Fp8State) -> Tensor:
    """x [E, rows, K] @ weight[e] for each local expert (``torch.bmm``), in FP8."""
    return _Fp8GroupedLinear.apply(x, weight, fp8)
