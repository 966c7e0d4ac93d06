"""LayerTrace <-> JSON-ready dicts. Decoding validates every field and raises ValueError/KeyError/
TypeError on anything malformed, so a damaged file can never yield a half-valid trace."""

from __future__ import annotations

from typing import Any

from echo_plan.trace.records import (
    CollectiveInfo, CollectiveKind, CommGroup, GroupKind, LayerTrace, OpKind, OpRecord, Phase, StageKind,
    Stream, TensorMeta, TraceKey,
)


def key_to_dict(key: TraceKey) -> dict[str, Any]:
    return {f: (getattr(key, f).value if f == "stage" else getattr(key, f)) for f in key.__dataclass_fields__}


def key_from_dict(d: dict[str, Any]) -> TraceKey:
    def typed(name: str, kind: type) -> Any:
        value = d[name]
        if type(value) is not kind:
            raise TypeError(f"key field {name} is {type(value).__name__}, not {kind.__name__}")
        return value
    return TraceKey(
        stage=StageKind(d["stage"]), structure=typed("structure", str), tp=typed("tp", int),
        sequence_parallel=typed("sequence_parallel", bool), micro_batch_size=typed("micro_batch_size", int),
        seq_length=typed("seq_length", int), dtype=typed("dtype", str), recompute=typed("recompute", str),
        code_version=typed("code_version", str), software=typed("software", str), variant=typed("variant", str),
    )


def _metas(items: list) -> tuple[TensorMeta, ...]:
    return tuple(TensorMeta(tuple(int(x) for x in shape), str(dtype)) for shape, dtype in items)


def _op_to_list(op: OpRecord) -> list:
    coll = None
    if op.collective is not None:
        g = op.collective.group
        coll = [op.collective.kind.value, op.collective.nbytes, g.kind.value, g.size, g.stride, g.start]
    return [
        op.index, op.name, op.kind.value, op.phase.value, op.stream.value,
        [[list(t.shape), t.dtype] for t in op.inputs], [[list(t.shape), t.dtype] for t in op.outputs],
        op.flops, op.bytes_read, op.bytes_written, list(op.deps), coll, op.module,
    ]


def _op_from_list(row: list, position: int) -> OpRecord:
    (index, name, kind, phase, stream, inputs, outputs, flops, read, written, deps, coll, module) = row
    if index != position:
        raise ValueError(f"op {position} has index {index}")
    dep_tuple = tuple(int(d) for d in deps)
    if any(d < 0 or d >= index for d in dep_tuple):
        raise ValueError(f"op {index} depends on an op that does not precede it")
    collective = None
    if coll is not None:
        ckind, nbytes, gkind, size, stride, start = coll
        collective = CollectiveInfo(CollectiveKind(ckind), int(nbytes),
                                    CommGroup(GroupKind(gkind), int(size), int(stride), int(start)))
    return OpRecord(
        index=int(index), name=str(name), kind=OpKind(kind), phase=Phase(phase), stream=Stream(stream),
        inputs=_metas(inputs), outputs=_metas(outputs), flops=float(flops), bytes_read=int(read),
        bytes_written=int(written), deps=dep_tuple, collective=collective, module=str(module),
    )


def trace_to_dict(trace: LayerTrace) -> dict[str, Any]:
    return {
        "key": key_to_dict(trace.key),
        "saved_bytes": trace.saved_bytes,
        "saved_bytes_by_mode": dict(trace.saved_bytes_by_mode),
        "param_count": trace.param_count,
        "ops": [_op_to_list(op) for op in trace.ops],
    }


def trace_from_dict(d: dict[str, Any], *, from_cache: bool = False) -> LayerTrace:
    by_mode = {str(k): int(v) for k, v in d["saved_bytes_by_mode"].items()}
    return LayerTrace(
        key=key_from_dict(d["key"]),
        ops=tuple(_op_from_list(row, i) for i, row in enumerate(d["ops"])),
        saved_bytes=int(d["saved_bytes"]), saved_bytes_by_mode=by_mode,
        param_count=int(d["param_count"]), from_cache=from_cache,
    )
