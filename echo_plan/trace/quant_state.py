"""One traced stage's low-precision recipe: which casts a linear layer's GEMMs need, in which layouts.

Transformer Engine quantises the two operands of each of a linear's three GEMMs (forward: input x weight;
input gradient: output gradient x weight; weight gradient: output gradient x input, contracted over the
tokens). How it does so is the recipe's, and the GPU's:

* per-tensor FP8 (``delayed``, ``current``): one scale per tensor. Hopper's FP8 tensor cores take only the
  TN layout, so TE keeps FP8 transposes (a weight's, once per step; a gradient's, written beside it by a
  cast-transpose; a saved input's, made in backward); on sm100 and newer the GEMMs take any layout and no
  transpose exists (TE ``nvte_is_non_tn_fp8_gemm_supported``; the stack's ``fp8_transposes``, which
  simulate resolves from the GPU);
* ``blockwise`` (DeepSeek-V3): 1 x 128 tiles of activations and gradients, 128 x 128 weight blocks, the
  weight-gradient operands quantised along the other direction (traced as transposes);
* ``mxfp8``: E4M3 in blocks of 32 along the contraction, E8M0 scales; a tensor read along both
  directions is quantised twice from bf16, in one kernel (``mx_kernels``);
* NVFP4 (plan dtype fp4): E2M1 in blocks of 16 with E4M3 scales and a per-tensor fp32 scale (an amax pass
  first), 16 x 16 weight blocks, the weight-gradient operands Hadamard-transformed (``mx_kernels``).

``cast`` returns the rowwise copy (the forward and input-gradient GEMMs' operand) and, when asked, the
columnwise one (the weight-gradient GEMM's); ``weight`` a weight's forward and input-gradient operands;
``wgrad_operands`` the weight-gradient GEMM's two operands; ``gemm`` runs one GEMM in TN form.
"""

from __future__ import annotations

from typing import Protocol

import torch

from echo_plan.specs.software import Fp8Kernels, Fp8Recipe
from echo_plan.trace import fp8_kernels as fk
from echo_plan.trace import mx_kernels as mk
from echo_plan.trace import parallel
from echo_plan.trace.fake_pg import TPGroup

Tensor = torch.Tensor


class SavedMeter(Protocol):
    """What low-precision linears need of the saved-activation count (``capture.SavedBytesMeter``)."""

    def holds(self, t: Tensor) -> bool: ...

    def discard(self, t: Tensor) -> None: ...


