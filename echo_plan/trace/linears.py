"""The tensor-parallel linears the layers call: Megatron-LM's column- and row-parallel linear, each
dispatched to its bf16 form (parallel.py), its Transformer Engine TP-overlap form (overlap.py) or its
FP8 form (fp8.py). Above those three modules, so none of them imports another through it."""

from __future__ import annotations

from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.fp8 import fp8_column_linear, fp8_column_linears, fp8_row_linear
from echo_plan.trace.overlap import pipelined_reduce_scatter_linear, ring_gather_linear
from echo_plan.trace.parallel import (_ParallelLinear, column_comm, reduce_from_tp, reduce_scatter_to_sp,
                                      shared_input_linears)


def column_parallel_linear(x, weight, bias, group: TPGroup | None, sequence_parallel: bool,
                           accumulate_unfused: bool = False, overlap: bool = False, fp8=None):
    """Column-parallel linear: the input is replicated (or gathered from sequence shards).

    With ``overlap`` (Transformer Engine userbuffers, needs sequence parallelism) the gather is
    pipelined with the GEMM as ring exchanges (``echo_plan.trace.overlap``). With ``fp8`` (an
    ``fp8.Fp8State``) the GEMMs run in FP8 (``echo_plan.trace.fp8``)."""
    if fp8 is not None:
        return fp8_column_linear(x, weight, bias, group, sequence_parallel, accumulate_unfused, overlap, fp8)
    gather, reduce_grad = column_comm(group, sequence_parallel)
    if overlap and gather:
        return ring_gather_linear(x, weight, bias, group, accumulate_unfused)
    return _ParallelLinear.apply(x, weight, bias, group, gather, reduce_grad, accumulate_unfused)


def row_parallel_linear(x, weight, group: TPGroup | None, sequence_parallel: bool,
                        accumulate_unfused: bool = False, overlap: bool = False, fp8=None):
    """Row-parallel linear without its bias: partial sums all-reduced (or reduce-scattered into
    sequence shards). The caller adds the bias, fused with what follows (Megatron-LM's
    ``skip_bias_add``). With ``overlap`` the reduce-scatter is pipelined with the GEMM; with ``fp8``
    the GEMMs run in FP8."""
    if fp8 is not None:
        return fp8_row_linear(x, weight, group, sequence_parallel, accumulate_unfused, overlap, fp8)
    if overlap and sequence_parallel and group is not None:
        return pipelined_reduce_scatter_linear(x, weight, group, accumulate_unfused)
    out = _ParallelLinear.apply(x, weight, None, group, False, None, accumulate_unfused)
    return reduce_scatter_to_sp(out, group) if sequence_parallel else reduce_from_tp(out, group)


def column_parallel_linears(x, weights, biases, group: TPGroup | None, sequence_parallel: bool,
                            accumulate_unfused: bool = False, overlap: bool = False, fp8=None) -> tuple:
    """Several column-parallel linears on one input, a GEMM and a weight each (``fused_projections`` off:
    torchtitan's wq/wk/wv and w1/w3). The input crosses into the TP region once for all of them, as DTensor's
    ``PrepareModuleInput`` gathers it once (with ``overlap``, as ring exchanges beside every weight's GEMM: async
    TP's fused all-gather-matmul takes several weights), and the summed input gradient is reduced once.
    JUDGEMENT: that reduction runs beside the weight-gradient GEMMs and the shard is saved and gathered again in
    backward, Megatron's overlaps (``parallel._SharedInputLinears``); eager DTensor keeps the gathered input and
    reduce-scatters after the three GEMMs' backward, while under torch.compile the collectives' placement is the
    compiler's (docs/fsdp.md). In FP8 the input is cast once and gathered in FP8 (``fp8.fp8_column_linears``)."""
    if fp8 is not None and all(b is None for b in biases):
        return fp8_column_linears(x, weights, group, sequence_parallel, accumulate_unfused, fp8, overlap)
    if fp8 is not None:  # biased FP8 projections: a linear (and a cast and gather) each
        return tuple(column_parallel_linear(x, w, b, group, sequence_parallel, accumulate_unfused, overlap, fp8)
                     for w, b in zip(weights, biases))
    return shared_input_linears(x, weights, biases, group, sequence_parallel, accumulate_unfused, overlap)
