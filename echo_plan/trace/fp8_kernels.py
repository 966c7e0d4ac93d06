"""The memory-bound kernels Transformer Engine adds around an FP8 GEMM, as torch custom ops.

One op is one kernel, as in Transformer Engine (``transformer_engine/common``: cast, cast-transpose,
amax, transpose; the blockwise quantizer of its ``Float8BlockScaling`` recipe). Each has a CPU
reference (real maths, used outside FakeTensorMode) and a fake giving outputs of the right shapes and
dtypes (``torch.float8_e4m3fn`` for weights and activations, ``torch.float8_e5m2`` for gradients: the
HYBRID format). Their bytes are what they really read and write, so the compute model times them as
the bandwidth-bound kernels they are. The code is ours.

* ``fp8_cast``: bf16 -> fp8 at a per-tensor scale, the amax of the input written in the same pass
  (delayed scaling records it for later steps; current scaling computed it before, ``fp8_amax``).
* ``fp8_cast_transpose``: the same, also writing the transpose (a gradient's, for the weight-gradient
  GEMM, which Hopper's FP8 tensor cores take only in the TN layout).
* ``fp8_amax``: current scaling's first pass: the absolute maximum of a tensor (a reduction).
* ``fp8_transpose``: an FP8 tensor's transpose (a saved input, for the weight-gradient GEMM).
* ``fp8_block_cast``: blockwise (DeepSeek-V3) quantisation of a 2-D tensor in 1 x 128 tiles, one fp32
  scale per tile; with ``columnwise`` also the transposed tensor's tiles (what the wgrad GEMM reads).
* ``fp8_channel_cast``: DeepSeek's per-channel cast-and-transpose: a bf16 [T, K] tensor to FP8 [K, T] in 1 x 128
  tiles along T (the weight-gradient GEMM's operand), the only copy written.
* ``fp8_scale_transpose``: the 1 x 128 scales of an activation laid out column-major (DeepGEMM's dense GEMMs
  read them so; a small kernel before each, as DeepSeek's profile shows).
* ``fp8_e5m6_cast`` / ``fp8_e5m6_dequant``: DeepSeek's 12-bit E5M6 copy of the attention output, kept for
  backward (1.5 bytes a value, packed here as uint8), and its cast back to bf16 there.
* ``fp8_weight_quantize``: a weight cast to FP8 without a transpose (GPUs whose FP8 GEMMs take any
  layout: sm100 and newer), once per step.
* ``fp8_weight_cast``: a weight and its transpose cast to FP8 (per-tensor scale, or 128 x 128 blocks):
  run once per step, on the first micro-batch (Megatron-Core passes ``is_first_microbatch`` so
  Transformer Engine caches the FP8 weights for the other micro-batches). The recorder files it in the
  ``step`` phase.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

Tensor = torch.Tensor
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
BLOCK = 128  # DeepSeek-V3's quantisation tile: 1 x 128 activations, 128 x 128 weights
ONCE_PER_STEP = frozenset({"fp8_weight_cast", "fp8_grouped_weight_cast", "fp8_weight_transpose", "fp8_weight_quantize"})


def _fmt(grad: bool) -> torch.dtype:
    return E5M2 if grad else E4M3


def _t_shape(x: Tensor) -> tuple[int, ...]:
    """The shape with the last two dimensions swapped (a batch of matrices transposed)."""
    return (*x.shape[:-2], x.shape[-1], x.shape[-2])


def _t(x: Tensor) -> Tensor:
    return x.transpose(-2, -1).contiguous()


def _quantize(x: Tensor, scale: Tensor, grad: bool) -> Tensor:
    return (x.float() * scale.float()).clamp(-torch.finfo(_fmt(grad)).max, torch.finfo(_fmt(grad)).max).to(_fmt(grad))


@torch.library.custom_op("echo_plan::fp8_cast", mutates_args=())
def fp8_cast(x: Tensor, scale: Tensor, grad: bool) -> tuple[Tensor, Tensor]:
    """(x in fp8 at ``scale``, amax of x)."""
    return _quantize(x, scale, grad), x.abs().amax().float()


@fp8_cast.register_fake
def _cast_fake(x, scale, grad):
    return x.new_empty(x.shape, dtype=_fmt(grad)), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("echo_plan::fp8_cast_transpose", mutates_args=())
def fp8_cast_transpose(x: Tensor, scale: Tensor, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(x in fp8, its transpose (last two dimensions) in fp8, amax of x)."""
    q = _quantize(x, scale, grad)
    return q, _t(q), x.abs().amax().float()


