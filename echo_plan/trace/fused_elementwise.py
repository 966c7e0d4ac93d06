"""Megatron-LM's fused elementwise kernels as torch custom ops (``kernels.py`` says why ops): one
kernel each, recorded with its real shapes, saving what the fused kernel saves.

* ``bias_gelu``: Megatron-LM's ``bias_gelu_impl`` (tanh GeLU of x + bias; saves x and bias).
* ``swiglu``: Megatron-LM's ``bias_swiglu_impl`` without bias (silu(gate) * up; saves the input).
* ``swiglu_pair``: the same on separate gate and up tensors (torch.compile's one kernel for torchtitan's
  ``silu(w1(x)) * w3(x)``; saves both inputs).
* ``bias_dropout_add``: Megatron-LM's ``bias_dropout_add_fused_train`` (residual + dropout(x + bias);
  saves a 1-byte mask), and ``dropout`` on its own.
* ``clamped_geglu``: GPT-OSS's clamped gated unit as Megatron-Core's experts run it with
  ``bias_activation_fusion`` (``weighted_bias_quick_geglu_impl`` in megatron/core/fusions/
  fused_bias_geglu.py, called from experts.py with the GPT-OSS provider's ``glu_linear_offset`` 1 and
  ``activation_func_clamp_value`` 7): gate.clamp(max=7) * sigmoid(1.702 gate) * (up.clamp(-7, 7) + 1),
  one kernel forward and one backward; saves its input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _keep_mask(shape, p: float, seed: int, device) -> Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(shape, generator=gen) >= p).to(device)


def _gelu_tanh_grad(x: Tensor) -> Tensor:
    """d/dx of tanh-GeLU (Megatron-LM's bias_gelu_back)."""
    c = math.sqrt(2.0 / math.pi)
    t = torch.tanh(c * x * (1.0 + 0.044715 * x * x))
    return 0.5 * x * ((1.0 - t * t) * (c + 0.1070322243 * x * x)) + 0.5 * (1.0 + t)


@torch.library.custom_op("echo_plan::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    return F.gelu(x + bias, approximate="tanh")


@torch.library.custom_op("echo_plan::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor) -> Tensor:
    return (grad.float() * _gelu_tanh_grad((x + bias).float())).to(grad.dtype)


bias_gelu.register_fake(lambda x, bias: torch.empty_like(x))
bias_gelu_backward.register_fake(lambda grad, x, bias: torch.empty_like(grad))


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_gelu_bwd(ctx, grad):
    x, bias = ctx.saved_tensors
    gx = bias_gelu_backward(grad, x, bias)
    return gx, gx.reshape(-1, gx.shape[-1]).sum(0)


bias_gelu.register_autograd(_bias_gelu_bwd, setup_context=_bias_gelu_setup)


@torch.library.custom_op("echo_plan::swiglu", mutates_args=())
def swiglu(h: Tensor) -> Tensor:
    gate, up = torch.chunk(h, 2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("echo_plan::swiglu_backward", mutates_args=())
def swiglu_backward(grad: Tensor, h: Tensor) -> Tensor:
    gate, up = (t.float() for t in torch.chunk(h, 2, dim=-1))
    sig = torch.sigmoid(gate)
    g = grad.float()
    return torch.cat((g * up * sig * (1 + gate * (1 - sig)), g * gate * sig), dim=-1).to(grad.dtype)


swiglu.register_fake(lambda h: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
swiglu_backward.register_fake(lambda grad, h: torch.empty_like(h))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_bwd(ctx, grad):
    (h,) = ctx.saved_tensors
    return swiglu_backward(grad, h)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op("echo_plan::swiglu_pair", mutates_args=())
def swiglu_pair(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


@torch.library.custom_op("echo_plan::swiglu_pair_backward", mutates_args=())
def swiglu_pair_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    g, a, u = grad.float(), gate.float(), up.float()
    sig = torch.sigmoid(a)
    return (g * u * sig * (1 + a * (1 - sig))).to(grad.dtype), (g * a * sig).to(grad.dtype)


swiglu_pair.register_fake(lambda gate, up: torch.empty_like(gate))
swiglu_pair_backward.register_fake(lambda grad, gate, up: (torch.empty_like(gate), torch.empty_like(up)))


def _swiglu_pair_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_pair_bwd(ctx, grad):
    return swiglu_pair_backward(grad, *ctx.saved_tensors)


swiglu_pair.register_autograd(_swiglu_pair_bwd, setup_context=_swiglu_pair_setup)


CLAMP_LIMIT, CLAMPED_ALPHA = 7.0, 1.702  # GPT-OSS (OpenAI 2025 model card and reference implementation)


def clamped_geglu_reference(h: Tensor) -> Tensor:
    """The clamped gated unit on [..., 2f] (gate and up halves) in plain torch ops (unfused kernels)."""
    gate, up = torch.chunk(h, 2, dim=-1)
    gate = gate.clamp(max=CLAMP_LIMIT)
    up = up.clamp(min=-CLAMP_LIMIT, max=CLAMP_LIMIT)
    return gate * torch.sigmoid(gate * CLAMPED_ALPHA) * (up + 1)


@torch.library.custom_op("echo_plan::clamped_geglu", mutates_args=())
def clamped_geglu(h: Tensor) -> Tensor:
    return clamped_geglu_reference(h)


@torch.library.custom_op("echo_plan::clamped_geglu_backward", mutates_args=())
def clamped_geglu_backward(grad: Tensor, h: Tensor) -> Tensor:
    gate, up = (t.float() for t in torch.chunk(h, 2, dim=-1))
    g = grad.float()
    gate_c = gate.clamp(max=CLAMP_LIMIT)
    up_c = up.clamp(min=-CLAMP_LIMIT, max=CLAMP_LIMIT)
    sig = torch.sigmoid(CLAMPED_ALPHA * gate_c)
    d_gate = g * (up_c + 1) * sig * (1 + CLAMPED_ALPHA * gate_c * (1 - sig)) * (gate <= CLAMP_LIMIT)
    d_up = g * gate_c * sig * ((up >= -CLAMP_LIMIT) & (up <= CLAMP_LIMIT))
    return torch.cat((d_gate, d_up), dim=-1).to(grad.dtype)


clamped_geglu.register_fake(lambda h: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
clamped_geglu_backward.register_fake(lambda grad, h: torch.empty_like(h))


def _clamped_geglu_bwd(ctx, grad):
    (h,) = ctx.saved_tensors
    return clamped_geglu_backward(grad, h)


clamped_geglu.register_autograd(_clamped_geglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op("echo_plan::bias_dropout_add", mutates_args=())
def bias_dropout_add(x: Tensor, bias: Tensor | None, residual: Tensor, p: float, seed: int) -> tuple[Tensor, Tensor]:
    y = x + bias if bias is not None else x
    if p > 0:
        keep = _keep_mask(y.shape, p, seed, y.device)
        return residual + y * keep / (1.0 - p), keep
    return residual + y, torch.empty(0, dtype=torch.bool, device=y.device)


@torch.library.custom_op("echo_plan::dropout_backward", mutates_args=())
def dropout_backward(grad: Tensor, keep: Tensor, p: float) -> Tensor:
    return grad * keep / (1.0 - p)


@bias_dropout_add.register_fake
def _bda_fake(x, bias, residual, p, seed):
    mask = x.new_empty(x.shape, dtype=torch.bool) if p > 0 else x.new_empty((0,), dtype=torch.bool)
    return torch.empty_like(residual), mask


dropout_backward.register_fake(lambda grad, keep, p: torch.empty_like(grad))


def _bda_setup(ctx, inputs, output):
    x, bias, _residual, p, _seed = inputs
    ctx.p, ctx.has_bias = p, bias is not None
    ctx.save_for_backward(output[1])
    ctx.set_materialize_grads(False)


def _bda_bwd(ctx, grad, _grad_mask):
    (keep,) = ctx.saved_tensors
    gx = dropout_backward(grad, keep, ctx.p) if ctx.p > 0 else grad
    gb = gx.reshape(-1, gx.shape[-1]).sum(0) if ctx.has_bias else None
    return gx, gb, grad, None, None


bias_dropout_add.register_autograd(_bda_bwd, setup_context=_bda_setup)


def dropout(x: Tensor, p: float) -> Tensor:
    """Dropout as the GPU runs it: one ``native_dropout`` kernel keeping a 1-byte mask (on the CPU
    ``F.dropout`` decomposes into bernoulli, divide and multiply, saving a 2-byte scaled mask)."""
    return torch.ops.aten.native_dropout(x, p, True)[0] if p > 0 else x
