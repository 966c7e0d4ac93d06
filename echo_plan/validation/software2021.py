"""The kernels Megatron-LM ran in 2021, for predicting measurements taken with it.

The tracer records attention as one fused causal kernel (FlashAttention / SDPA, 2022 and later).
Narayanan et al. 2021 predates it: Megatron-LM's ``CoreAttention`` then computed the scores with
a batched GEMM (``baddbmm`` of Q and K^T), ran a fused scale-mask-softmax kernel and attention
dropout over the whole ``s x s`` score matrix (materialised in fp16, causal blocks not skipped),
and multiplied by V with a second batched GEMM; backward ran four batched GEMMs plus the dropout
and softmax backward over the same matrix. :class:`UnfusedAttentionModel` wraps any
ComputeModel and costs an attention op that way, with the wrapped model's own GEMM and
memory-bound kernel times, so it adds no constant of its own.

:class:`ScaledComputeModel` multiplies every compute time by one factor: the validation fits it
on a subset of the table's rows and reports the error on the others (see megatron.py).
"""

from __future__ import annotations

from echo_plan.cost.compute import attention_dims
from echo_plan.specs.cluster import DType, GPUSpec
from echo_plan.trace.records import OpKind, OpRecord, Phase, Stream, TensorMeta


def _op(name: str, kind: OpKind, inputs, outputs, flops: float, rd: int, wr: int) -> OpRecord:
    return OpRecord(0, name, kind, Phase.FORWARD, Stream.COMPUTE, tuple(inputs), tuple(outputs), flops, rd, wr, ())


def _bmm(batch: int, m: int, n: int, k: int, dtype: str) -> OpRecord:
    a, b, c = TensorMeta((batch, m, k), dtype), TensorMeta((batch, k, n), dtype), TensorMeta((batch, m, n), dtype)
    return _op("aten.bmm.default", OpKind.GEMM, (a, b), (c,), 2.0 * batch * m * n * k,
               2 * (a.numel + b.numel), 2 * c.numel)


def _pointwise(name: str, kind: OpKind, elements: int, read_per: int, write_per: int) -> OpRecord:
    return _op(name, kind, (), (), 0.0, read_per * elements, write_per * elements)


class UnfusedAttentionModel:
    """A ComputeModel that costs fused attention ops as 2021 Megatron-LM's unfused attention."""

    def __init__(self, base) -> None:
        self.base = base
        self._cache: dict[tuple, float] = {}

    def op_time(self, op: OpRecord, gpu: GPUSpec, dtype: DType) -> float:
        if op.kind is not OpKind.ATTENTION:
            return self.base.op_time(op, gpu, dtype)
        dims = attention_dims(op)
        four = [t for t in op.inputs if len(t.shape) == 4]
        if dims is None or not four:
            return self.base.op_time(op, gpu, dtype)
        key = (dims, four[0].shape[-1], "backward" in op.name, gpu.name, dtype)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = sum(
                self.base.op_time(k, gpu, dtype) for k in self._kernels(dims, four[0].shape[-1], "backward" in op.name,
                                                                          four[0].dtype))
        return hit

    @staticmethod
    def _kernels(dims, d: int, backward: bool, dtype: str) -> list[OpRecord]:
        b, heads, s_q, s_k = dims
        bh = b * heads
        scores = bh * s_q * s_k
        if not backward:
            return [
                _bmm(bh, s_q, s_k, d, dtype),  # Q K^T
                _pointwise("fused_scale_mask_softmax", OpKind.SOFTMAX, scores, 2, 2),
                _pointwise("attention_dropout", OpKind.ELEMENTWISE, scores, 2, 3),  # output + 1-byte mask
                _bmm(bh, s_q, d, s_k, dtype),  # probabilities x V
            ]
        return [
            _bmm(bh, s_q, s_k, d, dtype),  # d(probs) = dO V^T
            _bmm(bh, s_k, d, s_q, dtype),  # dV = probs^T dO
            _pointwise("attention_dropout_backward", OpKind.ELEMENTWISE, scores, 3, 2),
            _pointwise("fused_scale_mask_softmax_backward", OpKind.SOFTMAX, scores, 4, 2),
            _bmm(bh, s_q, d, s_k, dtype),  # dQ = dS K
            _bmm(bh, s_k, d, s_q, dtype),  # dK = dS^T Q
        ]


class ScaledComputeModel:
    """Every compute op of ``base`` takes ``factor`` times as long."""

    def __init__(self, base, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"factor must be positive, got {factor!r}")
        self.base = base
        self.factor = factor

    def op_time(self, op: OpRecord, gpu: GPUSpec, dtype: DType) -> float:
        return self.base.op_time(op, gpu, dtype) * self.factor
