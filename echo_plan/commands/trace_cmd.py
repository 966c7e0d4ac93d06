"""``echo-plan trace``: trace the model's stages and print what each one runs and communicates."""

from __future__ import annotations

import warnings
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from echo_plan.commands.common import CacheDirOpt, EpOpt, EtpOpt, ImbalanceOpt, JsonOpt, ModelOpt, StackOpt, print_json
from echo_plan.trace.records import OpKind, Phase
from echo_plan.commands.common import resolve_stack
from echo_plan.specs import DType, Recompute, load_model
from echo_plan.trace.cache import TraceCache, TraceCacheWarning
from echo_plan.trace.tracer import trace_stage
from echo_plan.trace.records import StageKind
from echo_plan.commands.common import check_cache_dir
from echo_plan.specs.moe import ExpertLayout
from echo_plan.trace.keys import check_layout
from echo_plan.errors import SpecError


class StageChoice(str, Enum):
    BLOCK = "block"
    EMBEDDING = "embedding"
    OUTPUT = "output"
    ALL = "all"


class RecomputeChoice(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class SourceChoice(str, Enum):
    ECHO_PLAN = "echo-plan"  # the built-in tracer (what simulate and search use)
    MEGATRON_CORE = "megatron-core"  # Megatron-Core's own layer, beside the built-in one (docs/conformance.md)


class DTypeChoice(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"  # bf16 with the linears' GEMMs in FP8 (the stack's fp8_recipe)


def _si(n: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def stage_summary(trace, with_ops: bool) -> dict:
    """A JSON-ready summary of one LayerTrace (phases, FLOPs, bytes, memory, collectives)."""
    phases = {}
    for phase in Phase:
        ops = trace.by_phase(phase)
        if ops:
            phases[phase.value] = {
                "ops": len(ops), "kernels": sum(op.kind is not OpKind.VIEW for op in ops),
                "flops": sum(op.flops for op in ops),
                "bytes_read": sum(op.bytes_read for op in ops), "bytes_written": sum(op.bytes_written for op in ops),
            }
    out = {
        "stage": trace.key.stage.value, "layer_kind": trace.key.variant or None, "from_cache": trace.from_cache,
        "key": trace.key.digest(),
        "ops": len(trace.ops), "flops": trace.total_flops,
        "bytes_read": sum(op.bytes_read for op in trace.ops),
        "bytes_written": sum(op.bytes_written for op in trace.ops),
        "saved_bytes": trace.saved_bytes, "saved_bytes_by_mode": dict(trace.saved_bytes_by_mode),
        "param_count": trace.param_count, "phases": phases,
        "collectives": [
            {"index": op.index, "phase": op.phase.value, "kind": op.collective.kind.value,
             "nbytes": op.collective.nbytes, "group": op.collective.group.kind.value,
             "group_size": op.collective.group.size, "module": op.module}
            for op in trace.collectives
        ],
    }
    if with_ops:
        out["op_list"] = [
            {"index": op.index, "phase": op.phase.value, "name": op.name, "kind": op.kind.value,
             "stream": op.stream.value, "inputs": [list(t.shape) for t in op.inputs],
             "outputs": [list(t.shape) for t in op.outputs], "dtype": op.outputs[0].dtype if op.outputs else "",
             "flops": op.flops, "bytes_read": op.bytes_read, "bytes_written": op.bytes_written,
             "deps": list(op.deps), "module": op.module}
            for op in trace.ops
        ]
    return out


def _print_stage(s: dict, with_ops: bool) -> None:
    src = "cache" if s["from_cache"] else "traced"
    label = s["stage"] + (f" {s['layer_kind']}" if s.get("layer_kind") else "")
    typer.echo(f"[{label}] {s['ops']} ops ({src}, key {s['key'][:12]}), params on this rank "
               f"{s['param_count'] / 1e6:.2f} M")
    for phase, p in s["phases"].items():
        typer.echo(f"  {phase:<10} {p['ops']:4d} ops {p['kernels']:4d} kernels  {_si(p['flops'], 'FLOP'):>12}  "
                   f"read {_mib(p['bytes_read']):>14}  written {_mib(p['bytes_written']):>14}")
    modes = ", ".join(f"{k} {_mib(v)}" for k, v in s["saved_bytes_by_mode"].items())
    typer.echo(f"  saved for backward: {_mib(s['saved_bytes'])}  (by recompute mode: {modes})")
    if s["collectives"]:
        typer.echo(f"  collectives ({len(s['collectives'])}):")
        for c in s["collectives"]:
            typer.echo(f"    #{c['index']:<4} {c['phase']:<10} {c['kind']:<15} {_mib(c['nbytes']):>12}  "
                       f"{c['group']}{c['group_size']}  {c['module']}")
    else:
        typer.echo("  collectives: none")
    if with_ops:
        typer.echo(f"  {'idx':>4} {'phase':<9} {'name':<58} {'kind':<11} {'flops':>11} {'read':>11} "
                   f"{'written':>11}  shapes -> deps")
        for op in s["op_list"]:
            shapes = " ".join("x".join(map(str, sh)) or "()" for sh in op["inputs"])
            typer.echo(f"  {op['index']:>4} {op['phase']:<9} {op['name']:<58} {op['kind']:<11} "
                       f"{op['flops']:>11.3g} {op['bytes_read']:>11} {op['bytes_written']:>11}  "
                       f"{shapes} -> {op['deps']} {op['module']}")


def conformance(spec, tp: int, mbs: int, sequence_parallel: bool, recompute: Recompute, dtype: DType, stack, ep: int,
                cache: TraceCache, with_ops: bool, as_json: bool) -> None:
    """``trace --source megatron-core``: each kind of layer through Megatron-Core, beside the built-in trace
    of the same shape run with the kernels Megatron-Core's local spec runs."""
    from echo_plan.interop.megatron_core_layer import (  # noqa: I001 - heavy only when asked for
        STAND_INS, compare_traces, conformance_stack, megatron_core_version, trace_with_megatron_core)

    ours_stack = conformance_stack(stack)
    layers = []
    for kind in spec.distinct_kinds():
        theirs = trace_with_megatron_core(spec, tp=tp, micro_batch_size=mbs, recompute=recompute, stack=stack,
                                          kind=kind, cache=cache, sequence_parallel=sequence_parallel, dtype=dtype,
                                          ep=ep)
        ours = trace_stage(spec, StageKind.BLOCK, tp=tp, sequence_parallel=False, micro_batch_size=mbs,
                           dtype=DType.BF16, recompute=recompute, cache=cache, stack=ours_stack, kind=kind,
                           layout=ExpertLayout(1, tp, 1.0) if kind.moe else None)
        layers.append((kind, stage_summary(theirs, with_ops), stage_summary(ours, False), compare_traces(theirs, ours)))
    version = megatron_core_version()
    if as_json:
        print_json({"model": spec.name, "tp": tp, "micro_batch_size": mbs, "recompute": recompute.value,
                    "megatron_core": version, "stand_ins": list(STAND_INS),
                    "layers": [{"layer_kind": k.label(), "megatron_core": t, "echo_plan": o, "comparison": c}
                               for k, t, o, c in layers]})
        return
    typer.echo(f"{spec.name}: tp {tp}, micro-batch {mbs}, seq {spec.seq_length}, bf16, recompute {recompute.value}; "
               f"Megatron-Core {version}'s own layer (local spec, CPU, fake tensors and process group) beside "
               "echo-plan's (unfused attention, as the local spec runs)")
    for kind, theirs_s, _, rows in layers:
        typer.echo(f"\n{kind.label()} layer through Megatron-Core:")
        _print_stage(theirs_s, with_ops)
        typer.echo(f"  {'compared':<38} {'Megatron-Core':>16} {'echo-plan':>16}  agreement")
        for r in rows:
            a, b = r["megatron_core"], r["echo_plan"]
            if isinstance(a, list):
                a, b = f"{len(a)} ops", f"{len(b)} ops"
            elif isinstance(a, float) or isinstance(b, float) or a > 10**6:
                a, b = _si(a, ""), _si(b, "")
            verdict = ("equal" if r["equal"] else "differs" if r["relative_difference"] is None
                       else f"{r['relative_difference']:+.1%}")
            typer.echo(f"  {r['figure']:<38} {a!s:>16} {b!s:>16}  {verdict}")
    typer.echo("stand-ins for Megatron-Core's CUDA-only calls: " + "; ".join(STAND_INS))
    typer.echo("what differs and why: docs/conformance.md")


def register(app: typer.Typer) -> None:
    @app.command("trace")
    def trace(
        model: str = ModelOpt,
        tp: int = typer.Option(1, "--tp", help="tensor-parallel degree (must divide heads, kv heads and FFN)"),
        mbs: int = typer.Option(1, "--mbs", help="micro-batch size"),
        sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Megatron-LM sequence parallelism"),
        recompute: RecomputeChoice = typer.Option(RecomputeChoice.NONE, "--recompute", help="activation recomputation"),
        dtype: DTypeChoice = typer.Option(DTypeChoice.BF16, "--dtype", help="activation and weight dtype; fp8: bf16 with FP8 GEMMs"),
        stage: StageChoice = typer.Option(StageChoice.ALL, "--stage", help="which stage to trace"),
        stack: Optional[str] = StackOpt,
        ep: int = EpOpt,
        etp: Optional[int] = EtpOpt,
        expert_imbalance: float = ImbalanceOpt,
        source: SourceChoice = typer.Option(SourceChoice.ECHO_PLAN, "--source", help="echo-plan: the built-in "
                                            "tracer; megatron-core: trace the transformer layer through Megatron-Core's "
                                            "own code (the frameworks extra) and compare it with the built-in one"),
        ops: bool = typer.Option(False, "--ops", help="list every op (index, phase, name, kind, shapes, flops, bytes, deps)"),
        as_json: bool = JsonOpt,
        cache_dir: Optional[Path] = CacheDirOpt,
    ) -> None:
        """Trace the model's transformer layer, embedding and output stage (or one of them) for one micro-batch."""
        check_cache_dir(cache_dir)
        spec = load_model(model)
        layout = ExpertLayout(ep, etp if etp is not None else tp, expert_imbalance)
        if spec.is_moe:
            check_layout(spec, layout)
        elif (ep, etp, expert_imbalance) != (1, None, 1.0):
            check_layout(spec, layout)  # names the rule: expert options need an MoE model
        stack_spec = resolve_stack(stack)
        cache = TraceCache(cache_dir)
        if source is SourceChoice.MEGATRON_CORE:
            if stage not in (StageChoice.BLOCK, StageChoice.ALL):
                raise SpecError("--stage", stage.value, "with --source megatron-core: block (the transformer layer)")
            conformance(spec, tp, mbs, sequence_parallel, Recompute(recompute.value), DType(dtype.value), stack_spec,
                        ep, cache, ops, as_json)
            return
        stages = list(StageKind) if stage is StageChoice.ALL else [StageKind(stage.value)]
        summaries = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TraceCacheWarning)
            for kind in stages:
                layer_kinds = spec.distinct_kinds() if kind is StageKind.BLOCK else (None,)
                for layer in layer_kinds:  # one trace per kind of layer (dense/MoE, full/windowed attention)
                    extra = {} if layer is None else {"kind": layer, "layout": layout if layer.moe else None}
                    result = trace_stage(spec, kind, tp=tp, sequence_parallel=sequence_parallel, micro_batch_size=mbs,
                                         dtype=DType(dtype.value), recompute=Recompute(recompute.value), cache=cache,
                                         stack=stack_spec, **extra)
                    summaries.append(stage_summary(result, ops))
        for w in caught:  # a discarded cache file: one line each on stderr
            typer.echo(f"warning: {w.message}", err=True)
        if as_json:
            print_json({
                "model": spec.name, "tp": tp, "micro_batch_size": mbs,
                "sequence_parallel": bool(sequence_parallel and tp > 1), "recompute": recompute.value,
                "dtype": dtype.value, "stack": stack_spec.name, "cache_dir": str(cache.root),
                "cache": {"hits": cache.hits, "misses": cache.misses, "corrupt": cache.corrupt},
                "stages": summaries,
            })
            return
        sp = " sequence-parallel" if sequence_parallel and tp > 1 else ""
        typer.echo(f"{spec.name}: tp {tp}, micro-batch {mbs}, seq {spec.seq_length}, {dtype.value}, "
                   f"recompute {recompute.value}{sp}, stack {stack_spec.name}  "
                   f"(cache {cache.root}: {cache.hits} hit, {cache.misses} miss)")
        for s in summaries:
            _print_stage(s, ops)
