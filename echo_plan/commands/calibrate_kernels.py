"""``echo-plan calibrate kernels``: time the traced ops on this machine's GPU into a kernel database.

``echo_plan/commands/calibrate_cmd.py`` owns the ``calibrate`` sub-app and calls
``register_kernels(calibrate_app)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import typer

from echo_plan.commands.common import ModelOpt, StackOpt, write_atomic
from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.specs import Recompute
from echo_plan.cost.kernel_db import kernels_dir
from echo_plan.specs.moe import ExpertLayout
from echo_plan.trace.keys import check_layout
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.records import StageKind
from echo_plan.trace.tracer import trace_stage
from echo_plan.calibrate.kernels import NoCudaDevice, SdpaBackend, check_device, database_json, measure_ops
from echo_plan.specs import DType, load_model
from echo_plan.output_paths import check_output_file
from echo_plan.commands.common import resolve_stack


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise SpecError(what, text, "a comma-separated list of positive integers, e.g. 1,2,4,8") from None
    if not values or min(values) < 1:
        raise SpecError(what, text, "a comma-separated list of positive integers, e.g. 1,2,4,8")
    return sorted(set(values))


def parse_recompute(text: str) -> list:
    out = []
    for part in (p for p in text.replace(" ", "").split(",") if p):
        try:
            out.append(Recompute(part))
        except ValueError:
            valid = ", ".join(r.value for r in Recompute)
            raise SpecError("--recompute", part, f"one or more of {valid}, comma-separated") from None
    if not out:
        raise SpecError("--recompute", text, "at least one recompute mode")
    return out


def default_output(gpu_name: str) -> Path:
    stem = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") or "device"
    return (kernels_dir() or Path("kernels")) / f"{stem}.json"


def expert_layouts(model, tp: int, eps: list[int], etps: list[int] | None) -> list:
    """The expert layouts to trace an MoE layer with at ``tp``: every ep with every etp (default: etp =
    tp, as Megatron-Core); SpecError naming the flag for a dense model or a layout that cannot shard."""
    if model.moe is None:
        if eps != [1] or etps is not None:
            value = eps[0] if len(eps) == 1 else ",".join(map(str, eps))
            raise SpecError("--ep", value, f"expert layouts need a mixture-of-experts model; {model.name} is dense "
                            "(leave --ep and --etp out)")
        return []
    layouts = [ExpertLayout(ep=ep, etp=etp) for ep in eps for etp in (etps or [tp])]
    for layout in layouts:
        try:
            check_layout(model, layout)
        except SpecError as exc:
            flag = "--ep" if exc.field == "ep" else "--etp"
            raise SpecError(flag, exc.value, exc.valid) from None
    return layouts


def traced_ops(model, tps: list[int], mbs: list[int], sequence_parallel: bool, recompute: list, dtype,
               stack=None, eps: list[int] | None = None, etps: list[int] | None = None) -> list:
    """Every op of the embedding and output stages and of each kind of block the model has (dense or
    MoE, full or sliding-window attention; MoE blocks once per expert layout) for each (tp, mbs,
    recompute) asked for."""
    ops = []
    for tp in tps:  # trace_stage raises SpecError for a tp that cannot shard the model
        sp = sequence_parallel and tp > 1
        if sp and model.seq_length % tp:
            raise SpecError("--tp", tp, f"sequence parallelism needs seq_length {model.seq_length} divisible by tp")
        layouts = expert_layouts(model, tp, eps or [1], etps)
        for b in mbs:
            for stage in StageKind:
                modes = recompute if stage is StageKind.BLOCK else recompute[:1]
                variants = [{}]
                if stage is StageKind.BLOCK:
                    variants = [{"kind": kind, "layout": layout} for kind in model.distinct_kinds()
                                for layout in (layouts if kind.moe else [None])]
                for mode in modes:
                    for variant in variants:
                        trace = trace_stage(model, stage, tp=tp, sequence_parallel=sp, micro_batch_size=b,
                                            dtype=dtype, recompute=mode, cache=None, stack=stack, **variant)
                        ops.extend(trace.ops)
    return ops


def register_kernels(calibrate_app: typer.Typer) -> None:
    @calibrate_app.command("kernels")
    def kernels(
        model: str = ModelOpt,
        tp: str = typer.Option("1,2,4,8", "--tp", help="tensor-parallel degrees to trace, comma-separated"),
        mbs: str = typer.Option("1", "--mbs", help="micro-batch sizes to trace, comma-separated"),
        sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="trace with sequence parallelism"),
        recompute: str = typer.Option("none", "--recompute", help="recompute modes to trace: none, selective, full"),
        ep: str = typer.Option("1", "--ep", help="MoE models: expert-parallel degrees to trace, comma-separated"),
        etp: Optional[str] = typer.Option(None, "--etp", help="MoE models: expert tensor-parallel degrees, "
                                          "comma-separated (default: each --tp, as Megatron-Core)"),
        dtype: str = typer.Option("bf16", "--dtype", help="training dtype: bf16 or fp16"),
        stack: Optional[str] = StackOpt,
        device: str = typer.Option("cuda", "--device", help="cuda (a real measurement) or cpu (tests the harness)"),
        warmup: int = typer.Option(5, "--warmup", min=0, max=100_000, help="untimed runs per op"),
        iters: int = typer.Option(20, "--iters", min=1, max=100_000, help="timed runs per op (the median is kept)"),
        output: Optional[Path] = typer.Option(None, "--output", "-o", help="database file (default kernels/<GPU>.json)"),
        traces: Optional[Path] = typer.Option(None, "--traces", help="measure the ops of every trace in this trace-cache "
                                              "folder (one a search or validate filled, ECHO_PLAN_CACHE_DIR) instead "
                                              "of tracing --model"),
        sdpa_backend: str = typer.Option("auto", "--sdpa-backend", help="whose kernels time fused attention: "
                                         "auto (PyTorch's priority), flash (FlashAttention-2, as PyTorch-native "
                                         "stacks ran on Hopper), cudnn, efficient, math; kept in the database"),
        as_json: bool = typer.Option(False, "--json", help="print a JSON summary"),
    ) -> None:
        """Run the model's traced ops on this machine's GPU and write a kernel database."""
        if device not in ("cuda", "cpu"):
            raise SpecError("--device", device, "cuda or cpu")
        try:
            backend = SdpaBackend(sdpa_backend)
        except ValueError:
            raise SpecError("--sdpa-backend", sdpa_backend,
                            "one of " + ", ".join(b.value for b in SdpaBackend)) from None
        check_output_file(output, "--output", (".json",))
        try:
            check_device(device)
        except NoCudaDevice as exc:
            typer.echo(f"calibrate kernels: {exc}; nothing measured, no file written. "
                       "Run it on a machine with an NVIDIA GPU (or --device cpu to test the harness).")
            return
        try:
            dt = DType(dtype)
        except ValueError:
            raise SpecError("--dtype", dtype, "bf16 or fp16") from None

        if traces is not None:
            ops, settings = _stored_ops(traces)
            _measure_and_write(ops, device, warmup, iters, {**settings, "warmup": warmup, "iters": iters}, output, as_json,
                               backend)
            return
        spec = load_model(model)
        stack_spec = resolve_stack(stack)
        tps, sizes, modes = parse_int_list(tp, "--tp"), parse_int_list(mbs, "--mbs"), parse_recompute(recompute)
        eps = parse_int_list(ep, "--ep")
        etps = parse_int_list(etp, "--etp") if etp is not None else None
        for t in tps:  # before tracing anything: a bad expert layout is one line, not minutes in
            expert_layouts(spec, t, eps, etps)
        experts = f" ep={eps} etp={etps or 'tp'}" if spec.is_moe else ""
        typer.echo(f"tracing {spec.name} at tp={tps} mbs={sizes} recompute={[m.value for m in modes]}{experts} "
                   f"(stack {stack_spec.name}) ...", err=True)
        ops = traced_ops(spec, tps, sizes, sequence_parallel, modes, dt, stack_spec, eps, etps)
        settings = {"model": spec.name, "stack": stack_spec.name, "tp": tps, "mbs": sizes,
                    "sequence_parallel": sequence_parallel,
                    "recompute": [m.value for m in modes], "dtype": dt.value, "warmup": warmup, "iters": iters}
        if spec.is_moe:
            settings.update(ep=eps, etp=etps if etps is not None else "tp")
        _measure_and_write(ops, device, warmup, iters, settings, output, as_json, backend)


def _stored_ops(folder: Path) -> tuple[list, dict]:
    """The ops of every sound trace in a trace-cache folder, and the provenance settings that say so;
    SpecError for a folder that is missing or holds no trace."""
    if not folder.is_dir():
        raise SpecError("--traces", str(folder), "a trace-cache folder (a search's or validate's ECHO_PLAN_CACHE_DIR)")
    found, refused = TraceCache(folder).stored()
    for path, why in refused:
        typer.echo(f"  not read: {path.name}: {why}", err=True)
    if not found:
        raise SpecError("--traces", str(folder), "a folder holding echo-plan trace files (none were found in it)")
    typer.echo(f"read {len(found)} traces from {folder} ({len(refused)} files not read) ...", err=True)
    ops = [op for trace in found for op in trace.ops]
    settings = {"traces": str(folder), "trace_files": len(found),
                "dtype": sorted({t.key.dtype for t in found}), "tp": sorted({t.key.tp for t in found}),
                "mbs": sorted({t.key.micro_batch_size for t in found}),
                "seq_length": sorted({t.key.seq_length for t in found})}
    return ops, settings


def _measure_and_write(ops: list, device: str, warmup: int, iters: int, settings: dict, output: Optional[Path],
                       as_json: bool, backend: SdpaBackend = SdpaBackend.AUTO) -> None:
    def progress(i: int, n: int, name: str) -> None:
        if i % 25 == 0:
            typer.echo(f"  [{i}/{n}] {name}", err=True)

    run = measure_ops(ops, device, warmup=warmup, iters=iters, progress=progress, sdpa_backend=backend)
    data = database_json(run, device, {**settings, "sdpa_backend": backend.value})
    target = output if output is not None else default_output(data["gpu"]["name"])
    if not run.measured:
        raise EchoPlanError(f"no op could be measured on {device}; nothing written")
    write_atomic(target, json.dumps(data, indent=1) + "\n")
    summary = {"path": str(target), "gpu": data["gpu"]["name"], "ops_total": run.ops_total,
               "measured": len(run.measured), "skipped": [{"op": s.key[0], "reason": s.reason} for s in run.skipped]}
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    typer.echo(f"measured {len(run.measured)} of {run.ops_total} distinct ops on {data['gpu']['name']}; "
               f"wrote {target}")
    for s in run.skipped:
        typer.echo(f"  skipped {s.key[0]}: {s.reason}")
