"""What an aten op is (OpKind), what it costs (FLOPs) and what memory it touches (bytes).

Kinds come from the op's name and torch's own op tags (``pointwise``, ``reduction``, view
schemas); FLOPs from torch's flop counter registry (``torch.utils.flop_counter``), which has
formulas for matmuls and fused attention; ops without a formula count zero FLOPs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from echo_plan.trace.records import CollectiveKind, OpKind

aten = torch.ops.aten

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "_scaled_grouped_mm",
         "convolution", "nvfp4_scaled_mm", "mx_scaled_grouped_mm"}
_ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_", "flash_attention")
_NORM = {"native_layer_norm", "native_layer_norm_backward", "rms_norm", "rms_norm_backward",
         "_fused_rms_norm", "_fused_rms_norm_backward", "native_group_norm", "native_group_norm_backward"}
_SOFTMAX = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
            "scaled_masked_softmax", "scaled_masked_softmax_backward"}
# echo_plan's fused elementwise kernels (trace/kernels.py) and torch's dropout kernels
_FUSED_ELEMENTWISE = {"bias_gelu", "bias_gelu_backward", "swiglu", "swiglu_backward", "swiglu_pair", "swiglu_pair_backward",
                      "bias_dropout_add",
                      "clamped_geglu", "clamped_geglu_backward", "weighted_act", "weighted_act_backward",
                      "attn_out_correction", "dropout_backward", "rope", "rope_backward", "native_dropout", "native_dropout_backward",
                      # Transformer Engine's FP8 casts (trace/fp8_kernels.py): bandwidth-bound
                      "fp8_cast", "fp8_cast_transpose", "fp8_transpose", "fp8_block_cast", "fp8_block_dequant", "fp8_weight_cast",
                      "fp8_grouped_weight_cast", "fp8_weight_transpose", "fp8_weight_quantize",
                      "fp8_channel_cast", "fp8_scale_transpose", "fp8_e5m6_cast", "fp8_e5m6_dequant",
                      # Blackwell's MXFP8 and NVFP4 quantizers (trace/mx_kernels.py)
                      "mx_cast", "mx_weight_cast", "nvfp4_cast", "nvfp4_weight_cast", "nvfp4_weight_transpose"}
_EMBEDDING = {"embedding", "embedding_dense_backward", "index_select", "index_add", "index_add_",
              "gather", "scatter_add", "scatter_add_", "index", "index_put", "index_put_", "_index_put_impl_",
              "moe_permute", "moe_permute_backward", "moe_unpermute", "moe_unpermute_backward", "moe_unpermute_sum"}  # trace/moe_kernels.py
_COPY = {"copy_", "clone", "_to_copy", "cat", "stack", "contiguous", "_copy_from", "repeat", "constant_pad_nd",
         "slice_backward", "select_backward", "narrow_copy", "as_strided_scatter", "slice_scatter"}
_VIEW_NAMES = {"_unsafe_view", "detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided",
               "new_empty", "new_empty_strided", "_local_scalar_dense", "set_", "resize_", "wait_tensor",
               "assemble", "fp8_payload", "fp8_arrived", "deepep_token_rows", "deepep_token_rows_backward",
               "deepep_combined", "deepep_combined_backward"}
_FILL = {"zeros_like", "ones_like", "full_like", "zeros", "ones", "full", "fill_", "zero_", "new_zeros",
         "new_ones", "new_full", "arange", "scalar_tensor"}
_GATHERS = {"index", "gather", "index_select"}
_SCATTERS = {"index_put_", "_index_put_impl_", "scatter_add_", "index_add_"}
_REDUCTION = {"nll_loss_forward", "nll_loss_backward", "amax", "amin", "sum", "mean", "var_mean", "norm", "fp8_amax",
              "nvfp4_amax"}

# torch's CPU flash-attention ops compute what the CUDA ones do; the registry only names the latter.
_FLOP_ALIASES = {
    "_scaled_dot_product_flash_attention_for_cpu": aten._scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_for_cpu_backward": aten._scaled_dot_product_flash_attention_backward,
}

_COLLECTIVES = {
    "all_reduce": CollectiveKind.ALL_REDUCE, "all_reduce_": CollectiveKind.ALL_REDUCE,
    "all_gather_into_tensor": CollectiveKind.ALL_GATHER, "all_gather_into_tensor_out": CollectiveKind.ALL_GATHER,
    "reduce_scatter_tensor": CollectiveKind.REDUCE_SCATTER, "all_to_all_single": CollectiveKind.ALL_TO_ALL,
    "broadcast": CollectiveKind.BROADCAST, "broadcast_": CollectiveKind.BROADCAST,
    # torch.distributed's in-place forms (c10d), as Megatron-Core's own layers call them
    "allreduce_": CollectiveKind.ALL_REDUCE, "_allgather_base_": CollectiveKind.ALL_GATHER,
    "_reduce_scatter_base_": CollectiveKind.REDUCE_SCATTER, "alltoall_base_": CollectiveKind.ALL_TO_ALL,
}


def base_name(func: Any) -> str:
    """``aten.mm.default`` -> ``mm``."""
    return func._overloadpacket.__name__.split(".")[-1] if hasattr(func, "_overloadpacket") else str(func)


def collective_kind(func: Any) -> CollectiveKind | None:
    if func.namespace == "echo_plan":  # userbuffers' ring exchange: point-to-point
        return CollectiveKind.SEND_RECV if base_name(func) in ("ring_exchange", "cp_exchange") else None
    if func.namespace not in ("_c10d_functional", "c10d", "c10d_functional"):
        return None
    return _COLLECTIVES.get(base_name(func))


def op_kind(func: Any) -> OpKind:
    name = base_name(func)
    if collective_kind(func) is not None:
        return OpKind.COLLECTIVE
    if name in _VIEW_NAMES or getattr(func, "is_view", False):
        return OpKind.VIEW
    if name in _GEMM:
        return OpKind.GEMM
    if name.startswith(_ATTENTION_PREFIXES):
        return OpKind.ATTENTION
    if name in _NORM:
        return OpKind.NORM
    if name in _SOFTMAX:
        return OpKind.SOFTMAX
    if name in _EMBEDDING:
        return OpKind.EMBEDDING
    if name in _COPY:
        return OpKind.COPY
    if name in _FUSED_ELEMENTWISE:
        return OpKind.ELEMENTWISE
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags or name in _FILL:
        return OpKind.ELEMENTWISE
    if torch.Tag.reduction in tags or name in _REDUCTION:
        return OpKind.REDUCTION
    return OpKind.OTHER


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs by torch's flop counter formula for this op, or 0 where torch has none."""
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        alias = _FLOP_ALIASES.get(base_name(func))
        formula = flop_registry.get(alias) if alias is not None else None
    if formula is None:
        return 0.0
    return float(formula(*args, **kwargs, out_val=out))


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (broadcast dimensions count once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def op_bytes(func: Any, kind: OpKind, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes read, bytes written) by the kernel; zero for views and allocations."""
    if kind is OpKind.VIEW:
        return 0, 0
    name = base_name(func)
    written = sum(tensor_bytes(t) for t in outputs)
    if name == "embedding":  # reads the gathered rows and the indices, not the whole table
        return tensor_bytes(inputs[1]) + written, written
    if name == "copy_" and len(inputs) >= 2:  # reads the source only
        return tensor_bytes(inputs[1]), written
    if name in _GATHERS:  # reads the indices and the gathered elements, not the whole source
        return sum(tensor_bytes(t) for t in inputs[1:]) + written, written
    if name in _SCATTERS:  # in place: reads indices and values, writes only the addressed elements
        values = tensor_bytes(inputs[-1]) if inputs else 0
        return sum(tensor_bytes(t) for t in inputs[1:]) + values, values
    if name in _FILL:
        return 0, written
    seen: set[int] = set()
    read = 0
    for t in inputs:
        if id(t) not in seen:
            seen.add(id(t))
            read += tensor_bytes(t)
    return read, written