class Fp8State:
    """One traced stage's FP8 or NVFP4 recipe and the weight copies made on its first micro-batch.

    ``recipe``: the FP8 recipe, or None for NVFP4 (plan dtype fp4). ``param_gather``: the weights are kept in
    the low precision by the optimizer (``fp8_param_gather`` / ``fp4_param_gather``). ``transposes``: per-tensor
    FP8 keeps FP8 transposes (the TN-only GEMMs of Hopper)."""

    def __init__(self, recipe: Fp8Recipe | None, param_gather: bool, save_original: bool = False,
                 meter: SavedMeter | None = None, transposes: bool = True,
                 kernels: Fp8Kernels = Fp8Kernels.TRANSFORMER_ENGINE, attention_output_e5m6: bool = False) -> None:
        self.recipe = None if recipe is None else Fp8Recipe(recipe)
        blockwise = self.recipe is Fp8Recipe.BLOCKWISE  # DeepSeek's kernels and E5M6 copy exist only beside its recipe
        self.deepseek_kernels = blockwise and Fp8Kernels(kernels) is Fp8Kernels.DEEPSEEK
        self.attention_output_e5m6 = blockwise and bool(attention_output_e5m6)
        self.param_gather = bool(param_gather)
        self.transposes = bool(transposes) or self.recipe is Fp8Recipe.BLOCKWISE
        self._weights: dict[tuple, tuple[Tensor, ...]] = {}  # (storage, offset, shape, grouped) -> (w, operands)
        self.keeps_originals = bool(save_original)  # the stack's fp8_save_original_input
        self._meter = meter  # the saved-activation count (capture.SavedBytesMeter)
        self._originals: dict[int, bool] = {}  # storage -> whether its bytes are already counted elsewhere
        self._quantized: set[int] = set()  # storages standing for rows that arrived in FP8
        self._e5m6: set[int] = set()  # storages a linear keeps for backward as their E5M6 copy
        self._columnwise: set[int] = set()  # saved inputs re-cast per channel: already the wgrad GEMM's operand

    # -- what the recipe is -----------------------------------------------------------------------------------

    @property
    def nvfp4(self) -> bool:
        return self.recipe is None

    @property
    def mx(self) -> bool:
        return self.recipe is Fp8Recipe.MXFP8

    @property
    def delayed(self) -> bool:
        return self.recipe is Fp8Recipe.DELAYED

    @property
    def blockwise(self) -> bool:
        return self.recipe is Fp8Recipe.BLOCKWISE

    @property
    def block_scaled(self) -> bool:
        """MXFP8 or NVFP4: each direction of a tensor is its own quantised copy, made in forward."""
        return self.mx or self.nvfp4

    @property
    def input_columnwise(self) -> bool:
        """The forward cast also writes the input's weight-gradient copy (saved instead of the rowwise one)."""
        return self.block_scaled

    # -- saved originals and arrived rows (unchanged by the recipe) ---------------------------------------------

    def keep_original(self, t: Tensor, counted_elsewhere: bool = False) -> None:
        """A linear that reads ``t`` saves ``t`` itself for backward, not its quantised copy, and casts it again
        there (Megatron-Core's ``set_save_original_input``; only with the stack's ``fp8_save_original_input``).
        ``counted_elsewhere``: the same data is already saved by another op in the framework (the attention
        core's output, laid out here by a copy), so the linear's saved input adds no bytes."""
        if self.keeps_originals:
            self._originals[t.untyped_storage()._cdata] = counted_elsewhere

    def keep_e5m6(self, t: Tensor) -> None:
        """A linear that reads ``t`` keeps it for backward as DeepSeek's E5M6 copy (the stack's
        ``fp8_attention_output_e5m6``; no-op without it)."""
        if self.attention_output_e5m6:
            self._e5m6.add(t.untyped_storage()._cdata)

    def takes_e5m6(self, x: Tensor) -> bool:
        """Whether the linear reading ``x`` keeps it as E5M6; the mark is used once (a storage's id may be reused by
        a later tensor once this one is freed)."""
        key = x.untyped_storage()._cdata
        if key not in self._e5m6:
            return False
        self._e5m6.discard(key)
        return True

    def e5m6_wgrad_operand(self, e: Tensor, n: int) -> tuple[Tensor, Tensor]:
        """Backward of a linear that kept its input as E5M6 ``e`` (last dimension ``n`` wide): the cast back to
        bf16, then the weight-gradient copy cast per channel from it; returned as [T, K] (a view of the [K, T]
        copy), which ``wgrad_operands`` takes as it is."""
        x = fk.fp8_e5m6_dequant(e, n)
        qt, st = fk.fp8_channel_cast(x.reshape(-1, n), False)
        self._columnwise.add(qt.untyped_storage()._cdata)
        return qt.t(), st

    def dgrad_weight(self, w_t: Tensor) -> Tensor:
        """The input-gradient GEMM's weight operand: as kept for the step, or (DeepSeek's kernels) transposed now
        from the other copy, in each backward."""
        return fk.fp8_transpose(w_t.transpose(-2, -1)) if self.deepseek_kernels else w_t

    def arrived_quantized(self, x: Tensor) -> None:
        """``x`` stands for rows that arrived in FP8 with their scales (an FP8 dispatch): a linear reading it
        takes them as they are, with no cast of its own."""
        self._quantized.add(x.untyped_storage()._cdata)

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

    def input_cast(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(FP8 input, its scales) of a grouped linear's forward: cast now, or as it arrived
        (``arrived_quantized``)."""
        if x.untyped_storage()._cdata not in self._quantized:
            q, _, sx, _ = self.cast(x, False)
            return q, sx
        tiles = (*x.shape[:-1], -(-x.shape[-1] // fk.BLOCK)) if self.blockwise else ()
        return x.new_empty(x.shape, dtype=fk.E4M3), x.new_empty(tiles, dtype=torch.float32)

    # -- weights ----------------------------------------------------------------------------------------------

    def weight(self, w: Tensor, grouped: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """A weight's (forward operand [N, K], input-gradient operand as [K, N], scales), cast once per step and
        reused (by recomputation too). ``w`` is [N, K] (y = x w^T); ``grouped``: experts' [E, K, N]
        (y = x @ w[e]), giving (w^T [E, N, K], w [E, K, N], scales)."""
        key = (w.untyped_storage()._cdata, w.storage_offset(), tuple(w.shape), grouped)
        hit = self._weights.get(key)
        if hit is not None:
            return hit[1], hit[2], hit[3]
        if self.block_scaled:
            out = self._block_scaled_weight(w.transpose(-2, -1) if grouped else w)
        elif not self.transposes and not grouped:
            out = self._weight_no_transpose(w)
        else:
            out = self._weight_with_transpose(w, grouped)
        self._weights[key] = (w, *out)  # holds w, so its storage (the key) stays its own
        return out

    def _block_scaled_weight(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``w`` [.., N, K] (the experts' weights as [E, N, K]): its rowwise copy [.., N, K] and its columnwise
        copy viewed as [.., K, N], both quantised from bf16 (MXFP8), or in 16 x 16 blocks (NVFP4)."""
        if self.mx:  # quantised after every step's update (with fp8_param_gather: from the gathered bf16 values)
            row, s, col, _ = mk.mx_weight_cast(w.detach())
            return row, col.transpose(-2, -1), s
        if self.param_gather:  # NVFP4 parameters: the optimizer writes the rowwise copy; its transpose is new
            n, k = w.shape[-2:]
            row = w.new_empty((*w.shape[:-2], n, -(-k // 2)), dtype=mk.FP4)
            s = w.new_empty((*w.shape[:-2], n, -(-k // mk.NV_BLOCK)), dtype=mk.E4M3)
            col, _ = mk.nvfp4_weight_transpose(row, s, n)
            return row, col.transpose(-2, -1), s
        row, s, col, _ = mk.nvfp4_weight_cast(w.detach())
        return row, col.transpose(-2, -1), s

    def _weight_no_transpose(self, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per-tensor FP8 on GPUs whose FP8 GEMMs take any layout: one FP8 copy serves both GEMMs."""
        scale = w.new_empty((), dtype=torch.float32)
        w8 = w.new_empty(tuple(w.shape), dtype=fk.E4M3) if self.param_gather else \
            fk.fp8_weight_quantize(w.detach(), scale)
        return w8, w8.t(), scale

    def _weight_with_transpose(self, w: Tensor, grouped: bool) -> tuple[Tensor, Tensor, Tensor]:
        scale = w.new_empty((), dtype=torch.float32)
        if self.param_gather:  # the parameter is stored in FP8 by the optimizer: only its transpose is new
            shape = (w.shape[0], w.shape[2], w.shape[1]) if grouped else tuple(w.shape)
            w8 = w.new_empty(shape, dtype=fk.E4M3)
            blocks = -(-shape[-2] // fk.BLOCK) * -(-shape[-1] // fk.BLOCK) if self.blockwise else 1
            # DeepSeek's kernels transpose in each backward (``dgrad_weight``): no copy kept for the step
            w8t = w8.transpose(-2, -1) if self.deepseek_kernels else fk.fp8_weight_transpose(w8)
            return (w8, w8t, w.new_empty((w.shape[0], blocks) if grouped else
                                                                 ((blocks,) if self.blockwise else ()),
                                                                 dtype=torch.float32))
        if grouped:
            return fk.fp8_grouped_weight_cast(w.detach(), scale, self.blockwise)
        return fk.fp8_weight_cast(w.detach(), scale, self.blockwise)

    # -- activations and gradients ----------------------------------------------------------------------------

    def cast(self, x2: Tensor, grad: bool, amax_group: TPGroup | None = None,
             transpose: bool = False) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """(rowwise q, the weight-gradient copy or None, scales of q, of that copy) of a 2-D bf16 tensor.
        ``transpose``: also make the weight-gradient GEMM's copy (Hopper per-tensor: the transpose; without
        transposes the rowwise data serves, so it is returned again). ``amax_group``: the tensor is gathered over
        it next (one per-tensor scale for the group)."""
        if self.mx:
            q, s, qc, sc = mk.mx_cast(x2, True, transpose)
            return q, (qc if transpose else None), s, (sc if transpose else None)
        if self.nvfp4:
            amax, amax_col = mk.nvfp4_amax(x2, transpose)
            if amax_group is not None:
                amax = parallel.all_reduce(amax, amax_group, op="max")
            q, s, qc, sc = mk.nvfp4_cast(x2, amax, amax_col, True, transpose, True)
            return q, (qc if transpose else None), s, (sc if transpose else None)
        if self.blockwise and transpose and self.deepseek_kernels:  # two kernels each reading x: per token, per channel
            q, s, _, _ = fk.fp8_block_cast(x2, grad, False)
            qt, st = fk.fp8_channel_cast(x2, grad)
            return q, qt, s, st
        if self.blockwise:
            q, s, qt, st = fk.fp8_block_cast(x2, grad, transpose)
            return q, (qt if transpose else None), s, (st if transpose else None)
        scale = x2.new_empty((), dtype=torch.float32)  # delayed: from the amax history (no kernel now)
        if self.recipe is Fp8Recipe.CURRENT:
            scale = fk.fp8_amax(x2)
            if amax_group is not None:
                scale = parallel.all_reduce(scale, amax_group, op="max")
        if transpose and self.transposes:
            q, qt, _ = fk.fp8_cast_transpose(x2, scale, grad)
            return q, qt, scale, scale
        q, _ = fk.fp8_cast(x2, scale, grad)
        return q, (q if transpose else None), scale, (scale if transpose else None)

    def wgrad_operands(self, g_col: Tensor, x_saved: Tensor) -> tuple[Tensor, Tensor]:
        """The weight-gradient GEMM's (a [N, T], b_t [K, T]) from the gradient's weight-gradient copy and the
        saved (gathered) input: transposes made where the GEMM takes only TN, else views of the copies."""
        key = x_saved.untyped_storage()._cdata
        if key in self._columnwise:  # used once: the id may be reused by a later tensor
            self._columnwise.discard(key)
            return g_col, x_saved.t()
        if self.transposes and not self.block_scaled:
            return g_col, fk.fp8_transpose(x_saved)
        return g_col.t(), x_saved.t()

    def grouped_gemm(self, a: Tensor, b_t: Tensor, scale_a: Tensor, scale_b: Tensor,
                     out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The experts' a [E, M, K] @ b_t[e]^T (b_t [E, N, K]) on block-scaled tensor cores (MXFP8, NVFP4)."""
        depth = a.shape[-1] * (2 if self.nvfp4 else 1)
        return mk.mx_scaled_grouped_mm(a, b_t.transpose(-2, -1), scale_a, scale_b, out_dtype, depth)

    def gemm(self, a: Tensor, b_t: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, weight: bool = False) -> Tensor:
        """a @ b_t^T on the recipe's tensor cores, output ``out_dtype``. Blockwise: ``a`` in 1 x 128 tiles along
        K, ``b_t`` in 128 x 128 blocks (``weight``) or 1 x 128 tiles; the scale tensors of those shapes stand
        for the ones the quantizer wrote. NVFP4: both operands packed along K."""
        if self.nvfp4:
            out = mk.nvfp4_scaled_mm(a, b_t.t(), scale_a, scale_b, out_dtype)
            return out if bias is None else out + bias
        if self.blockwise:
            (m, k), n = a.shape, b_t.shape[0]
            kb = -(-k // fk.BLOCK)
            scale_a = a.new_empty((m, kb), dtype=torch.float32)
            if weight and self.deepseek_kernels:  # DeepGEMM reads an activation's scales column-major
                scale_a = fk.fp8_scale_transpose(scale_a)
            scale_b = a.new_empty((kb, -(-n // fk.BLOCK) if weight else n), dtype=torch.float32)
        elif self.mx:  # the MMA reads E8M0 scales in 128 x 4 swizzled tiles: rows padded to 128, blocks to 4
            scale_a, scale_b = (a.new_empty((_mx_tiles(t.shape[0], t.shape[1]),), dtype=mk.E8M0) for t in (a, b_t))
        return torch._scaled_mm(a, b_t.t(), scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def _mx_tiles(rows: int, k: int) -> int:
    """E8M0 scales of a [rows, k] MXFP8 operand as the block-scaled MMA lays them out (128 x 4 tiles)."""
    return -(-rows // 128) * 128 * (-(-(-(-k // mk.MX_BLOCK)) // 4) * 4)
