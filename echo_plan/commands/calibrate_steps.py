"""``echo-plan calibrate steps MEASURED.csv --cluster C [--stack S] -o calibrated.yaml``: fit a
cluster's compute figures to measured step times, report the held-out rows, and write a cluster
file whose predictions (and ranges) come from those runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from echo_plan.commands.common import CacheDirOpt, ClusterOpt, JsonOpt, print_json, stderr_is_tty, write_atomic
from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.files import read_text
from echo_plan.interop.launch import read_launch
from echo_plan.interop.launch.logs import read_log_steps
from echo_plan.interop.launch.megatron_lm import parse_argument_dump
from echo_plan.specs import load_stack
from echo_plan.validation.rows import STEP_UNIT, TrainingRow
from echo_plan.specs import ClusterSpec, load_cluster
from echo_plan.trace.cache import TraceCache
from echo_plan.validation.registry import training_rows, training_suite
from echo_plan.commands.common import check_cache_dir
from echo_plan.output_paths import check_output_file


def register_steps(calibrate_app: typer.Typer) -> None:
    @calibrate_app.command("steps")
    def steps_cmd(
        measured: Optional[Path] = typer.Argument(
            None, help="measured runs: a CSV in a validation-suite format (docs/validation.md); or use --from-log"),
        from_log: Optional[list[str]] = typer.Option(
            None, "--from-log", help="a training log (Megatron-LM, Megatron-Bridge, NeMo, torchtitan), repeatable: "
                                     "its step times after warm-up, one run each"),
        launch: Optional[list[str]] = typer.Option(
            None, "--launch", help="the launch config of each --from-log run, in the same order (not needed for a "
                                   "Megatron-LM log that prints its arguments)"),
        skip_steps: int = typer.Option(10, "--skip-steps", help="warm-up iterations of each log left out"),
        cluster: str = ClusterOpt,
        output: str = typer.Option(..., "--output", "-o", help="cluster YAML to write (the cluster plus calibration:)"),
        stack: Optional[str] = typer.Option(
            None, "--stack", help="the software stack the runs used (default: the file's '# echo-plan:' line, else "
                                  "megatron-core)"),
        hold_out_every: int = typer.Option(3, "--hold-out-every",
                                           help="hold every N-th row out of the fit and report its error (0: fit all)"),
        fit: str = typer.Option(",".join(("gemm_efficiency_scale", "attention_efficiency_scale",
                                          "memory_bandwidth_scale", "kernel_overhead_us")),
                                "--fit", help="figures to fit, comma-separated"),
        cache_dir: Optional[Path] = CacheDirOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Fit the cluster's compute calibration to measured step times; write a calibrated cluster file.

        Each row is simulated as `simulate` would with the cluster (its NCCL calibration included)
        and the stack; the figures (sustained GEMM and attention efficiency, achieved memory
        bandwidth, per-kernel overhead) move from stated priors only as far as the rows ask. The
        held-out rows' errors become the prediction range of that stack on the written cluster.
        """
        import yaml

        from echo_plan.calibrate.steps import calibrate_rows, calibration_block, every_nth  # deferred: loads numpy

        check_output_file(output, "--output", (".yaml", ".yml"))
        check_cache_dir(cache_dir)

        if (measured is None) == (not from_log):
            raise EchoPlanError("give the measured runs as a CSV file or with --from-log LOG (one of the two)")
        if measured is not None:
            if launch:
                raise SpecError("--launch", launch[0], "goes with --from-log")
            suite = training_suite(measured)
            stack_name, rows, settings, suite_name = stack or suite.stack, training_rows(suite), suite.model_settings, suite.name
            source_name = measured.name
        else:
            stack_name = stack or "megatron-core"
            rows = rows_from_logs(from_log, launch or [], stack_name, skip_steps)
            settings, suite_name, source_name = None, "logs", f"{len(rows)} training logs"
        base = load_cluster(cluster)
        held = every_nth(rows, hold_out_every)
        names = tuple(n.strip() for n in fit.split(",") if n.strip())
        show = stderr_is_tty() and not as_json

        def progress(i: int, msg: str) -> None:
            if show:
                typer.echo(f"\rfitting: {msg}", err=True, nl=False)

        result = calibrate_rows(rows, base, stack_name, held, names, model_settings=settings,
                                cache=TraceCache(cache_dir), progress=progress)
        if show:
            typer.echo("", err=True)
        data = base.model_dump(mode="json")
        data["calibration"] = calibration_block(result, suite_name, f"{source_name} ({len(result.rows)} runs)",
                                                data.get("calibration"))
        data["sources"] = list(data.get("sources", [])) + [
            f"calibration.compute and ranges: fitted by echo-plan calibrate steps to {source_name}"]
        ClusterSpec.build(data, context=output)  # never write a file that would not load
        write_atomic(output, f"# {base.name} calibrated to {source_name} by `echo-plan calibrate steps`.\n"
                     + yaml.safe_dump(data, sort_keys=False))
        held_rows = result.held_out
        errs = [abs(r.error) for r in held_rows]
        summary = {
            "output": output, "stack": stack_name, "figures": result.fit.calibration.values(),
            "fitted": list(result.fit.fitted),
            "weakly_constrained": [n for n in result.fit.fitted if not result.fit.determined(n)],
            "rows": [{"label": r.row.label, "measured_step_s": r.row.measured_step_s,
                      "predicted_step_s": r.predicted_step_s, "error": r.error, "held_out": r.held_out}
                     for r in result.rows],
            "held_out_mean_abs_error": sum(errs) / len(errs) if errs else None,
            "held_out_max_abs_error": max(errs) if errs else None,
            "not_modelled": [r.label for r in rows if r.not_modelled],
        }
        if as_json:
            print_json(summary)
            return
        typer.echo(f"{len(result.rows)} runs simulated with stack {stack_name} on {base.name}; "
                   f"{len(result.rows) - len(held_rows)} fitted, {len(held_rows)} held out")
        for name, value in result.fit.calibration.values().items():
            note = "  (weakly constrained by these runs: close to its prior)" if name in summary["weakly_constrained"] else ""
            typer.echo(f"  {name:<28} {value:.4g}{note}")
        typer.echo(f"  {'run':<44} {'measured s':>10} {'predicted s':>11} {'error':>7}")
        for r in result.rows:
            typer.echo(f"  {r.row.label:<44} {r.row.measured_step_s:>10.4g} {r.predicted_step_s:>11.4g} "
                       f"{r.error * 100:>+6.1f}%{'  held out' if r.held_out else ''}")
        if errs:
            typer.echo(f"held-out mean |error| {summary['held_out_mean_abs_error'] * 100:.1f}%, "
                       f"max {summary['held_out_max_abs_error'] * 100:.1f}%")
        if summary["not_modelled"]:
            typer.echo(f"not simulated ({len(summary['not_modelled'])}): " + ", ".join(summary["not_modelled"][:5])
                       + (" ..." if len(summary["not_modelled"]) > 5 else ""))
        typer.echo(f"wrote {output}")


