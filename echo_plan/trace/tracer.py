"""The tracer's entry points: one stage, or the three stages a model's plan needs.

A cache hit never imports torch; a miss builds the stage under FakeTensorMode and a fake process
group (``capture.py``), records it and stores it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echo_plan.specs import DType, ModelSpec, PlanSpec, Recompute, SoftwareSpec, load_stack
from echo_plan.specs.moe import DENSE, ExpertLayout, LayerKind
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.keys import code_version, make_key
from echo_plan.trace.records import LayerTrace, StageKind


@dataclass(frozen=True)
class ModelTraces:
    """The traces of one plan: one per layer kind (``blocks``), the embedding and the output stage.
    ``block`` is the trace of the kind most layers have (the only one of a dense model)."""

    block: LayerTrace
    embedding: LayerTrace
    output: LayerTrace
    blocks: tuple[tuple[LayerKind, LayerTrace], ...] = ()

    def of(self, kind: LayerKind) -> LayerTrace:
        for k, t in self.blocks:
            if k == kind:
                return t
        return self.block


def expert_layout(plan: PlanSpec) -> ExpertLayout:
    return ExpertLayout(ep=plan.ep, etp=plan.expert_tp, imbalance=plan.expert_imbalance)


def trace_stage(model: ModelSpec, stage: StageKind, *, tp: int, sequence_parallel: bool,
                micro_batch_size: int, dtype: DType, recompute: Recompute,
                cache: TraceCache | None = None, stack: SoftwareSpec | None = None,
                kind: LayerKind = DENSE, layout: ExpertLayout | None = None, cp: int = 1) -> LayerTrace:
    """Trace one stage on TP rank 0 for one micro-batch (from ``cache`` when it holds it), running
    the kernels of ``stack`` (default: the megatron-core preset); a block stage traces a layer of
    ``kind`` (MoE layers with the expert ``layout``; default: no expert parallelism, etp = tp), on
    CP rank 0 of ``cp`` (its s / cp tokens, attention over the whole sequence).

    Raises SpecError when ``tp`` cannot shard the model, or for a bad micro-batch or dtype.
    """
    stack = stack if stack is not None else load_stack()
    if kind.moe and layout is None:
        layout = ExpertLayout(etp=tp)
    software = stack.trace_signature()
    if DType(dtype).low_precision:  # the recipe changes a low-precision trace's casts, GEMM scales and weight copies
        software += ";" + stack.precision_signature(dtype)
    key = make_key(model, StageKind(stage), tp=tp, sequence_parallel=sequence_parallel,
                   micro_batch_size=micro_batch_size, dtype=dtype, recompute=recompute,
                   version=code_version(), software=software, kind=kind, layout=layout, cp=cp)
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    from echo_plan.trace.capture import capture  # deferred: loads numpy, torch

    known = None  # a cached trace of this stage under another recompute mode measured every mode's saved bytes
    if cache is not None and StageKind(stage) is StageKind.BLOCK:
        for other in Recompute:
            if other.value != key.recompute:
                hit = cache.peek(replace(key, recompute=other.value))
                if hit is not None and len(hit.saved_bytes_by_mode) == len(Recompute):
                    known = dict(hit.saved_bytes_by_mode)
                    break
    got = capture(model, key.stage, tp=key.tp, sequence_parallel=key.sequence_parallel,
                  micro_batch_size=key.micro_batch_size, dtype=DType(dtype),
                  recompute=Recompute(key.recompute), stack=stack, kind=kind, layout=layout, known_saved=known, cp=cp)
    trace = LayerTrace(
        key=key, ops=got.ops, saved_bytes=got.saved_bytes_by_mode[key.recompute],
        saved_bytes_by_mode=dict(got.saved_bytes_by_mode), param_count=got.param_count,
    )
    if cache is not None:
        cache.put(trace)
    return trace


def trace_model(model: ModelSpec, plan: PlanSpec, cache: TraceCache | None = None,
                stack: SoftwareSpec | None = None) -> ModelTraces:
    """The block, embedding and output traces for ``plan``'s tp, sequence parallelism, micro-batch,
    dtype and recompute mode, with ``stack``'s kernels."""
    common = dict(tp=plan.tp, sequence_parallel=plan.sequence_parallel,
                  micro_batch_size=plan.micro_batch_size, dtype=plan.dtype, recompute=plan.recompute, cache=cache,
                  stack=stack if stack is not None else load_stack(), cp=plan.cp)
    layout = expert_layout(plan)
    blocks = tuple((kind, trace_stage(model, StageKind.BLOCK, kind=kind, layout=layout if kind.moe else None,
                                      **common))
                   for kind in model.distinct_kinds())
    if plan.recompute_layers:  # the layers recomputed whole: the same kinds traced under full recompute
        full = {**common, "recompute": Recompute.FULL}
        blocks += tuple((kind._replace(recomputed=True),
                         trace_stage(model, StageKind.BLOCK, kind=kind, layout=layout if kind.moe else None, **full))
                        for kind in model.distinct_kinds())
    kinds = model.layer_kinds()
    main = max(blocks, key=lambda kt: kinds.count(kt[0]))[1]
    return ModelTraces(
        block=main,
        embedding=trace_stage(model, StageKind.EMBEDDING, **common),
        output=trace_stage(model, StageKind.OUTPUT, **common),
        blocks=blocks,
    )
