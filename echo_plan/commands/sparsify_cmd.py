"""``echo-plan sparsify``: where gradient sparsification pays for one plan (break-even densities)."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import (
    CacheDirOpt, JsonOpt, print_json,
)
from echo_plan.commands.plan_flags import PlanFlags, build_plan, plan_options
from echo_plan.commands.common import check_cache_dir
from echo_plan.errors import SpecError
from echo_plan.output_paths import check_output_file
from echo_plan.search.sparsify import SparsifyOutcome, analyse
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.trace.cache import TraceCache
from echo_plan.report.sparsify_page import write_sparsify_report
from echo_plan.report.plans import short_label


# sparsify sets the data-parallel exchange itself: every sparse method at every density of --densities
SPARSIFY_REFUSES = {"dp_comm": "sparsify tries every sparse exchange itself against the dense one; not with --dp-comm",
                    "density": "sparsify tabulates the densities of --densities; not with --density"}


def register(app: typer.Typer) -> None:
    @app.command("sparsify")
    @plan_options
    def sparsify_cmd(
        flags: PlanFlags,
        densities: str = typer.Option("0.001,0.003,0.01,0.03,0.1,0.3,1", "--densities",
                                      help="densities to tabulate, comma-separated, each in (0, 1]"),
        as_json: bool = JsonOpt,
        report: Optional[str] = typer.Option(None, "--report", help="also write an HTML report with the chart"),
        cache_dir: Optional[str] = CacheDirOpt,
    ) -> None:
        """Break-even density of each sparse data-parallel exchange against the dense reduction, for one plan."""
        check_output_file(report, "--report", (".html", ".htm"))
        check_cache_dir(cache_dir)
        try:
            grid = tuple(float(x) for x in densities.split(",") if x.strip())
        except ValueError:
            raise SpecError("--densities", densities, "comma-separated numbers in (0, 1], e.g. 0.001,0.01,0.1") from None
        inputs = build_plan(flags, refuse=SPARSIFY_REFUSES)
        model_spec, cluster_spec, stack_spec, plan = inputs.model, inputs.cluster, inputs.stack, inputs.plan
        memo, cache = SimulationMemo(), TraceCache(cache_dir)

        def step(p):
            return simulate(model_spec, cluster_spec, p, stack=stack_spec, cache=cache, memo=memo)

        def progress(i, n, name):
            if not as_json:
                typer.echo(f"  [{i + 1}/{n}] {name} ...", err=True)

        dense, curves = analyse(plan, step, grid, progress=progress)
        outcome = SparsifyOutcome(model_spec.name, cluster_spec.name, cluster_spec.num_gpus,
                                  dense.plan, dense.step_time_s, plan.dp, curves)
        if report:
            write_sparsify_report(outcome, report, model_spec, cluster_spec)
        if as_json:
            print_json(outcome.as_json())
            return
        _print(outcome)
        if report:
            typer.echo(f"report written: {report}")


def _print(o) -> None:
    typer.echo(f"{o.model} on {o.cluster} ({o.num_gpus} GPUs), {short_label(o.plan)}: dense step "
               f"{o.dense_step_time_s:.4f} s (data-parallel group of {o.dp})")
    grid = [d for d, _, _ in o.curves[0].points] if o.curves else []
    head = f"  {'method':<16}{'break-even':>12}" + "".join(f"{f'd={d:g}':>11}" for d in grid)
    typer.echo(head)
    for c in o.curves:
        be = "never" if c.break_even_density is None else f"{c.break_even_density:.3g}"
        typer.echo(f"  {c.method.value:<16}{be:>12}" + "".join(f"{t:>11.4f}" for _, t, _ in c.points))
    typer.echo("  (step seconds per density; break-even: the largest density whose step is no slower than dense)")
    typer.echo("note: convergence is not modelled: a sparsifier changes the number of steps to a given loss")