def rows_from_logs(logs: list[str], launches: list[str], stack_name: str, skip: int) -> list[TrainingRow]:
    """One measured row per log: its median step time after warm-up, and the job its launch config
    (or, for a Megatron-LM log, its own argument dump) describes."""
    if launches and len(launches) != len(logs):
        raise SpecError("--launch", len(launches), f"one per --from-log ({len(logs)}), in the same order")
    base = load_stack(stack_name)
    rows = []
    for i, log in enumerate(logs):
        text = read_text(log)
        if not launches and parse_argument_dump(text) is None:
            raise EchoPlanError(f"{log}: no Megatron-LM argument dump in it to read the job from; give each run's "
                                "launch config with --launch, in the order of the logs")
        job = read_launch(launches[i] if launches else log, base)
        tokens = job.plan.global_batch_size * job.model.seq_length
        steps = read_log_steps(text, log, skip=skip, tokens_per_step=tokens, gpus=job.gpus)
        own = job.stack.model_dump(mode="json")
        overrides = {k: v for k, v in own.items() if v != base.model_dump(mode="json")[k] and k not in ("name", "base")}
        rows.append(TrainingRow(label=f"{Path(log).name} ({job.plan.short()})", measured=steps.step_s, unit=STEP_UNIT,
                                model=job.model, gpus=job.gpus, plan=job.plan.model_dump(mode="json"),
                                stack_overrides=overrides,
                                detail=f"{steps.framework} log, median of {len(steps.kept)} steps after {skip}"))
    return rows