@fp8_cast_transpose.register_fake
def _cast_transpose_fake(x, scale, grad):
    return (x.new_empty(x.shape, dtype=_fmt(grad)), x.new_empty(_t_shape(x), dtype=_fmt(grad)),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("echo_plan::fp8_amax", mutates_args=())
def fp8_amax(x: Tensor) -> Tensor:
    return x.abs().amax().float()


fp8_amax.register_fake(lambda x: x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("echo_plan::fp8_transpose", mutates_args=())
def fp8_transpose(q: Tensor) -> Tensor:
    return _t(q)


fp8_transpose.register_fake(lambda q: q.new_empty(_t_shape(q)))


@torch.library.custom_op("echo_plan::fp8_weight_quantize", mutates_args=())
def fp8_weight_quantize(w: Tensor, scale: Tensor) -> Tensor:
    """A weight in e4m3 at a per-tensor scale, once per step (no transpose: the GEMMs take any layout)."""
    return _quantize(w, scale, False)


fp8_weight_quantize.register_fake(lambda w, scale: w.new_empty(w.shape, dtype=E4M3))


@torch.library.custom_op("echo_plan::fp8_weight_transpose", mutates_args=())
def fp8_weight_transpose(q: Tensor) -> Tensor:
    """An FP8 weight's transpose, once per step (the weight itself is FP8: ``fp8_param_gather``)."""
    return _t(q)


fp8_weight_transpose.register_fake(lambda q: q.new_empty(_t_shape(q)))


def _blocks(n: int) -> int:
    """Tiles along a dimension of ``n`` (Transformer Engine pads a partial last tile)."""
    return -(-n // BLOCK)


def _tiles(x: Tensor) -> Tensor:
    """x in 1 x 128 tiles of its last dimension, a partial last tile padded with zeros."""
    pad = -x.shape[-1] % BLOCK
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    return xf.reshape(*x.shape[:-1], xf.shape[-1] // BLOCK, BLOCK)


@torch.library.custom_op("echo_plan::fp8_block_cast", mutates_args=())
def fp8_block_cast(x: Tensor, grad: bool, columnwise: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, scales per 1 x 128 tile of the last dimension, q of x transposed (last two dimensions), its
    scales); the last two are empty without ``columnwise``."""
    fmax = torch.finfo(_fmt(grad)).max

    def rowwise(t: Tensor) -> tuple[Tensor, Tensor]:
        tiles = _tiles(t)
        scale = fmax / tiles.abs().amax(-1).clamp(min=1e-12)
        q = (tiles * scale.unsqueeze(-1)).reshape(*t.shape[:-1], -1)[..., :t.shape[-1]]
        return q.to(_fmt(grad)).contiguous(), 1.0 / scale

    q, s = rowwise(x)
    if not columnwise:
        return q, s, x.new_empty((0,), dtype=_fmt(grad)), x.new_empty((0,), dtype=torch.float32)
    qt, st = rowwise(_t(x))
    return q, s, qt, st


@fp8_block_cast.register_fake
def _block_cast_fake(x, grad, columnwise):
    f32, fmt = torch.float32, _fmt(grad)
    q, s = x.new_empty(x.shape, dtype=fmt), x.new_empty((*x.shape[:-1], _blocks(x.shape[-1])), dtype=f32)
    if not columnwise:
        return q, s, x.new_empty((0,), dtype=fmt), x.new_empty((0,), dtype=f32)
    t = _t_shape(x)
    return q, s, x.new_empty(t, dtype=fmt), x.new_empty((*t[:-1], _blocks(t[-1])), dtype=f32)


@torch.library.custom_op("echo_plan::fp8_block_dequant", mutates_args=())
def fp8_block_dequant(q: Tensor, scales: Tensor, n: int) -> Tensor:
    """The bf16 tensor ``fp8_block_cast`` quantised (its last dimension ``n`` wide), one read of the FP8 tiles."""
    pad = -n % BLOCK
    qf = torch.nn.functional.pad(q.float(), (0, pad)) if pad else q.float()
    tiles = qf.reshape(*q.shape[:-1], qf.shape[-1] // BLOCK, BLOCK) * scales.unsqueeze(-1)
    return tiles.reshape(*q.shape[:-1], -1)[..., :n].to(torch.bfloat16).contiguous()


fp8_block_dequant.register_fake(lambda q, scales, n: q.new_empty((*q.shape[:-1], n), dtype=torch.bfloat16))


@torch.library.custom_op("echo_plan::fp8_weight_cast", mutates_args=())
def fp8_weight_cast(w: Tensor, scale: Tensor, blockwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(w in e4m3, w^T in e4m3, scale-inverse: one, or one per 128 x 128 block)."""
    if not blockwise:
        q = _quantize(w, scale, False)
        return q, q.t().contiguous(), 1.0 / scale.float()
    n, k = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.reshape(_blocks(n), BLOCK, _blocks(k), BLOCK)
    s = torch.finfo(E4M3).max / blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    q = (blocks * s[:, None, :, None]).reshape(padded.shape)[:n, :k].to(E4M3).contiguous()
    return q, q.t().contiguous(), 1.0 / s


@fp8_weight_cast.register_fake
def _weight_cast_fake(w, scale, blockwise):
    n, k = w.shape
    s_shape = (_blocks(n), _blocks(k)) if blockwise else ()
    return (w.new_empty((n, k), dtype=E4M3), w.new_empty((k, n), dtype=E4M3),
            w.new_empty(s_shape, dtype=torch.float32))


@torch.library.custom_op("echo_plan::fp8_grouped_weight_cast", mutates_args=())
def fp8_grouped_weight_cast(w: Tensor, scale: Tensor, blockwise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Local experts' weights [E, K, N] (x @ w[e]) to FP8 once per step: (w^T [E, N, K], w [E, K, N],
    scale-inverse per expert or per 128 x 128 block), as Transformer Engine's GroupedLinear keeps them."""
    per = [fp8_weight_cast(e.t().contiguous(), scale, blockwise) for e in w]
    return (torch.stack([p[0] for p in per]), torch.stack([p[1] for p in per]),
            torch.stack([p[2].reshape(-1) for p in per]))


@fp8_grouped_weight_cast.register_fake
def _grouped_weight_cast_fake(w, scale, blockwise):
    e, k, n = w.shape
    blocks = _blocks(n) * _blocks(k) if blockwise else 1
    return (w.new_empty((e, n, k), dtype=E4M3), w.new_empty((e, k, n), dtype=E4M3),
            w.new_empty((e, blocks), dtype=torch.float32))


@torch.library.custom_op("echo_plan::fp8_channel_cast", mutates_args=())
def fp8_channel_cast(x: Tensor, grad: bool) -> tuple[Tensor, Tensor]:
    """(x^T [K, T] in 1 x 128 tiles of T, their scales) from a 2-D bf16 ``x`` [T, K]."""
    q, s, qt, st = fp8_block_cast(x, grad, True)
    return qt, st


@fp8_channel_cast.register_fake
def _channel_cast_fake(x, grad):
    t = _t_shape(x)
    return x.new_empty(t, dtype=_fmt(grad)), x.new_empty((*t[:-1], _blocks(t[-1])), dtype=torch.float32)


@torch.library.custom_op("echo_plan::fp8_scale_transpose", mutates_args=())
def fp8_scale_transpose(s: Tensor) -> Tensor:
    """1 x 128 scales [M, K/128] laid out column-major (the same values)."""
    return s.t().contiguous().t()


fp8_scale_transpose.register_fake(lambda s: torch.empty_like(s))

E5M6_BYTES_NUM, E5M6_BYTES_DEN = 3, 2  # 12 bits a value: 1 sign, 5 exponent, 6 mantissa


def _e5m6_shape(x: Tensor) -> tuple[int, ...]:
    return (*x.shape[:-1], -(-x.shape[-1] * E5M6_BYTES_NUM // E5M6_BYTES_DEN))


@torch.library.custom_op("echo_plan::fp8_e5m6_cast", mutates_args=())
def fp8_e5m6_cast(x: Tensor) -> Tensor:
    """x's E5M6 copy, packed as bytes. Reference: the value's bf16 bits' top 12 (sign, 8-bit exponent, mantissa
    cut to 3 bits: the layout of the packing, not E5M6's rounding), two values in three bytes."""
    bits = (x.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32) >> 4) & 0xFFF
    flat = torch.nn.functional.pad(bits.reshape(*x.shape[:-1], -1), (0, x.shape[-1] % 2)).reshape(*x.shape[:-1], -1, 2)
    a, b = flat[..., 0], flat[..., 1]
    packed = torch.stack([a & 0xFF, ((a >> 8) & 0xF) | ((b & 0xF) << 4), (b >> 4) & 0xFF], dim=-1)
    return packed.reshape(*x.shape[:-1], -1)[..., :_e5m6_shape(x)[-1]].to(torch.uint8)


fp8_e5m6_cast.register_fake(lambda x: x.new_empty(_e5m6_shape(x), dtype=torch.uint8))


@torch.library.custom_op("echo_plan::fp8_e5m6_dequant", mutates_args=())
def fp8_e5m6_dequant(e: Tensor, n: int) -> Tensor:
    """The bf16 tensor (last dimension ``n``) ``fp8_e5m6_cast`` packed."""
    pad = -e.shape[-1] % 3
    b3 = torch.nn.functional.pad(e.to(torch.int32), (0, pad)).reshape(*e.shape[:-1], -1, 3)
    a = b3[..., 0] | ((b3[..., 1] & 0xF) << 8)
    b = ((b3[..., 1] >> 4) & 0xF) | (b3[..., 2] << 4)
    bits = (torch.stack([a, b], dim=-1).reshape(*e.shape[:-1], -1)[..., :n] << 4).to(torch.int16)
    return bits.view(torch.bfloat16).contiguous()


fp8_e5m6_dequant.register_fake(lambda e, n: e.new_empty((*e.shape[:-1], n), dtype=torch.bfloat16))


@register_flop_formula(torch.ops.aten._scaled_grouped_mm)
def _scaled_grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FP8 grouped GEMM: 2 x rows x K x N over all groups (torch has no formula for it). A batched
    (3-D) ``a`` holds its rows per group; a 2-D ``a`` holds every group's rows, split by ``offs``."""
    rows = 1
    for d in a_shape[:-1]:
        rows *= d
    return 2 * rows * a_shape[-1] * b_shape[-1]
