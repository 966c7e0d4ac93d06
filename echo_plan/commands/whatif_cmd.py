"""``echo-plan whatif sensitivity``: what one slow GPU, NIC, NVLink domain or server costs a plan."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan.commands.common import CacheDirOpt, FlowsOpt, JsonOpt, RoutingOpt, print_json
from echo_plan.commands.plan_flags import PlanFlags, build_plan, plan_options
from echo_plan.commands.common import check_cache_dir
from echo_plan.output_paths import check_output_file
from echo_plan.resilience.sensitivity import sensitivity
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.trace.cache import TraceCache
from echo_plan.report.whatif_page import write_whatif_report


def register(app: typer.Typer) -> None:
    whatif_app = typer.Typer(help="What-ifs on one plan: faults and stragglers.", no_args_is_help=True)
    app.add_typer(whatif_app, name="whatif")

    @whatif_app.command("sensitivity")
    @plan_options
    def sensitivity_cmd(
        flags: PlanFlags,
        routing: Optional[str] = RoutingOpt,
        flows_per_connection: Optional[int] = FlowsOpt,
        as_json: bool = JsonOpt,
        report: Optional[str] = typer.Option(None, "--report", help="also write an HTML report with the table and chart"),
        cache_dir: Optional[str] = CacheDirOpt,
    ) -> None:
        """Throughput lost to one slow GPU, NIC, NVLink domain or server, at a few severities (worst and best placement)."""
        check_cache_dir(cache_dir)
        check_output_file(report, "--report", (".html", ".htm"))
        inputs = build_plan(flags, routing=routing, flows_per_connection=flows_per_connection)
        model_spec, cluster_spec, stack_spec, plan = inputs.model, inputs.cluster, inputs.stack, inputs.plan
        memo, cache = SimulationMemo(), TraceCache(cache_dir)

        def step(faults):
            return simulate(model_spec, cluster_spec, plan, stack=stack_spec, cache=cache, memo=memo,
                            faults=faults).step_time_s

        healthy, rows = sensitivity(plan, cluster_spec, step)
        if report:
            write_whatif_report(report, model_spec, cluster_spec, plan, healthy, rows)
        if as_json:
            print_json({"model": model_spec.name, "cluster": cluster_spec.name, "num_gpus": cluster_spec.num_gpus,
                        "plan": plan.model_dump(mode="json"), "healthy_step_time_s": healthy,
                        "rows": [r.as_json() for r in rows]})
            return
        typer.echo(f"{model_spec.name} on {cluster_spec.name} ({cluster_spec.num_gpus} GPUs), {plan.short()}: "
                   f"healthy step {healthy:.4f} s")
        typer.echo(f"  {'fault':<34}{'lost (worst)':>14}{'at stage':>10}{'lost (best)':>13}{'at stage':>10}")
        for r in rows:
            typer.echo(f"  {r.what:<34}{r.worst_loss:>14.1%}{r.worst_stage:>10}{r.best_loss:>13.1%}{r.best_stage:>10}")
        typer.echo("  (share of throughput lost; the fault is placed on the first GPU of each stage tried)")
        if report:
            typer.echo(f"report written: {report}")
