"""Tensor-parallel linear layers with FP8 GEMMs, as Transformer Engine runs them under Megatron-Core.

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
"""

from __future__ import annotations

from typing import Protocol

import torch

from echo_plan.specs.software import Fp8Recipe
from echo_plan.trace import fp8_kernels as fk
from echo_plan.trace import kernels, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.overlap import RS_SPLITS

Tensor = torch.Tensor


class SavedMeter(Protocol):
    """What FP8 linears need of the saved-activation count (``capture.SavedBytesMeter``)."""

    def holds(self, t: Tensor) -> bool: ...

    def discard(self, t: Tensor) -> None: ...


class Fp8State:
    """One traced stage's FP8 recipe and the FP8 weight copies made on its first micro-batch."""

    def __init__(self, recipe: Fp8Recipe, param_gather: bool, save_original: bool = False,
                 meter: SavedMeter | None = None) -> None:
        self.recipe, self.param_gather = Fp8Recipe(recipe), bool(param_gather)
        self._weights: dict[tuple, tuple[Tensor, ...]] = {}  # (storage, offset, shape) -> (weight, w8, w8 t, scale)
        self.keeps_originals = bool(save_original)  # the stack's fp8_save_original_input
        self._meter = meter  # the saved-activation count (capture.SavedBytesMeter)
        self._originals: dict[int, bool] = {}  # storage -> whether its bytes are already counted elsewhere
        self._quantized: set[int] = set()  # storages standing for rows that arrived in FP8

    @property
    def delayed(self) -> bool:
        return self.recipe is Fp8Recipe.DELAYED

    def keep_original(self, t: Tensor, counted_elsewhere: bool = False) -> None:
        """A linear that reads ``t`` saves ``t`` itself for backward, not its FP8 copy, and casts it again
        there (Megatron-Core's ``set_save_original_input``; only with the stack's ``fp8_save_original_input``).
        ``counted_elsewhere``: the same data is already saved by another op in the framework (the attention
        core's output, laid out here by a copy), so the linear's saved input adds no bytes."""
        if self.keeps_originals:
            self._originals[t.untyped_storage()._cdata] = counted_elsewhere

    def arrived_quantized(self, x: Tensor) -> None:
        """``x`` stands for rows that arrived in FP8 with their scales (an FP8 dispatch): a linear reading it
        takes them as they are, with no cast of its own."""
        self._quantized.add(x.untyped_storage()._cdata)

    def input_cast(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(FP8 input, its scales) of a linear's forward: cast now, or as it arrived (``arrived_quantized``)."""
        if x.untyped_storage()._cdata not in self._quantized:
            q, _, sx, _ = self.cast(x, False)
            return q, sx
        tiles = (*x.shape[:-1], -(-x.shape[-1] // fk.BLOCK)) if self.blockwise else ()
        return x.new_empty(x.shape, dtype=fk.E4M3), x.new_empty(tiles, dtype=torch.float32)

    def keeps_original(self, x: Tensor) -> bool:
        return x.untyped_storage()._cdata in self._originals

    def save_original(self, ctx, x: Tensor) -> None:
        """Save ``x`` for a linear's backward; a copy of data counted elsewhere adds no bytes (the same storage
        is counted once anyway)."""
        copy = (self._originals.get(x.untyped_storage()._cdata, False) and self._meter is not None
                and not self._meter.holds(x))
        ctx.save_for_backward(x)
        if copy:
            self._meter.discard(x)

    @property
    def blockwise(self) -> bool:
        return self.recipe is Fp8Recipe.BLOCKWISE

    def weight(self, w: Tensor, grouped: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """(FP8 weight, its FP8 transpose, scale-inverse), cast once per step and reused (by recomputation
        too). ``w`` is [N, K] (y = x w^T); ``grouped``: experts' [E, K, N] (y = x @ w[e]), giving
        (w^T [E, N, K], w [E, K, N], scales) in FP8."""
        key = (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape), grouped)
        hit = self._weights.get(key)
        if hit is not None:
            return hit[1], hit[2], hit[3]
        scale = w.new_empty((), dtype=torch.float32)
        if self.param_gather:  # the parameter is stored in FP8 by the optimizer: only its transpose is new
            shape = (w.shape[0], w.shape[2], w.shape[1]) if grouped else tuple(w.shape)
            w8 = w.new_empty(shape, dtype=fk.E4M3)
            blocks = -(-shape[-2] // fk.BLOCK) * -(-shape[-1] // fk.BLOCK) if self.blockwise else 1
            out = (w8, fk.fp8_weight_transpose(w8), w.new_empty((w.shape[0], blocks) if grouped else
                                                                 ((blocks,) if self.blockwise else ()),
                                                                 dtype=torch.float32))
        elif grouped:
            out = fk.fp8_grouped_weight_cast(w.detach(), scale, self.blockwise)
        else:
            out = fk.fp8_weight_cast(w.detach(), scale, self.blockwise)
        self._weights[key] = (w, *out)  # holds w, so its storage (the key) stays its own
        return out

    def cast(self, x2: Tensor, grad: bool, amax_group: TPGroup | None = None,
             transpose: bool = False) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """(q, q transposed or None, scale-inverse of q, of the transpose) of a 2-D bf16 tensor: E4M3
        for activations, E5M2 for gradients. ``amax_group``: the tensor is gathered over it next."""
        if self.blockwise:
            q, s, qt, st = fk.fp8_block_cast(x2, grad, transpose)
            return q, (qt if transpose else None), s, (st if transpose else None)
        scale = x2.new_empty((), dtype=torch.float32)  # delayed: from the amax history (no kernel now)
        if self.recipe is Fp8Recipe.CURRENT:
            scale = fk.fp8_amax(x2)
            if amax_group is not None:
                scale = parallel.all_reduce(scale, amax_group, op="max")
        if transpose:
            q, qt, _ = fk.fp8_cast_transpose(x2, scale, grad)
            return q, qt, scale, scale
        q, _ = fk.fp8_cast(x2, scale, grad)
        return q, None, scale, None

    def gemm(self, a: Tensor, b_t: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, weight: bool = False) -> Tensor:
        """a @ b_t^T on FP8 tensor cores, both operands row-major (the TN layout); output ``out_dtype``.
        Blockwise: ``a`` in 1 x 128 tiles along K, ``b_t`` in 128 x 128 blocks (``weight``) or 1 x 128
        tiles; the scale tensors of those shapes stand for the ones the quantizer wrote."""
        if self.blockwise:
            (m, k), n = a.shape, b_t.shape[0]
            kb = -(-k // fk.BLOCK)
            scale_a = a.new_empty((m, kb), dtype=torch.float32)
            scale_b = a.new_empty((kb, -(-n // fk.BLOCK) if weight else n), dtype=torch.float32)
        return torch._scaled_mm(a, b_t.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def _ring(q: Tensor, group: TPGroup, gemm) -> tuple[Tensor, list[Tensor]]:
    """GEMMs over the tp FP8 chunks of a userbuffers ring all-gather (``overlap._ring_gemm`` in FP8),
    each writing its rows of one output buffer; returns it and the chunks as they arrived."""
    tp = group.size
    parts, arrived, cur = [], [], q
    for i in range(tp):
        nxt = kernels.ring_exchange(cur, tp) if i + 1 < tp else None
        parts.append(gemm(cur))
        arrived.append(cur)
        cur = nxt
    return kernels.assemble(parts), arrived


def _save_input(ctx, fp8: Fp8State, x: Tensor, q: Tensor, sx: Tensor) -> None:
    """Save the FP8 input and its scales for backward, or the bf16 input itself where the stack keeps
    the original (``Fp8State.keep_original``)."""
    ctx.original = fp8.keeps_original(x)
    if ctx.original:
        fp8.save_original(ctx, x)
    else:
        ctx.save_for_backward(q, sx)


def _saved_input(ctx, amax_group: TPGroup | None = None, grouped: bool = False) -> tuple[Tensor, Tensor]:
    """(FP8 input, its scales) for the backward GEMMs: as saved, or cast again from the saved original."""
    if not ctx.original:
        return ctx.saved_tensors
    (x,) = ctx.saved_tensors
    q, _, sx, _ = ctx.fp8.cast(x if grouped else x.reshape(-1, x.shape[-1]), False, amax_group)
    return q, sx


def _wgrad(ctx, g_t: Tensor, g_scale: Tensor, total: Tensor, x_scale: Tensor) -> Tensor:
    """The weight gradient [N, K] from the gradient's FP8 transpose and the (gathered) FP8 input."""
    x_t = fk.fp8_transpose(total)
    grad_w = ctx.fp8.gemm(g_t, x_t, g_scale, x_scale, out_dtype=ctx.wdtype)
    return parallel.accumulate_grad(ctx.main_grad, grad_w)


class _Fp8Linear(torch.autograd.Function):
    """Column- or row-parallel linear with FP8 GEMMs (see the module docstring); ``overlap``: the input
    all-gather pipelined with the fprop GEMM as userbuffers' ring exchanges (column-parallel only)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, gather_input, reduce_grad, accumulate_unfused, fp8, overlap):
        ctx.group, ctx.gather_input, ctx.reduce_grad, ctx.fp8 = group, gather_input, reduce_grad, fp8
        ctx.has_bias, ctx.main_grad = bias is not None, parallel.unfused_main_grad(weight, accumulate_unfused)
        ctx.wdtype, ctx.x_shape = weight.dtype, x.shape
        q, _, sx, _ = fp8.cast(x.reshape(-1, x.shape[-1]), False, group if gather_input else None)
        w8, w8t, sw = fp8.weight(weight)
        n = weight.shape[0]
        if overlap:
            out, _ = _ring(q, group, lambda a: fp8.gemm(a, w8, sx, sw, bias, x.dtype, weight=True))
        else:
            total = parallel.all_gather(q, group) if gather_input else q
            out = fp8.gemm(total, w8, sx, sw, bias, x.dtype, weight=True)
        ctx.fp8_weight = (w8t, sw)  # a per-step copy, not an activation: kept off the saved tensors
        _save_input(ctx, fp8, x, q, sx)
        return out.view(-1, *x.shape[1:-1], n)

    @staticmethod
    def backward(ctx, grad_out):
        group, fp8 = ctx.group, ctx.fp8
        q, sx = _saved_input(ctx, group if ctx.gather_input else None)
        w8t, sw = ctx.fp8_weight
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq, g_t, sg, sg_t = fp8.cast(g2, True, transpose=True)
        gathering = parallel.all_gather(q, group, wait=False) if ctx.gather_input else None
        grad_in = fp8.gemm(gq, w8t, sg, sw, out_dtype=grad_out.dtype, weight=True)
        grad_in = grad_in.view(*grad_out.shape[:-1], w8t.shape[0])
        total = parallel.wait(gathering, group) if gathering is not None else q
        if ctx.reduce_grad == "reduce_scatter":
            grad_in = parallel.reduce_scatter(grad_in, group, wait=False)
        elif ctx.reduce_grad == "all_reduce":
            grad_in = parallel.all_reduce(grad_in, group, wait=False)
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
        q, _, sx, _ = fp8.cast(x.reshape(-1, x.shape[-1]), False)
        w8, w8t, sw = fp8.weight(weight)
        s = x.shape[0]
        splits = RS_SPLITS if s % (RS_SPLITS * group.size) == 0 else 1
        rows = q.shape[0] // splits
        pending = [parallel.reduce_scatter(fp8.gemm(q[i * rows:(i + 1) * rows], w8, sx, sw, None, x.dtype, weight=True)
                                           .view(s // splits, *x.shape[1:-1], weight.shape[0]), group, wait=False)
                   for i in range(splits)]
        ctx.fp8_weight = (w8t, sw)
        _save_input(ctx, fp8, x, q, sx)
        return kernels.assemble([parallel.wait(p, group) for p in pending])

    @staticmethod
    def backward(ctx, grad_out):
        q, sx = _saved_input(ctx)
        w8t, sw = ctx.fp8_weight
        group, fp8 = ctx.group, ctx.fp8
        gq, _, sg, _ = fp8.cast(grad_out.reshape(-1, grad_out.shape[-1]), True, group)
        k = w8t.shape[0]
        grad_in, arrived = _ring(gq, group, lambda a: fp8.gemm(a, w8t, sg, sw, out_dtype=grad_out.dtype, weight=True))
        full = kernels.assemble(arrived)  # the gathered FP8 gradient, kept for the weight gradient
        grad_w = _wgrad(ctx, fk.fp8_transpose(full), sg, q, sx)
        return grad_in.view(-1, *grad_out.shape[1:-1], k), grad_w, None, None, None


def fp8_column_linear(x, weight, bias, group: TPGroup | None, sequence_parallel: bool, accumulate_unfused: bool,
                      overlap: bool, fp8: Fp8State) -> Tensor:
    """``linears.column_parallel_linear`` with FP8 GEMMs."""
    if group is None:
        return _Fp8Linear.apply(x, weight, bias, None, False, None, accumulate_unfused, fp8, False)
    reduce_grad = "reduce_scatter" if sequence_parallel else "all_reduce"
    return _Fp8Linear.apply(x, weight, bias, group, sequence_parallel, reduce_grad, accumulate_unfused, fp8,
                            bool(overlap and sequence_parallel))


def fp8_row_linear(x, weight, group: TPGroup | None, sequence_parallel: bool, accumulate_unfused: bool,
                   overlap: bool, fp8: Fp8State) -> Tensor:
    """``linears.row_parallel_linear`` with FP8 GEMMs (its output reduced as the bf16 one is)."""
    if overlap and sequence_parallel and group is not None:
        return _Fp8PipelinedReduceScatterLinear.apply(x, weight, group, accumulate_unfused, fp8)
    out = _Fp8Linear.apply(x, weight, None, group, False, None, accumulate_unfused, fp8, False)
    return parallel.reduce_scatter_to_sp(out, group) if sequence_parallel else parallel.reduce_from_tp(out, group)


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
        q, sx = fp8.input_cast(x)
        w_t8, w8, _ = fp8.weight(weight, grouped=True)
        ctx.fp8_weight = w8
        _save_input(ctx, fp8, x, q, sx)
        return _grouped_gemm(q, w_t8, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, _ = _saved_input(ctx, grouped=True)
        gq, g_t, _, _ = ctx.fp8.cast(grad_out.contiguous(), True, transpose=True)
        # the gradient is E5M2 (HYBRID); torch's grouped FP8 kernel takes E4M3 only, so its operands are
        # reinterpreted (a view: same bytes, no kernel) to pass torch's checks
        gq, g_t = gq.view(fk.E4M3), g_t.view(fk.E4M3)
        grad_in = _grouped_gemm(gq, ctx.fp8_weight, grad_out.dtype)  # g [E, r, N] @ w[e]^T
        grad_w = _grouped_gemm(fk.fp8_transpose(q), g_t, ctx.wdtype)  # x^T [E, K, r] @ g [E, r, N]
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
