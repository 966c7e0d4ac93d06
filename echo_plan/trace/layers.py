"""Building blocks of the traced model: norms, rotary embedding, vocab-parallel embedding and loss.

Written after Megatron-LM (megatron/core/tensor_parallel/layers.py and cross_entropy.py); the code
is ours. Parameters are created empty (under FakeTensorMode they hold no memory) because tracing
only needs shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echo_plan.specs import Norm
from echo_plan.trace import kernels, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.fused_elementwise import clamped_geglu_reference

RMS_EPS = 1e-5
LN_EPS = 1e-5


# A fused RMSNorm as one kernel forward and one backward, as Megatron-LM runs it on GPUs
# (Transformer Engine / Apex FusedRMSNorm, or aten._fused_rms_norm on CUDA). On CPU torch
# decomposes F.rms_norm into eight small ops, which is not what a GPU executes.
@torch.library.custom_op("echo_plan::rms_norm", mutates_args=())
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


@_rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("echo_plan::rms_norm_backward", mutates_args=())
def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    xf, gf = x.float(), grad.float()
    xhat = xf * rstd
    gw = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
    gx_hat = gf * weight.float()
    gx = rstd * (gx_hat - xhat * (gx_hat * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), gw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_setup(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # rstd gets no gradient; do not allocate zeros for it


def _rms_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        return None, None, None
    gx, gw = _rms_norm_backward(grad_y, x, weight, rstd)
    return gx, gw, None


_rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


class RMSNorm(nn.Module):
    """One fused kernel each way (Transformer Engine, Apex, a compiled block), or, ``fused`` false, the eager
    PyTorch module torchtitan's ``norm_type = "rmsnorm"`` and Hugging Face's LlamaRMSNorm run: the input upcast to
    fp32, squared, averaged, its reciprocal square root, the product, the cast back and the weight's product, each
    a kernel, autograd keeping the fp32 copy for backward."""

    def __init__(self, hidden: int, dtype: torch.dtype, fused: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return _rms_norm(x, self.weight, RMS_EPS)[0]
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + RMS_EPS)).type_as(x) * self.weight


class LayerNorm(nn.Module):
    """LayerNorm; with ``zero_centered`` the scale is (1 + weight) (Megatron-Core's LayerNorm1p /
    Transformer Engine's zero_centered_gamma, used by Nemotron-4)."""

    def __init__(self, hidden: int, dtype: torch.dtype, zero_centered: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        return F.layer_norm(x, (x.shape[-1],), weight, self.bias, LN_EPS)


def make_norm(norm: Norm, hidden: int, dtype: torch.dtype, fused: bool = True) -> nn.Module:
    """The model's norm; ``fused`` false: an RMSNorm as eager PyTorch ops (LayerNorm is one aten kernel either way)."""
    if norm is Norm.RMSNORM:
        return RMSNorm(hidden, dtype, fused)
    return LayerNorm(hidden, dtype, zero_centered=norm is Norm.LAYERNORM1P)


class Rotary(nn.Module):
    """Rotary position embedding (Su et al. 2021), rotate-half form as in Megatron-LM/Llama, on the
    first ``rotary_dims`` dims of each head (Megatron-Core's ``rotary_percent``). ``fused``: one
    kernel forward and one backward (Transformer Engine's fused RoPE); else the unfused ops.
    ``scale_per_call`` (a YaRN attention factor the fused kernel cannot take): Megatron-Core's
    ``_apply_rotary_pos_emb_bshd`` as it runs then, cos and sin of the fp32 angles scaled and cast on
    every call, the rotated part concatenated with the unrotated rest (a copy even when that is empty)."""

    def __init__(self, seq: int, rotary_dims: int, dtype: torch.dtype, fused: bool = True,
                 scale_per_call: float | None = None) -> None:
        super().__init__()
        self.register_buffer("cos", torch.empty(seq, 1, 1, rotary_dims, dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(seq, 1, 1, rotary_dims, dtype=dtype), persistent=False)
        self.scale_per_call = scale_per_call
        if scale_per_call is not None:
            self.register_buffer("angles", torch.empty(seq, 1, 1, rotary_dims, dtype=torch.float32), persistent=False)
        self.fused = fused and scale_per_call is None

    @staticmethod
    def _turned(head: torch.Tensor) -> torch.Tensor:
        half = head.shape[-1] // 2
        return torch.cat((-head[..., half:], head[..., :half]), dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:  # t: [s, b, heads, d]
        if self.fused:
            return kernels.rope(t, self.cos, self.sin)
        rot = self.cos.shape[-1]
        if self.scale_per_call is not None:
            cos = (torch.cos(self.angles) * self.scale_per_call).to(t.dtype)
            sin = (torch.sin(self.angles) * self.scale_per_call).to(t.dtype)
            head, rest = t[..., :rot], t[..., rot:]
            return torch.cat((head * cos + self._turned(head) * sin, rest), dim=-1)
        head = t[..., :rot] if rot < t.shape[-1] else t
        head = head * self.cos + self._turned(head) * self.sin
        return torch.cat((head, t[..., rot:]), dim=-1) if rot < t.shape[-1] else head


class VocabParallelEmbedding(nn.Module):
    """This rank's rows [start, start + vocab/tp) of the embedding table; others' tokens give 0."""

    def __init__(self, vocab_padded: int, hidden: int, group: TPGroup | None, dtype: torch.dtype) -> None:
        super().__init__()
        tp = group.size if group else 1
        self.per_rank = vocab_padded // tp
        self.start = 0  # rank 0
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The partial embedding (before the reduction over ranks)."""
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary across the TP group (Megatron-LM's algorithm):
    all-reduce of the max, of the target logit and of the sum of exponentials; the backward is
    local (softmax minus one-hot)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        logits_max = parallel.all_reduce(logits.amax(dim=-1), group, op="max")
        logits = logits - logits_max.unsqueeze(-1)
        per_rank = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        flat = logits.view(-1, per_rank)
        rows = torch.arange(flat.shape[0], device=flat.device)
        predicted = flat[rows, local_target.view(-1)].view_as(target).masked_fill(outside, 0.0)
        predicted = parallel.all_reduce(predicted, group)
        exp_logits = torch.exp(logits)
        sum_exp = parallel.all_reduce(exp_logits.sum(dim=-1), group)
        loss = torch.log(sum_exp) - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        per_rank = softmax.shape[-1]
        grad = softmax.view(-1, per_rank)
        rows = torch.arange(grad.shape[0], device=grad.device)
        hit = 1.0 - outside.view(-1).float()
        grad.index_put_((rows, local_target.view(-1)), -hit, accumulate=True)  # in place, as Megatron-LM
        return softmax.mul_(grad_loss.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits, target, group: TPGroup | None) -> torch.Tensor:
    """Per-token loss from fp32 logits sharded by vocabulary ([s, b, v/tp]) and targets [s, b]."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, 0)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x tp (``_vocab_size_with_padding``,
    ``--make-vocab-size-divisible-by`` default 128) so each rank holds an equal, aligned shard."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def clamped_swiglu(h: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gated unit on [..., 2f] (gate and up halves), as unfused elementwise kernels (a dense
    MLP; Megatron-Core's experts fuse it: ``fused_elementwise.clamped_geglu``)."""
    return clamped_geglu_reference(h)
