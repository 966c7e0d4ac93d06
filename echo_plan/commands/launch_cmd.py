"""``echo-plan export launch`` and ``echo-plan import launch``, and the ``--from-launch`` of simulate
and search: a plan as a framework's launch config, and a running job's config as a plan."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import CacheDirOpt, ClusterOpt, GpusOpt, JsonOpt, StackOpt, print_json, write_atomic
from echo_plan.commands.plan_flags import DEFAULTS, FLAG_NAMES, PlanFlags, PlanInputs, build_plan, plan_options
from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.interop.launch import (
    LaunchExport, LaunchFormat, LaunchJob, export_launch, first_exportable, launch_format, read_launch,
)
from echo_plan.interop.launch.job import FORMAT_NAMES
from echo_plan.output_paths import check_output_file
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec, load_cluster, load_stack
from echo_plan.specs.plan_checks import validate_plan

FormatOpt = typer.Option(..., "--format", "-f", help=f"launch format: {FORMAT_NAMES}")
LaunchFormatOpt = typer.Option(None, "--launch-format", help=f"the file's format ({FORMAT_NAMES}; default: from its "
                                                             ".sh/.yaml/.toml suffix, Megatron-LM otherwise)")
FromLaunchOpt = typer.Option(None, "--from-launch", help="a job's launch config: a Megatron-LM command line or script, "
                                                         "a Megatron-Bridge YAML, a torchtitan TOML, or a Megatron-LM "
                                                         "log with its argument dump")
KEEP_WITH_LAUNCH = ("cluster", "nodes", "gpus", "stack")  # plan flags that still apply with --from-launch


def job_inputs(path: str, flags: PlanFlags, fmt: Optional[str] = None) -> tuple[PlanInputs, LaunchJob]:
    """The model, cluster, stack and plan of a launch config, on the --cluster given (resized to the job)."""
    for name in DEFAULTS:
        if name not in KEEP_WITH_LAUNCH and getattr(flags, name) != DEFAULTS[name]:
            raise SpecError(FLAG_NAMES[name], getattr(flags, name), "not with --from-launch (the job's own plan is "
                                                                    "read from its launch config)")
    job = read_launch(path, load_stack(flags.stack), fmt=launch_format(fmt, "--launch-format") if fmt else None,
                      gpus=flags.gpus)
    cluster = job_cluster(flags.cluster, flags.nodes, job)
    return PlanInputs(job.model, cluster, job.stack, job.plan), job


def job_cluster(name: str, nodes: Optional[int], job: LaunchJob) -> ClusterSpec:
    if nodes is not None:
        raise SpecError("--nodes", nodes, "not with --from-launch: the job's GPU count sizes the cluster")
    cluster = load_cluster(name, gpus=job.gpus)
    if job.gpus_per_node is not None and job.gpus_per_node != cluster.gpus_per_node:
        raise SpecError("--cluster", name, f"its servers hold {cluster.gpus_per_node} GPUs; the job runs "
                                           f"{job.gpus_per_node} per node")
    return cluster


def saved_candidates(source: str, storage: Optional[str], study_name: Optional[str]):
    """(model, cluster, stack, ranked plans) of a saved search result or a stored study."""
    from echo_plan.report.load import load_source  # deferred: Optuna, only for a saved search

    outcome = load_source(source, storage, study_name)
    ranked = getattr(outcome, "ranked", None)
    if ranked is None:
        raise EchoPlanError(f"{source}: a compare result; export from one search (its --json, or its study)")
    if not ranked:
        raise EchoPlanError(f"{source}: no plan of this search fits; nothing to export")
    model = ModelSpec.build(outcome.model, context=source)
    cluster = ClusterSpec.build(outcome.cluster, context=source).resized(gpus=ranked[0].num_gpus)
    stack = SoftwareSpec.build(outcome.stack, context=source) if outcome.stack else load_stack(None)
    return model, cluster, stack, [PlanSpec.build(r.plan, context=source) for r in ranked]


def export_saved(target: LaunchFormat, source: str, rank: Optional[int], storage: Optional[str],
                 study_name: Optional[str]) -> tuple[PlanInputs, LaunchExport, int, list[str]]:
    """Rank ``rank`` of a saved search in ``target`` (it, or the one line why not); without a rank, the
    fastest plan the framework can run, and why the faster ones were passed over."""
    model, cluster, stack, plans = saved_candidates(source, storage, study_name)
    if rank is not None:
        if not 1 <= rank <= len(plans):
            raise SpecError("--rank", rank, f"1 to {len(plans)} (the fitting plans of {source})")
        plan = plans[rank - 1]
        return PlanInputs(model, cluster, stack, plan), export_launch(target, model, plan, stack, cluster), rank, []
    k, plan, out, skipped = first_exportable(target, model, plans, stack, cluster)
    return PlanInputs(model, cluster, stack, plan), out, k, skipped


def fit_note(inputs: PlanInputs, cache_dir: Optional[str]) -> None:
    """A plan given by flags is simulated once: a plan predicted not to fit is said before it is written."""
    from echo_plan.simulate import simulate  # deferred: the simulator
    from echo_plan.trace.cache import TraceCache  # deferred: with the simulator

    result = simulate(inputs.model, inputs.cluster, inputs.plan, stack=inputs.stack, cache=TraceCache(cache_dir))
    if not result.fits:
        usable = min(m.usable_bytes for m in result.memory) / 2**30
        typer.echo(f"note: this plan is predicted NOT to fit: {result.memory_peak_gib:.1f} GiB at its peak, "
                   f"{usable:.1f} GiB usable per GPU", err=True)


def register_launch(export_app: typer.Typer, import_app: typer.Typer) -> None:
    @export_app.command("launch")
    @plan_options
    def export_launch_cmd(
        flags: PlanFlags,
        fmt: str = FormatOpt,
        source: Optional[str] = typer.Option(None, "--from", help="a saved search (`search --json` output, .json) or "
                                                                  "a study database (.db): export its plan --rank K"),
        rank: Optional[int] = typer.Option(None, "--rank", help="with --from: the K-th fastest fitting plan (default: "
                                                                "the fastest the framework can run)"),
        storage: Optional[str] = typer.Option(None, "--storage", help="with --from: the study's Optuna storage URL"),
        study_name: Optional[str] = typer.Option(None, "--study-name", help="with --from: the study in that storage"),
        output: Optional[str] = typer.Option(None, "-o", "--output", help="write the config to this file (default: "
                                                                          "print it)"),
        cache_dir: Optional[str] = CacheDirOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Write a plan as a launch config: Megatron-LM arguments, a Megatron-Bridge YAML or a torchtitan TOML."""
        target = launch_format(fmt)
        check_output_file(output, "--output", (target.suffix, ".txt") if target is LaunchFormat.MEGATRON_LM
                          else (target.suffix, ".yml") if target is LaunchFormat.MEGATRON_BRIDGE else (target.suffix,))
        if source is not None:
            for name in DEFAULTS:
                if getattr(flags, name) != DEFAULTS[name]:
                    raise SpecError(FLAG_NAMES[name], getattr(flags, name), "not with --from (the saved plan is "
                                                                            "exported as it was searched)")
            inputs, out, chosen, skipped = export_saved(target, source, rank, storage, study_name)
            if skipped:
                typer.echo(f"note: exported rank {chosen}, the fastest plan {target.value} runs as simulated; "
                           f"faster: " + "; ".join(skipped[:3]) + (" ..." if len(skipped) > 3 else ""), err=True)
        else:
            if rank is not None:
                raise SpecError("--rank", rank, "needs --from (a saved search)")
            inputs = build_plan(flags)
            validate_plan(inputs.plan, inputs.model, inputs.cluster)
            out = export_launch(target, inputs.model, inputs.plan, inputs.stack, inputs.cluster)
            fit_note(inputs, cache_dir)
        if output is not None:
            write_atomic(output, out.text)
        if as_json:
            print_json({"format": target.value, "text": out.text, "env": dict(out.env), "notes": list(out.notes),
                        "plan": inputs.plan.short(), "output": output})
            return
        for note in out.notes:
            typer.echo(f"note: {note}", err=True)
        if output is None:
            typer.echo(out.text, nl=False)
        else:
            typer.echo(f"wrote {output} ({target.value}: {inputs.model.name}, {inputs.plan.short()})")

    @import_app.command("launch")
    def import_launch_cmd(
        launch: str = typer.Argument(..., help="a launch file (.sh/.txt Megatron-LM command, .yaml Megatron-Bridge, "
                                               ".toml torchtitan, a Megatron-LM log) or a quoted command line"),
        fmt: Optional[str] = LaunchFormatOpt,
        cluster: str = ClusterOpt, gpus: Optional[int] = GpusOpt, stack: Optional[str] = StackOpt,
        cache_dir: Optional[str] = CacheDirOpt,
        as_json: bool = JsonOpt,
    ) -> None:
        """Read a running job's launch config into model, plan and stack, and simulate it on --cluster."""
        from echo_plan.simulate import simulate  # deferred: the simulator
        from echo_plan.trace.cache import TraceCache  # deferred: with the simulator

        job = read_launch(launch, load_stack(stack), fmt=launch_format(fmt, "--launch-format") if fmt else None,
                          gpus=gpus)
        spec = job_cluster(cluster, None, job)
        result = simulate(job.model, spec, job.plan, stack=job.stack, cache=TraceCache(cache_dir))
        summary = {"source": job.source, "model": job.model.name, "gpus": job.gpus, "plan": job.plan.model_dump(mode="json"),
                   "plan_short": job.plan.short(), "stack": job.stack.name, "notes": list(job.notes),
                   "step_time_s": result.step_time_s, "fits": result.fits, "cluster": spec.name}
        if as_json:
            print_json(summary)
            return
        typer.echo(f"{job.source}: {job.model.name} on {job.gpus} GPUs, plan {job.plan.short()}, stack {job.stack.name}")
        for note in job.notes:
            typer.echo(f"  note: {note}")
        fits = "fits" if result.fits else "does NOT fit"
        typer.echo(f"simulated on {spec.name}: {result.step_time_s:.3f} s per step, {result.mfu * 100:.1f}% MFU, {fits}")


def print_job_comparison(job: LaunchJob, config, outcome, cache_dir: Optional[str]) -> None:  # noqa: ANN001
    """After ``search --from-launch``: the job's own plan simulated as the search simulates, beside the best."""
    from echo_plan.simulate import simulate  # deferred: the simulator
    from echo_plan.trace.cache import TraceCache  # deferred: with the simulator

    own = simulate(job.model, config.cluster, job.plan, stack=config.stack, cache=TraceCache(cache_dir),
                   memory_headroom_bytes=config.memory_headroom_bytes)
    fits = "fits" if own.fits else "does NOT fit (predicted)"
    typer.echo(f"your job ({job.source}): {job.plan.short()}: {own.step_time_s:.3f} s per step, {fits}")
    best = outcome.best
    if best is None:
        return
    gain = own.step_time_s / best.step_time_s - 1.0
    if gain > 0:
        typer.echo(f"best plan found: {best.step_time_s:.3f} s per step, {gain * 100:.1f}% more steps per hour than "
                   f"your job's plan (export it: echo-plan export launch --from RESULT.json --format ...)")
    else:
        typer.echo(f"no plan found is faster than your job's ({best.step_time_s:.3f} s for the best)")
