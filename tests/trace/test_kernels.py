"""The fused kernels' CPU references compute what the unfused PyTorch code computes, gradients included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from echo_plan.trace import kernels as K


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _same_values_and_grads(out, ref, inputs):
    g = torch.randn_like(out)
    assert torch.allclose(out, ref, atol=1e-5)
    for a, b in zip(_grads(out, inputs, g), _grads(ref, inputs, g)):
        assert torch.allclose(a, b, atol=1e-5)


def test_flash_attention_matches_sdpa_with_grouped_query_heads():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(2))
    out = K.attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    _same_values_and_grads(out, ref, (q, k, v))


def test_dropout_in_attention_is_the_same_mask_forward_and_backward():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    p, seed = 0.3, 5
    out = K.flash_attention_dropout(q, k, v, True, p, seed)[0]
    keep = K._keep_mask((1, 2, 8, 8), p, seed, q.device)  # the mask the kernel draws from its seed
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(scores, -1) * keep / (1 - p)) @ v
    _same_values_and_grads(out, ref, (q, k, v))


def test_fused_elementwise_kernels_match_the_unfused_ops():
    torch.manual_seed(2)
    x, b = torch.randn(5, 6, requires_grad=True), torch.randn(6, requires_grad=True)
    g = torch.randn(5, 6)
    fused, plain = K.bias_gelu(x, b), F.gelu(x + b, approximate="tanh")
    assert torch.allclose(fused, plain, atol=1e-6)
    assert all(torch.allclose(p, q, atol=1e-5) for p, q in zip(_grads(fused, (x, b), g), _grads(plain, (x, b), g)))
    h = torch.randn(5, 8, requires_grad=True)
    gate, up = h.chunk(2, -1)
    fused, plain = K.swiglu(h), F.silu(gate) * up
    g = torch.randn_like(fused)
    assert torch.allclose(_grads(fused, (h,), g)[0], _grads(plain, (h,), g)[0], atol=1e-6)
    s = torch.randn(2, 3, 6, 6, requires_grad=True)
    mask = torch.ones(6, 6, dtype=torch.bool).triu(1)
    fused, plain = K.scaled_masked_softmax(s, 0.5), torch.softmax((s * 0.5).masked_fill(mask, float("-inf")), -1)
    g = torch.randn_like(fused)
    assert torch.allclose(_grads(fused, (s,), g)[0], _grads(plain, (s,), g)[0], atol=1e-6)


def test_rope_rotates_part_of_each_head_and_its_backward_is_the_transpose():
    t = torch.randn(5, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(5, 1, 1, 4, dtype=torch.float64), torch.randn(5, 1, 1, 4, dtype=torch.float64)
    assert torch.equal(K.rope(t, cos, sin)[..., 4:], t[..., 4:])  # the unrotated half passes through
    assert torch.autograd.gradcheck(lambda x: K.rope(x, cos, sin), (t,))


def test_bias_dropout_add_keeps_a_one_byte_mask_and_passes_the_residual_gradient():
    x, r = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    out, mask = K.bias_dropout_add(x, b, r, 0.2, 3)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    gx, gb, gr = torch.autograd.grad(out, (x, b, r), torch.ones_like(out))
    assert torch.equal(gr, torch.ones_like(r)) and torch.allclose(gb, gx.sum(0))
    assert K.bias_dropout_add(x, b, r, 0.0, 3)[1].numel() == 0  # no dropout, no mask
