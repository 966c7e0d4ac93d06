"""What a fused-attention kernel costs (``compute.py`` times it with these figures).

* The efficiency per GPU generation and direction (``compute.yaml``: the default library's, or
  FlashAttention-2's or FlashAttention-3's where the stack's ``attention_library`` says so, their causal
  kernels at their measured share of the unmasked rate; flash-attn 1.x's Triton kernel at a
  fitted share of FlashAttention-2's, ``flash_attn_triton`` there), times the dropout kernel's
  share, the wave quantisation of batch x heads x 128-row query blocks over the SMs, the short-key
  penalty s_k / (s_k + half) and the head-dimension factor.
* The work: torch's counter counts the full s_q x s_k score matrix; a causal kernel does the
  ``causal_work_fraction`` of it (or 1 - (1 - f) s_q / s_k when its queries are the last of its keys),
  an unmasked context-parallel ring step all of it.

Pure functions of the traced op, the GPU and the constants; and the reading of compute.yaml's
``flash_attn_triton`` entry (its rate and the rows it was fitted on) into those constants.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from echo_plan.specs.cluster import GPUSpec
from echo_plan.trace.records import OpKind, OpRecord

if TYPE_CHECKING:
    from echo_plan.cost.compute_constants import ComputeConstants

FLASH_ATTN_2 = "flash-attn-2"  # specs.software.AttentionLibrary.FLASH_ATTN_2
FLASH_ATTN_TRITON = "flash-attn-triton"  # specs.software.AttentionLibrary.FLASH_ATTN_TRITON
FLASH_ATTN_3 = "flash-attn-3"  # specs.software.AttentionLibrary.FLASH_ATTN_3


def attention_efficiency(op: OpRecord, gpu: GPUSpec, constants: "ComputeConstants", library: str = "cudnn",
                         causal_attention: bool = True) -> tuple[float, float]:
    """(fraction of the GPU's peak, FLOPs really done) of one fused-attention kernel."""
    c = constants
    arch = c.arch_params(gpu.sm_arch)
    forward, backward, causal_share = library_rates(arch, library)
    base = backward if is_backward(op) else forward
    if library == FLASH_ATTN_TRITON:  # FlashAttention-2's rate on this GPU times the fitted ratio (compute.yaml)
        base *= c.triton_attention_rate
    if "dropout" in op.name:  # the fused kernel with dropout (trace/kernels.py)
        base *= c.attention_dropout_eff
    causal = causal_attention and not is_noncausal(op)
    if causal:  # a library's published rates are unmasked; its causal kernels reach this share of them
        base *= causal_share
    work = c.causal_work_fraction if causal else 1.0
    dims = attention_dims(op)
    if dims is None:
        return base, op.flops * work
    b, heads, s_q, s_k = dims
    if causal and s_q < s_k:  # bottom-right aligned mask (a late query chunk over all earlier keys)
        work = 1.0 - (1.0 - c.causal_work_fraction) * s_q / s_k
    head_dim = [t for t in op.inputs if len(t.shape) == 4][0].shape[-1]
    flops = op.flops if op.flops > 0 else 4.0 * b * heads * s_q * s_k * head_dim
    if is_backward(op) and op.flops <= 0:
        flops *= 2.5  # torch's counter: backward is five score-sized matmuls to forward's two
    ctas = b * heads * math.ceil(s_q / c.attention_block_rows)
    waves = math.ceil(ctas / gpu.sm_count)
    wave_q = ctas / (waves * gpu.sm_count)
    seq = s_k / (s_k + c.attention_seq_half)
    return base * wave_q * seq * head_dim_factor(head_dim, c.attention_head_dim_half), flops * work


def library_rates(arch, library: str) -> tuple[float, float, float]:
    """(forward, backward efficiency, causal share) of ``library``'s fused-attention kernels on a generation: its
    own measured figures where ``compute.yaml`` has them (FlashAttention-2's, which the Triton kernel is priced off;
    FlashAttention-3's), else the default library's, fitted on causal runs (share 1)."""
    if library in (FLASH_ATTN_2, FLASH_ATTN_TRITON) and arch.fa2_forward_eff is not None:
        backward = arch.fa2_backward_eff if arch.fa2_backward_eff is not None else arch.attention_backward_eff
        return arch.fa2_forward_eff, backward, arch.fa2_causal_ratio
    if library == FLASH_ATTN_3 and arch.fa3_forward_eff is not None and arch.fa3_backward_eff is not None:
        return arch.fa3_forward_eff, arch.fa3_backward_eff, arch.fa3_causal_ratio  # Hopper only
    return arch.attention_forward_eff, arch.attention_backward_eff, 1.0


def head_dim_factor(head_dim: int, half: float) -> float:
    """Efficiency relative to head dim 128 (where the per-generation figures were measured): a
    narrower head does less matmul work per loaded tile, d / (d + half), never above 1."""
    if half <= 0 or head_dim <= 0:
        return 1.0
    return min(1.0, (head_dim / (head_dim + half)) / (128.0 / (128.0 + half)))


def attention_dims(op: OpRecord) -> tuple[int, int, int, int] | None:
    """(batch, heads, s_q, s_k) of fused attention from its query and key (b, heads, s, d)."""
    four = [t for t in op.inputs if len(t.shape) == 4]
    if len(four) < 2:
        return None
    # the backward kernels take grad_out first, then query, key, value
    q, k = (four[1], four[2]) if is_backward(op) and len(four) >= 4 else (four[0], four[1])
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2]


def is_noncausal(op: OpRecord) -> bool:
    """An attention kernel launched without the causal mask (a context-parallel ring step whose keys
    all precede its queries, ``trace/kernels.py``): all of its counted work is done."""
    return "noncausal" in op.name


def attention_work_flops(op: OpRecord, causal_work_fraction: float = 0.5) -> float:
    """The FLOPs an attention kernel really does: the counted (full-matrix) FLOPs times the share the
    causal mask leaves (all of it for an unmasked kernel; 1 - (1 - f) s_q / s_k for a causal one)."""
    if op.kind is not OpKind.ATTENTION:
        return 0.0
    if is_noncausal(op):
        return op.flops
    dims = attention_dims(op)
    if dims is None or dims[2] >= dims[3]:
        return op.flops * causal_work_fraction
    return op.flops * (1.0 - (1.0 - causal_work_fraction) * dims[2] / dims[3])


def is_backward(op: OpRecord) -> bool:
    """A backward kernel (its aten name says so); ops merely run during backward are not."""
    return "backward" in op.name


def triton_attention_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    """The Triton FlashAttention's rate relative to FlashAttention-2 and the validation rows it was fitted on."""
    if not entry:
        return {}
    rate = float(entry["rate_vs_flash_attn_2"])
    if not 0.0 < rate <= 2.0:
        raise ValueError(f"flash_attn_triton.rate_vs_flash_attn_2 {rate} is not in (0, 2]")
    fitted, stand_in = ({str(k): tuple(str(x) for x in v) for k, v in (entry.get(key) or {}).items()}
                        for key in ("fitted_on", "stand_in"))
    return {"triton_attention_rate": rate, "triton_attention_fitted_on": MappingProxyType(fitted),
            "triton_attention_stand_in": MappingProxyType(stand_in)}
