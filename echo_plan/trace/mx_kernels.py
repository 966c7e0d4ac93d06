"""Blackwell's block-scaled quantisation kernels, as torch custom ops: MXFP8 and NVFP4 (Transformer Engine).

Both recipes scale small blocks of a tensor inside the GEMM (Blackwell's block-scaled tensor cores), so a
tensor used along two directions (the input of a linear: along its features in the forward GEMM, along its
tokens in the weight-gradient GEMM) is quantised twice from the bf16 source, once per direction ("rowwise"
and "columnwise"), in one kernel that reads the source once (TE's recipe docs: "both versions are computed
from the high precision input to avoid double quantization errors"). One op is one kernel; each has a CPU
reference (real maths, used outside FakeTensorMode) and a fake giving outputs of the shapes and dtypes TE
writes, so the compute model times them by the bytes they really move. The code is ours.

MXFP8 (TE ``MXFP8BlockScaling``; OCP Microscaling spec): E4M3 values (forward and backward alike), one
power-of-two scale (``float8_e8m0fnu``) per 32 consecutive values.

* ``mx_cast``: rowwise (1 x 32 blocks along the last dimension) and/or columnwise (32 x 1 blocks along the
  first) copies of a 2-D tensor; the columnwise copy keeps the tensor's shape (its scales run along dim 0).
* ``mx_weight_cast``: a weight's two copies, once per step.

NVFP4 (TE ``NVFP4BlockScaling``; Alvarez et al. 2025, "Pretraining Large Language Models with NVFP4"): E2M1
values, two per byte (``float4_e2m1fn_x2``), one E4M3 scale per 16 values and one fp32 scale per tensor;
16 x 16 blocks for weights; the columnwise copies of inputs and gradients (the weight-gradient GEMM's
operands) pass a 16 x 16 random Hadamard transform first, and gradients are rounded stochastically.

* ``nvfp4_amax``: the per-tensor scale's first pass, the absolute maximum of the tensor and of its
  Hadamard-transformed columnwise view, read together (one reduction over the tensor).
* ``nvfp4_cast``: rowwise ([rows, cols / 2] packed along the row) and/or columnwise ([rows / 2, cols]
  packed along the column) copies of a 2-D tensor with their E4M3 scales.
* ``nvfp4_weight_cast``: a weight's two copies in 16 x 16 blocks, once per step.
* ``nvfp4_scaled_mm``: the FP4 GEMM a @ b on packed operands (a [M, K/2] packed along K, b [K/2, N]
  packed along K), bf16 out; its FLOPs are 2 M N K of the unpacked K.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP4 = torch.float4_e2m1fn_x2
MX_BLOCK = 32  # MXFP8: values per E8M0 scale (OCP Microscaling v1.0)
NV_BLOCK = 16  # NVFP4: values per E4M3 scale (TE NVFP4BlockScaling; 16 x 16 for weights)
ONCE_PER_STEP = frozenset({"mx_weight_cast", "nvfp4_weight_cast", "nvfp4_weight_transpose"})
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the eight magnitudes of E2M1


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _lead_shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape[:-2])


def _rowwise_nd(fn, x: Tensor, *args) -> tuple[Tensor, Tensor]:
    """``fn`` (a 2-D rowwise quantiser: blocks along the last dimension) over a batch of matrices."""
    q, s = fn(x.reshape(-1, x.shape[-1]), *args)
    return q.reshape(*x.shape[:-1], q.shape[-1]), s.reshape(*x.shape[:-1], s.shape[-1])


def _colwise_nd(fn, x: Tensor, *args) -> tuple[Tensor, Tensor]:
    """``fn`` along the second-to-last dimension of each matrix of a batch (columnwise), in the matrix's layout."""
    t = x.transpose(-2, -1).contiguous()
    q, s = _rowwise_nd(fn, t, *args)
    return q.transpose(-2, -1).contiguous(), s.transpose(-2, -1).contiguous()


# -- MXFP8 ----------------------------------------------------------------------------------------------------

