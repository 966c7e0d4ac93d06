"""``echo-plan search`` (the best plans for one cluster) and ``echo-plan compare`` (across sizes).

The report engineer's hook: ``search`` ends with ``after_search(outcome)`` and ``compare`` with
``after_compare(outcome)``; a ``--report FILE`` option adds its call there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import typer

from echo_plan.commands.common import (
    CacheDirOpt, SeqOpt, CkptBwOpt, DensityOpt, DetectOpt, FlowsOpt, RoutingOpt, FailRateOpt, Fp8ParamGatherOpt, Fp8RecipeOpt, RestartOpt, failure_model, ClusterOpt, HeadroomOpt, JsonOpt, ModelOpt, NodesOpt, StackOpt, print_json, stderr_is_tty,
    write_atomic,
)
from echo_plan.commands.common import resolve_stack
from echo_plan.commands.search_config import (
    DEFAULT_GBS, DEFAULT_TOP, GbsOpt, OffloadOpt, ProcessesOpt, ProgressOpt, RayOpt, ReportOpt, SamplerOpt, SeedOpt,
    SearchDpCommOpt, SpaceOpt, StorageOpt, StudyOpt, TrialsOpt, WorkersOpt, build_config,
)
from echo_plan.commands.launch_cmd import FromLaunchOpt, LaunchFormatOpt, print_job_comparison
from echo_plan.interop.launch import launch_format as parse_launch_format, read_launch
from echo_plan.errors import SpecError
from echo_plan.specs.calibration import kernels_status
from echo_plan.report.inputs import calibration_summary
from echo_plan.search.space import Knob
from echo_plan.commands.common import check_cache_dir
from echo_plan.output_paths import check_output_file
from echo_plan.search.progress import RichProgress
from echo_plan.report.api import report_from_cli
from echo_plan.search.explain import explain_top, format_knob_stats
from echo_plan.search.table import format_ranked
from echo_plan.search.results import simulated_this_study
from echo_plan.search.table import plan_label
from echo_plan.search.explain_cp import cp_choice
from echo_plan.search.compare_dtype import format_dtype_compare, run_dtype_compare
from echo_plan.search.evaluator import SimulatorFactory
from echo_plan.search.explain import knob_stats
from echo_plan.search.serialize import outcome_to_json
from echo_plan.search.study import prune_for, run_search
from echo_plan.search.table import ranked_csv
from echo_plan.limits import check_int
from echo_plan.search.compare import parse_gpu_list, parse_tokens, run_compare
from echo_plan.search.serialize import compare_to_json
from echo_plan.search.table import COMPARE_COLUMNS, compare_rows, format_compare
from echo_plan.search.compare_dtype import parse_dtypes
from echo_plan.search.compare_cluster import (
    format_cluster_compare, parse_names, parse_prices, read_cluster_list, run_cluster_compare,
)

def check_outputs(csv: Optional[str], report: Optional[str], cache_dir: Optional[str]) -> None:
    """Where search and compare will write, checked before they do any work."""
    check_output_file(csv, "--csv", (".csv",))
    check_output_file(report, "--report", (".html", ".htm"))
    check_cache_dir(cache_dir)


def _progress(enabled: Optional[bool], label: str):
    show = stderr_is_tty() if enabled is None else enabled
    if not show:
        return None

    return RichProgress(label)


def after_search(outcome, report: Optional[str] = None, cache_dir: Optional[str] = None, as_json: bool = False) -> None:
    """Further outputs of a finished search: the HTML report with ``--report FILE``."""
    report_from_cli(outcome, report, cache_dir, quiet_stdout=as_json)


def after_compare(outcome, report: Optional[str] = None, cache_dir: Optional[str] = None, as_json: bool = False) -> None:
    """Further outputs of a finished compare: the HTML report with ``--report FILE``."""
    report_from_cli(outcome, report, cache_dir, quiet_stdout=as_json)


def print_search(outcome, top: int, explain: bool, pruned=None) -> None:
    gpus = outcome.cluster["gpus_per_node"] * outcome.cluster["num_nodes"]
    typer.echo(f"{outcome.model['name']} on {gpus} x {outcome.cluster['gpu']['name']} ({outcome.cluster['name']}), "
               f"space {outcome.space['name']}, study {outcome.study_name}")
    cal = outcome.cluster.get("calibration") or {}
    if "compute" not in cal or cal.get("from"):  # inherited, or none for this GPU: said before the ranking
        typer.echo("calibration: " + calibration_summary(cal))
    for line in format_ranked(outcome, top):
        typer.echo(line)
    if outcome.sampler == "nsga2" and outcome.pareto:
        typer.echo("\nPareto front (no other plan has more tokens/s and less memory):")
        for r in outcome.pareto:
            typer.echo(f"  {r.tokens_per_s:10,.0f} tokens/s  {r.memory_peak_gib:6.1f} GiB  {plan_label(r.plan)}")
    typer.echo("")
    for line in explain_top(outcome.ranked):
        typer.echo(line)
    if outcome.best is not None:
        why_cp = cp_choice(outcome.best, outcome.ranked, int(outcome.model["seq_length"]),
                           int(outcome.cluster.get("nvlink_domain_gpus") or outcome.cluster["gpus_per_node"]),
                           outcome.pruned_counts)
        if why_cp:
            typer.echo(why_cp)
    pruned_total = sum(outcome.pruned_counts.values())

    sims = simulated_this_study(outcome.trials)
    typer.echo(f"{len(outcome.trials)} trials ({sims} simulated this study), {pruned_total} of "
               f"{outcome.candidates_total} candidates pruned before simulation; traces made "
               f"{outcome.traces_made}, trace cache hits {outcome.trace_cache_hits}; {outcome.wall_s:.1f} s")
    if explain:
        typer.echo("\nPruned, by reason (each candidate under the first rule it breaks):")
        for reason, n in outcome.pruned_counts.items():
            typer.echo(f"  {n:6d}  {reason}")
        typer.echo("\nEach knob value: candidates, valid, simulated, and why the rest were pruned:")
        for line in format_knob_stats(outcome.pruned_by_knob):
            typer.echo("  " + line)
    else:
        top_reasons = sorted(outcome.pruned_counts.items(), key=lambda kv: -kv[1])[:3]
        if top_reasons:
            typer.echo("most pruned: " + "; ".join(f"{n} {r}" for r, n in top_reasons) + " (--explain for each knob value)")
    for note in outcome.notes:
        typer.echo(f"note: {note}")


def compare_dtypes(base, sizes, dtypes, run, csv, report, as_json) -> None:
    """``compare --dtype bf16,fp8``: each size searched once per precision, the best plans side by side."""
    if csv or report:
        raise SpecError("--csv" if csv else "--report", csv or report, "not with several --dtype values (the "
                        "comparison prints, or gives JSON with --json); run compare per precision for those")
    try:
        result = run_dtype_compare(base, sizes, dtypes,
                                   lambda config: run(config, f" {config.space.values(_dtype_knob())[0]}"))
    except KeyboardInterrupt:
        typer.echo("interrupted: finished trials are stored; run the same command again to resume", err=True)
        raise typer.Exit(130) from None
    if as_json:
        print_json(result.as_json())
        return
    typer.echo(f"{base.model.name} on {base.cluster.gpu.name} ({base.cluster.name}), gbs {base.global_batch_size}: "
               + " vs ".join(dtypes))
    for line in format_dtype_compare(result):
        typer.echo(line)


def compare_clusters(configs, sizes, prices, cache_dir, progress, csv, report, as_json, fm, dtype) -> None:
    """``compare --cluster a,b,c``: each cluster searched at every size, the best plans side by side."""
    if dtype is not None and "," in dtype:
        raise SpecError("--dtype", dtype, "one precision when comparing clusters")

    def run_one(config, price):
        return run_compare(config, sizes, lambda c: SimulatorFactory(config.model, c, cache_dir, config.stack,
                                                                     config.memory_headroom_bytes),
                           price, progress_for=lambda g: _progress(progress, f"{config.cluster.name} {g} GPUs"),
                           failure_model=fm)

    by_name = {c.cluster.name: (c, p) for c, p in zip(configs, prices)}
    try:
        result = run_cluster_compare([c.cluster for c in configs], prices,
                                     lambda cl: run_one(*by_name[cl.name]))
    except KeyboardInterrupt:
        typer.echo("interrupted: finished trials are stored; run the same command again to resume", err=True)
        raise typer.Exit(130) from None
    if csv:
        import csv as csv_mod
        import io

        rows = result.rows()
        buf = io.StringIO()
        w = csv_mod.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        for row in rows:
            w.writerow({k: "" if v is None else v for k, v in row.items()})
        write_atomic(csv, buf.getvalue())
    if as_json:
        print_json(result.as_json())
    else:
        first = configs[0]
        typer.echo(f"{first.model.name}, gbs {first.global_batch_size}, {first.tokens_budget or 0:,.0f} tokens: "
                   + " vs ".join(c.cluster.name for c in configs))
        for line in format_cluster_compare(result):
            typer.echo(line)
        for config in configs:  # whose figures time a PyTorch-native stack's kernels on each cluster
            said = kernels_status(config.cluster, config.stack.kernels)
            if said:
                typer.echo(f"{config.cluster.name}: {said}")
        if csv:
            typer.echo(f"wrote {csv}")
    if report:
        from echo_plan.report.cluster_compare_page import write_cluster_compare_report  # heavy: Jinja2, Plotly

        written = write_cluster_compare_report(result, report)
        typer.echo(f"report written: {written} ({written.stat().st_size / 1e6:.1f} MB)", err=as_json)


def _dtype_knob():
    return Knob.DTYPE


def register(app: typer.Typer) -> None:
    @app.command("search")
    def search(
        model: str = ModelOpt, cluster: str = ClusterOpt, nodes: Optional[int] = NodesOpt,
        gpus: Optional[int] = typer.Option(None, "--gpus", help="resize the cluster to G GPUs (default: the preset's size)"),
        gbs: int = GbsOpt, space: Optional[str] = SpaceOpt, sampler: str = SamplerOpt,
        seq_length: Optional[int] = SeqOpt,
        cp: Optional[int] = typer.Option(None, "--cp", help="fix the context-parallel degree (default: the space's "
                                         "cp knob; the default space varies it above 16K tokens)"),
        stack: Optional[str] = StackOpt, memory_headroom: Optional[str] = HeadroomOpt,
        trials: Optional[int] = TrialsOpt, seed: int = SeedOpt, storage: Optional[str] = StorageOpt,
        study_name: Optional[str] = StudyOpt, workers: int = WorkersOpt, ray_address: Optional[str] = RayOpt,
        processes: Optional[int] = ProcessesOpt, cache_dir: Optional[str] = CacheDirOpt,
        dp_comm: Optional[str] = SearchDpCommOpt,
        density: Optional[float] = DensityOpt,
        dtype: Optional[str] = typer.Option(None, "--dtype", help="fix the precision: bf16 | fp16 | fp8 | fp4 "
                                            "(default: the space's dtype knob)"),
        fp8_recipe: Optional[str] = Fp8RecipeOpt, fp8_param_gather: Optional[bool] = Fp8ParamGatherOpt,
        offload_optimizer: Optional[bool] = OffloadOpt,
        routing: Optional[str] = RoutingOpt, flows_per_connection: Optional[int] = FlowsOpt,
        top: int = typer.Option(DEFAULT_TOP, "--top", help="plans to show"),
        as_json: bool = JsonOpt,
        csv: Optional[str] = typer.Option(None, "--csv", help="write the ranked plans to this CSV file"),
        explain: bool = typer.Option(False, "--explain", help="pruned candidates per reason and per knob value"),
        progress: Optional[bool] = ProgressOpt, report: Optional[str] = ReportOpt,
        from_launch: Optional[str] = FromLaunchOpt, launch_format: Optional[str] = LaunchFormatOpt,
    ) -> None:
        """Find the fastest plans that fit: prune the space, simulate candidates (Optuna), rank them."""
        check_int("--top", top, 1, 1_000_000, "plans to show")
        check_outputs(csv, report, cache_dir)
        job = None
        if from_launch is not None:
            given = {"--model": model != ModelOpt.default, "--gbs": gbs != DEFAULT_GBS,
                     "--nodes": nodes is not None, "--seq-length": seq_length is not None}
            clash = next((k for k, v in given.items() if v), None)
            if clash:
                raise SpecError(clash, "given", "not with --from-launch (the job's model, batch and stack are read "
                                                "from its launch config, its GPUs too unless --gpus gives them)")
            job = read_launch(from_launch, resolve_stack(stack),  # --gpus: as simulate and import launch take it
                              fmt=parse_launch_format(launch_format, "--launch-format") if launch_format else None,
                              gpus=gpus)
            gbs = job.plan.global_batch_size
            if dtype is None:  # like for like: the job's precision
                dtype = job.plan.dtype.value
        elif launch_format is not None:
            raise SpecError("--launch-format", launch_format, "needs --from-launch")
        config = build_config(model, cluster, nodes, gpus, gbs, space, sampler, trials, seed, storage, study_name,
                         workers, ray_address, stack=stack, memory_headroom=memory_headroom, dp_comm=dp_comm,
                         density=density, dtype=dtype, fp8_recipe=fp8_recipe, fp8_param_gather=fp8_param_gather,
                         processes=processes, seq_length=seq_length, cp=cp,
                         routing=routing, flows_per_connection=flows_per_connection, job=job,
                         cache_dir=cache_dir, offload_optimizer=offload_optimizer)
        if dtype is not None and "," in dtype:
            raise SpecError("--dtype", dtype, "one precision for search (compare takes a list: --dtype bf16,fp8)")
        pruned = prune_for(config)
        if not pruned.valid and explain:
            for line in format_knob_stats(knob_stats(pruned, ())):
                typer.echo(line, err=True)
        factory = SimulatorFactory(config.model, config.cluster, cache_dir, config.stack, config.memory_headroom_bytes)
        try:
            outcome = run_search(config, factory, pruned=pruned,
                                 progress=_progress(progress, f"search {config.cluster.num_gpus} GPUs"))
        except KeyboardInterrupt:
            typer.echo("interrupted: finished trials are stored; run the same command again to resume", err=True)
            raise typer.Exit(130) from None
        if csv:
            write_atomic(csv, ranked_csv(outcome, top=None))
        if as_json:
            print_json(outcome_to_json(outcome))
        else:
            print_search(outcome, top, explain)
            if csv:
                typer.echo(f"wrote {csv}")
        if job is not None and not as_json:
            print_job_comparison(job, config, outcome, cache_dir)
        after_search(outcome, report, cache_dir, as_json)

    @app.command("compare")
    def compare(
        model: str = ModelOpt,
        cluster: str = typer.Option(ClusterOpt.default, "--cluster", "-c",
                                    help="cluster preset or YAML file; several, comma-separated (h800,h200,b200,"
                                         "gb200-nvl72), or a YAML list (clusters: [{cluster: h800, "
                                         "price_per_gpu_hour: 2.1}, ...]), compare the kinds side by side"),
        gpus: str = typer.Option("64,96,128,256,512", "--gpus", help="cluster sizes to compare, comma-separated"),
        gbs: int = GbsOpt, space: Optional[str] = SpaceOpt, sampler: str = SamplerOpt,
        seq_length: Optional[int] = SeqOpt,
        cp: Optional[int] = typer.Option(None, "--cp", help="fix the context-parallel degree (default: the space's "
                                         "cp knob; the default space varies it above 16K tokens)"),
        stack: Optional[str] = StackOpt, memory_headroom: Optional[str] = HeadroomOpt,
        trials: Optional[int] = TrialsOpt, seed: int = SeedOpt, storage: Optional[str] = StorageOpt,
        tokens: str = typer.Option("300B", "--tokens",
                                   help="token budget to train (300B, 1.5T, 2e12; default 300B, GPT-3's)"),
        price: Optional[str] = typer.Option(None, "--price-per-gpu-hour",
                                            help="adds the cost of the token budget; with several clusters one "
                                                 "price for all or one per cluster (2.1,2.5,6)"),
        workers: int = WorkersOpt, ray_address: Optional[str] = RayOpt, processes: Optional[int] = ProcessesOpt,
        cache_dir: Optional[str] = CacheDirOpt,
        dp_comm: Optional[str] = SearchDpCommOpt,
        density: Optional[float] = DensityOpt,
        dtype: Optional[str] = typer.Option(None, "--dtype", help="precision(s): bf16 | fp16 | fp8 | fp4, or a list "
                                            "such as bf16,fp8 to search each size once per precision and compare them"),
        fp8_recipe: Optional[str] = Fp8RecipeOpt, fp8_param_gather: Optional[bool] = Fp8ParamGatherOpt,
        offload_optimizer: Optional[bool] = OffloadOpt,
        routing: Optional[str] = RoutingOpt, flows_per_connection: Optional[int] = FlowsOpt,
        failures_per_gpu_day: Optional[float] = FailRateOpt, checkpoint_gbps_per_gpu: Optional[float] = CkptBwOpt,
        restart_min: Optional[float] = RestartOpt, detect_min: Optional[float] = DetectOpt,
        as_json: bool = JsonOpt,
        csv: Optional[str] = typer.Option(None, "--csv", help="write the comparison to this CSV file"),
        progress: Optional[bool] = ProgressOpt, report: Optional[str] = ReportOpt,
    ) -> None:
        """Search each cluster size: best plan, throughput, scaling efficiency, time and GPU-hours to train."""
        check_outputs(csv, report, cache_dir)
        sizes = parse_gpu_list(gpus)
        listed = read_cluster_list(cluster)  # a YAML list of clusters (and their prices)
        if listed is not None and price is not None:
            raise SpecError("--price-per-gpu-hour", price, f"not with the cluster list {cluster} (it gives the prices)")
        names, prices = listed if listed is not None else (parse_names(cluster), None)
        prices = prices if prices is not None else parse_prices(price, names)

        def config_for(name: str):
            return build_config(model, name, None, None, gbs, space, sampler, trials, seed, storage, None, workers,
                           ray_address, tokens=parse_tokens(tokens), stack=stack, memory_headroom=memory_headroom,
                           dp_comm=dp_comm, density=density, dtype=dtype, fp8_recipe=fp8_recipe,
                           fp8_param_gather=fp8_param_gather, processes=processes, seq_length=seq_length, cp=cp,
                           routing=routing, flows_per_connection=flows_per_connection, cache_dir=cache_dir,
                           offload_optimizer=offload_optimizer)

        if len(names) > 1 or listed is not None:
            compare_clusters([config_for(n) for n in names], sizes, prices, cache_dir, progress, csv, report,
                             as_json, failure_model(failures_per_gpu_day, checkpoint_gbps_per_gpu, restart_min,
                                                    detect_min), dtype)
            return
        price = prices[0]
        base = build_config(model, cluster, None, None, gbs, space, sampler, trials, seed, storage, None, workers,
                       ray_address, tokens=parse_tokens(tokens), stack=stack, memory_headroom=memory_headroom,
                       dp_comm=dp_comm, density=density, dtype=dtype, fp8_recipe=fp8_recipe,
                       fp8_param_gather=fp8_param_gather, processes=processes,
                       seq_length=seq_length, cp=cp, routing=routing,
                       flows_per_connection=flows_per_connection, cache_dir=cache_dir,
                       offload_optimizer=offload_optimizer)
        fm = failure_model(failures_per_gpu_day, checkpoint_gbps_per_gpu, restart_min, detect_min)

        def run(config, label: str = ""):
            return run_compare(
                config, sizes, lambda c: SimulatorFactory(config.model, c, cache_dir, config.stack,
                                                          config.memory_headroom_bytes),
                price, progress_for=lambda g: _progress(progress, f"search {g} GPUs{label}"), failure_model=fm)

        if dtype is not None and "," in dtype:
            dtypes = parse_dtypes(dtype)
            if len(dtypes) > 1:
                compare_dtypes(base, sizes, dtypes, run, csv, report, as_json)
                return
            base = replace(base, space=base.space.with_values({"dtype": (dtypes[0],)}))
        try:
            outcome = run(base)
        except KeyboardInterrupt:
            typer.echo("interrupted: finished trials are stored; run the same command again to resume", err=True)
            raise typer.Exit(130) from None
        if csv:
            import csv as csv_mod
            import io

            buf = io.StringIO()
            w = csv_mod.DictWriter(buf, fieldnames=COMPARE_COLUMNS, lineterminator="\n")
            w.writeheader()
            for row in compare_rows(outcome):
                w.writerow({k: "" if v is None else v for k, v in row.items()})
            write_atomic(csv, buf.getvalue())
        if as_json:
            print_json(compare_to_json(outcome))
        else:
            typer.echo(f"{base.model.name} on {base.cluster.gpu.name} ({base.cluster.name}), gbs {gbs}, "
                       f"{outcome.tokens_budget:.3g} tokens")
            for line in format_compare(outcome):
                typer.echo(line)
            for row in outcome.rows:
                for note in row.outcome.notes:
                    if note.startswith("no plan"):
                        typer.echo(f"note: {note}")
            for note in outcome.notes:
                typer.echo(f"note: {note}")
            typer.echo(f"{outcome.wall_s:.1f} s")
        after_compare(outcome, report, cache_dir, as_json)

