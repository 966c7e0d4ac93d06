"""The split of a traced backward into its two parts, for the schedules that run them apart.

Zero-bubble schedules (Qi et al., ICLR 2024) and DualPipe run a layer's backward as two separately
scheduled passes: B, the input gradient (what the previous stage waits for), and W, the weight
gradients (deferrable). The trace already records them as separate ops; :func:`split_backward`
tells them apart by data flow:

* a *weight-gradient GEMM* is a backward GEMM that reads an activation of the forward pass (or of
  its recomputation), directly or through ops that remake it from saved activations alone (the
  re-gather of a linear's input under sequence parallelism, the FP8 transpose of a saved input, the
  FP8 cast of a saved bf16 input); an input-gradient GEMM reads only the incoming gradient and the
  weight (or the weight's once-per-step FP8 copy, which is no activation);
* everything computed from a weight gradient (the fp32 main-grad accumulation without
  gradient-accumulation fusion) is W too, and so is an op all of whose consumers are W (that
  re-gather) unless it writes fewer bytes than it reads: a cast of a bf16 gradient to FP8 that only W
  reads (DeepSeek's per-channel cast) runs in B, so W keeps the FP8 copy, not the bf16 gradient
  (JUDGEMENT: the placement that keeps less alive; re-gathers and transposes, which write as much or
  more, keep their smaller input instead);
* a stage with no input gradient (the embedding) is all W; norms' backward, which computes the
  input and the weight gradient in one kernel, stays in B.

``retained_bytes`` is what deferring W keeps alive past B for one micro-batch: the forward
activations and the gradients that W reads (each producing op's output of the read size). Both
follow from the plan's trace alone, so the memory model (cost/) and the replay (replay/split.py,
which times each part) read them from here.
"""

from __future__ import annotations

from echo_plan.trace.records import LayerTrace, OpKind, OpRecord, Phase, StageKind

__all__ = ["split_backward", "retained_bytes"]


def split_backward(trace: LayerTrace) -> tuple[tuple[OpRecord, ...], tuple[OpRecord, ...]]:
    """(B ops, W ops) of the trace's backward (recompute ops included), each in trace order."""
    ops = trace.ops
    bwd = [op for op in ops if op.phase is not Phase.FORWARD]
    if trace.key.stage == StageKind.EMBEDDING:
        return (), tuple(bwd)  # token ids have no gradient: the embedding's backward is all weight gradient
    by_index = {op.index: op for op in ops}
    fwd_origin: dict[int, bool] = {}

    def from_forward(i: int) -> bool:
        """Op ``i`` produced (or re-gathered) a forward or recomputed activation."""
        hit = fwd_origin.get(i)
        if hit is None:
            op = by_index[i]
            if op.phase is Phase.STEP:
                hit = False  # a weight's once-per-step FP8 copy: a weight, not an activation
            elif op.phase is not Phase.BACKWARD:
                hit = True
            elif op.kind is not OpKind.GEMM and op.deps:
                hit = all(from_forward(d) for d in op.deps)  # re-gathered, transposed or re-cast from one
            else:
                hit = False
            fwd_origin[i] = hit
        return hit

    w: set[int] = set()
    for op in bwd:
        if op.kind is OpKind.GEMM and op.phase is Phase.BACKWARD and any(from_forward(d) for d in op.deps):
            w.add(op.index)
        elif op.deps and any(d in w for d in op.deps) and op.phase is Phase.BACKWARD:
            w.add(op.index)  # computed from a weight gradient (main-grad accumulation, views of it)
    consumers: dict[int, list[int]] = {}
    for op in bwd:
        for d in op.deps:
            consumers.setdefault(d, []).append(op.index)
    kind_of = {op.index: op.kind for op in bwd}
    for op in reversed(bwd):  # an op only W reads (the input re-gather for a weight gradient) is W
        users = [u for u in consumers.get(op.index, ()) if kind_of[u] is not OpKind.VIEW or consumers.get(u)]
        if op.index not in w and users and all(u in w for u in users) and _nbytes(op.outputs) >= _nbytes(op.inputs):
            w.add(op.index)
    return tuple(op for op in bwd if op.index not in w), tuple(op for op in bwd if op.index in w)


def retained_bytes(trace: LayerTrace, w_ops: tuple[OpRecord, ...]) -> int:
    """Bytes W reads that other passes produced: kept alive from B until W (one micro-batch)."""
    by_index = {op.index: op for op in trace.ops}
    in_w = {op.index for op in w_ops}
    kept: dict[tuple[int, int], int] = {}
    for op in w_ops:
        sizes = {m.numel for m in op.inputs}
        for d in op.deps:
            if d in in_w:
                continue
            src = by_index[d]
            if src.kind is OpKind.VIEW:
                continue
            for k, out in enumerate(src.outputs):
                if out.numel in sizes:
                    kept[(d, k)] = out.numel * _itemsize(out.dtype)
                    break
    return sum(kept.values())


def _nbytes(tensors) -> int:
    return sum(t.numel * _itemsize(t.dtype) for t in tensors)


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "float64": 8, "int64": 8, "int32": 4, "bool": 1, "uint8": 1, "int8": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1}.get(dtype, 2)