def _mx_rowwise(x: Tensor) -> tuple[Tensor, Tensor]:
    """E4M3 values and power-of-two scales of 1 x 32 blocks along the last dimension (a partial block padded)."""
    rows, cols = x.shape
    pad = -cols % MX_BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, -1, MX_BLOCK)
    amax = xf.abs().amax(-1).clamp(min=2.0**-126)
    scale = torch.exp2(torch.floor(torch.log2(amax / torch.finfo(E4M3).max)) + 1)  # the block's max stays in range
    q = (xf / scale.unsqueeze(-1)).clamp(-torch.finfo(E4M3).max, torch.finfo(E4M3).max)
    return q.reshape(rows, -1)[:, :cols].to(E4M3).contiguous(), scale.to(E8M0)


def _mx_shapes(x: Tensor, rowwise: bool, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lead, (rows, cols) = _lead_shape(x), x.shape[-2:]
    empty = (x.new_empty((0,), dtype=E4M3), x.new_empty((0,), dtype=E8M0))
    row = (x.new_empty(x.shape, dtype=E4M3), x.new_empty((*lead, rows, _blocks(cols, MX_BLOCK)), dtype=E8M0)) \
        if rowwise else empty
    col = (x.new_empty(x.shape, dtype=E4M3), x.new_empty((*lead, _blocks(rows, MX_BLOCK), cols), dtype=E8M0)) \
        if columnwise else empty
    return (*row, *col)


@torch.library.custom_op("echo_plan::mx_cast", mutates_args=())
def mx_cast(x: Tensor, rowwise: bool, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rowwise q, its scales, columnwise q (same shape as x), its scales) of a matrix or a batch of them (the
    experts' grouped inputs); an unasked copy is empty."""
    out = list(_mx_shapes(x[..., :0, :0], False, False))
    if rowwise:
        out[0], out[1] = _rowwise_nd(_mx_rowwise, x)
    if columnwise:
        out[2], out[3] = _colwise_nd(_mx_rowwise, x)
    return tuple(out)


mx_cast.register_fake(_mx_shapes)


@torch.library.custom_op("echo_plan::mx_weight_cast", mutates_args=())
def mx_weight_cast(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A weight [N, K] (or the experts' [E, N, K])'s rowwise (blocks along K: the forward GEMM) and columnwise
    (blocks along N: the input-gradient GEMM) MXFP8 copies with their scales, once per step."""
    return mx_cast(w, True, True)


mx_weight_cast.register_fake(lambda w: _mx_shapes(w, True, True))


# -- NVFP4 ----------------------------------------------------------------------------------------------------

def _hadamard16() -> Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < NV_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / NV_BLOCK ** 0.5


def _rht(x: Tensor) -> Tensor:
    """The 16 x 16 Hadamard transform of each block of 16 along the second-to-last dimension (the rows of each
    matrix, a multiple of 16)."""
    rows, cols = x.shape[-2:]
    blocks = x.float().reshape(-1, rows // NV_BLOCK, NV_BLOCK, cols)
    return torch.einsum("ij,abjc->abic", _hadamard16(), blocks).reshape(x.shape)


def _to_e2m1_codes(v: Tensor) -> Tensor:
    """Nearest E2M1 code (sign bit 3, magnitude index bits 0-2) of values already scaled into [-6, 6]."""
    table = torch.tensor(_E2M1)
    idx = (v.abs().unsqueeze(-1) - table).abs().argmin(-1)
    return (idx | ((v < 0).to(torch.int64) << 3)).to(torch.uint8)


def _nv_rowwise(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """Packed E2M1 values [rows, cols / 2] and E4M3 scales [rows, cols / 16] of 1 x 16 blocks, with the
    per-tensor scale from ``amax`` (so the block scales use E4M3's range)."""
    rows, cols = x.shape
    pad = -cols % NV_BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(rows, -1, NV_BLOCK)
    global_scale = (amax.float().clamp(min=1e-12) / (6.0 * torch.finfo(E4M3).max))
    block = (xf.abs().amax(-1) / 6.0 / global_scale).clamp(max=torch.finfo(E4M3).max).to(E4M3)
    denom = (block.float() * global_scale).clamp(min=1e-30).unsqueeze(-1)
    codes = _to_e2m1_codes((xf / denom).clamp(-6.0, 6.0)).reshape(rows, -1)[:, :cols + pad]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return packed.view(FP4)[:, :_blocks(cols, 2)], block


def _nv_colwise(x: Tensor, amax: Tensor) -> tuple[Tensor, Tensor]:
    """The columnwise copy of each matrix of ``x``: blocks of 16 along its rows, two rows' values per byte
    ([..., rows / 2, cols]), with its scales [..., rows / 16, cols]."""
    q, scale = _rowwise_nd(_nv_rowwise, x.transpose(-2, -1).contiguous(), amax)
    q = q.view(torch.uint8).transpose(-2, -1).contiguous().view(FP4)  # bytes laid out down the columns
    return q, scale.transpose(-2, -1).contiguous()


def _nv_shapes(x: Tensor, rowwise: bool, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    lead, (rows, cols) = _lead_shape(x), x.shape[-2:]
    empty = (x.new_empty((0,), dtype=FP4), x.new_empty((0,), dtype=E4M3))
    row = (x.new_empty((*lead, rows, _blocks(cols, 2)), dtype=FP4),
           x.new_empty((*lead, rows, _blocks(cols, NV_BLOCK)), dtype=E4M3)) if rowwise else empty
    col = (x.new_empty((*lead, _blocks(rows, 2), cols), dtype=FP4),
           x.new_empty((*lead, _blocks(rows, NV_BLOCK), cols), dtype=E4M3)) if columnwise else empty
    return (*row, *col)


@torch.library.custom_op("echo_plan::nvfp4_amax", mutates_args=())
def nvfp4_amax(x: Tensor, hadamard: bool) -> tuple[Tensor, Tensor]:
    """(amax of x, amax of its columnwise Hadamard transform, or of x again without ``hadamard``)."""
    plain = x.abs().amax().float()
    if not hadamard or x.shape[-2] % NV_BLOCK:
        return plain, plain.clone()
    return plain, _rht(x).abs().amax().float()


nvfp4_amax.register_fake(lambda x, hadamard: (x.new_empty((), dtype=torch.float32),
                                              x.new_empty((), dtype=torch.float32)))


@torch.library.custom_op("echo_plan::nvfp4_cast", mutates_args=())
def nvfp4_cast(x: Tensor, amax: Tensor, amax_col: Tensor, rowwise: bool, columnwise: bool,
               hadamard: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rowwise packed q [..., rows, cols/2], scales, columnwise packed q [..., rows/2, cols] of the Hadamard
    transform when ``hadamard``, scales) of a matrix or a batch of them; an unasked copy is empty. Stochastic
    rounding of gradients changes the values written, not the bytes: the reference rounds to nearest."""
    out = list(_nv_shapes(x[..., :0, :0], False, False))
    if rowwise:
        out[0], out[1] = _rowwise_nd(_nv_rowwise, x, amax)
    if columnwise:
        src = _rht(x) if hadamard and x.shape[-2] % NV_BLOCK == 0 else x.float()
        out[2], out[3] = _nv_colwise(src, amax_col)
    return tuple(out)


nvfp4_cast.register_fake(lambda x, amax, amax_col, rowwise, columnwise, hadamard:
                         _nv_shapes(x, rowwise, columnwise))


@torch.library.custom_op("echo_plan::nvfp4_weight_cast", mutates_args=())
def nvfp4_weight_cast(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A weight [N, K] (or the experts' [E, N, K])'s NVFP4 copies in 16 x 16 blocks (one scale serves both
    directions, so the columnwise copy is the rowwise one transposed): rowwise [.., N, K/2], its scales,
    columnwise [.., N/2, K], its scales; once per step, its amax in the same pass."""
    amax = w.abs().amax().float()
    return nvfp4_cast(w, amax, amax, True, True, False)


nvfp4_weight_cast.register_fake(lambda w: _nv_shapes(w, True, True))


def _decode_fp4(t: Tensor, along_rows: bool) -> Tensor:
    """The E2M1 values of a packed matrix (two per byte along its last dimension, or along its rows)."""
    table = torch.tensor(_E2M1)
    raw = (t.transpose(-2, -1) if along_rows else t).contiguous().view(torch.uint8)
    codes = torch.stack([raw & 0xF, raw >> 4], -1).reshape(*raw.shape[:-1], -1)
    vals = table[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    return vals.transpose(-2, -1) if along_rows else vals


@torch.library.custom_op("echo_plan::nvfp4_scaled_mm", mutates_args=())
def nvfp4_scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a [M, K/2] @ b [K/2, N] on FP4 tensor cores (both packed along K), ``out_dtype`` out. The reference
    decodes the E2M1 codes (scales omitted: the GEMM's shape and bytes are what the trace needs)."""
    return (_decode_fp4(a, False) @ _decode_fp4(b, True)).to(out_dtype)


@nvfp4_scaled_mm.register_fake
def _nvfp4_mm_fake(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@register_flop_formula(torch.ops.echo_plan.nvfp4_scaled_mm)
def _nvfp4_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 M N K with K the unpacked depth (two E2M1 values per packed element)."""
    return 2 * a_shape[0] * b_shape[1] * 2 * a_shape[1]


@torch.library.custom_op("echo_plan::nvfp4_weight_transpose", mutates_args=())
def nvfp4_weight_transpose(row: Tensor, scales: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """NVFP4 parameters (``fp4_param_gather``): the columnwise copy [.., N/2, K] of the rowwise one [.., N, K/2]
    the optimizer wrote, and its scales (16 x 16 blocks share one scale, so no new quantisation), once per step."""
    values = _decode_fp4(row, False)[..., :n, :]
    codes = _to_e2m1_codes(values)  # the values are E2M1 already: their codes again
    codes = codes.transpose(-2, -1)
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).transpose(-2, -1).contiguous()
    return packed.view(FP4), scales.transpose(-2, -1).contiguous()


@nvfp4_weight_transpose.register_fake
def _nvfp4_weight_transpose_fake(row, scales, n):
    lead, k = row.shape[:-2], row.shape[-1] * 2
    return (row.new_empty((*lead, _blocks(n, 2), k), dtype=FP4),
            row.new_empty((*lead, _blocks(n, NV_BLOCK), k), dtype=E4M3))


@torch.library.custom_op("echo_plan::mx_scaled_grouped_mm", mutates_args=())
def mx_scaled_grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                         depth: int) -> Tensor:
    """The experts' block-scaled grouped GEMM: a [E, M, K] @ b [E, K, N] per expert, MXFP8 (E4M3 operands with
    E8M0 scales) or NVFP4 (operands packed along K, E4M3 scales), as Transformer Engine's GroupedLinear runs them
    on Blackwell; ``depth`` is K in values (twice the packed width for NVFP4), ``out_dtype`` out. The reference
    multiplies the (decoded) values, scales omitted."""
    if a.dtype == FP4:
        return (_decode_fp4(a, False) @ _decode_fp4(b, True)).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)


@mx_scaled_grouped_mm.register_fake
def _grouped_fake(a, b, scale_a, scale_b, out_dtype, depth):
    return a.new_empty((*a.shape[:-1], b.shape[-1]), dtype=out_dtype)


@register_flop_formula(torch.ops.echo_plan.mx_scaled_grouped_mm)
def _grouped_flops(a_shape, b_shape, scale_a_shape, scale_b_shape, out_dtype, depth, *args, out_shape=None,
                   **kwargs) -> int:
    """2 E M N K over the experts, K in values."""
    groups = 1
    for d in a_shape[:-2]:
        groups *= d
    return 2 * groups * a_shape[-2] * b_shape[-1] * depth
