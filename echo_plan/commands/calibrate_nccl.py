"""``echo-plan calibrate nccl LOG... --cluster C -o FILE``: fit the NCCL collective model to
nccl-tests logs and write a cluster file that carries the fitted values and their provenance.

``echo_plan/commands/calibrate_cmd.py`` owns the ``calibrate`` sub-app and calls
``register_nccl(calibrate_app)``.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Optional

import typer

from echo_plan.commands.common import ClusterOpt, JsonOpt, print_json, write_atomic
from echo_plan import __version__
from echo_plan.errors import SpecError
from echo_plan.interop.nccl_tests import parse_nccl_tests
from echo_plan.specs import load_cluster
from echo_plan.trace.records import CollectiveKind
from echo_plan.output_paths import check_output_file
from echo_plan.calibrate.a2a_fit import keep_share


def error_table(fit) -> list[str]:
    """Predicted vs measured (out-of-place) per log and size, as text lines."""
    lines = [f"{'log':<28} {'role':<8} {'GPUs':>4} {'size':>12} {'meas us':>10} {'pred us':>10} "
             f"{'err %':>7} {'meas busbw':>10} {'pred busbw':>10}  choice"]
    for r in fit.rows:
        if r.placement != "out-of-place":
            continue
        role = "fit" if r.in_fit else "holdout"
        flag = "  (outlier)" if r.outlier else ""
        lines.append(f"{r.log:<28} {role:<8} {r.nranks:>4} {r.size_bytes:>12} {r.measured_us:>10.1f} "
                     f"{r.predicted_us:>10.1f} {r.error_pct:>+7.1f} {r.measured_busbw:>10.2f} "
                     f"{r.predicted_busbw:>10.2f}  {r.algorithm}/{r.protocol}{flag}")
    return lines


def calibration_record(fit, log_paths: list[str], fit_max_gpus: Optional[int]) -> dict:
    """What goes under ``calibration.nccl`` in the cluster file."""
    return {
        "params": fit.values,
        "provenance": {
            "tool": f"echo-plan {__version__} calibrate nccl",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "logs": [str(p) for p in log_paths],
            "fit_logs": list(fit.fit_logs),
            "holdout_logs": list(fit.holdout_logs),
            "skipped": [f"{name}: {why}" for name, why in fit.skipped],
            "fit_max_gpus": fit_max_gpus,
            "fitted": list(fit.fitted),
            "method": "Huber least squares on log(predicted/measured time), rows that jump away from both "
                      "neighbours skipped, rows off by more than 4 robust sigmas (>= e^1) rejected",
            "error_per_log": fit.log_summary(),
            "not_fitted": ("network tier: cluster NIC figures and NCCL latencies (no fitted log spans servers)"
                           if not any(n.startswith("net_") for n in fit.fitted) else ""),
        },
    }


def register_nccl(calibrate_app: typer.Typer) -> None:
    @calibrate_app.command("nccl")
    def nccl_cmd(
        logs: list[str] = typer.Argument(..., help="nccl-tests output files (all_reduce_perf, all_gather_perf, ...)"),
        cluster: str = ClusterOpt,
        output: str = typer.Option(..., "--output", "-o", help="cluster YAML to write (the cluster plus calibration:)"),
        fit_max_gpus: Optional[int] = typer.Option(
            None, "--fit-max-gpus", help="fit on logs with at most N GPUs; report the error on the larger ones"),
        kind: Optional[str] = typer.Option(
            None, "--kind", help="collective of every log when the file names do not say (all_reduce, ...)"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Fit the NCCL collective model to nccl-tests logs and write a calibrated cluster file."""
        import yaml

        from echo_plan.calibrate.nccl_fit import fit_nccl  # deferred: loads numpy

        check_output_file(output, "--output", (".yaml", ".yml"))
        if fit_max_gpus is not None and fit_max_gpus < 2:
            raise SpecError("--fit-max-gpus", fit_max_gpus, "at least 2 (one GPU moves no data)")
        the_kind = None
        if kind is not None:
            try:
                the_kind = CollectiveKind(kind)
            except ValueError:
                raise SpecError("--kind", kind, ", ".join(k.value for k in CollectiveKind)) from None
        spec = load_cluster(cluster)
        parsed = sorted((parse_nccl_tests(p, kind=the_kind) for p in logs), key=lambda lg: (lg.nranks, lg.source))
        fit = fit_nccl(parsed, spec, fit_max_gpus=fit_max_gpus)

        record = keep_share(calibration_record(fit, logs, fit_max_gpus), spec.calibration)
        data = spec.model_dump(mode="json")
        data["calibration"] = {**data.get("calibration", {}), "nccl": record}
        data["sources"] = list(data.get("sources", [])) + [
            f"calibration.nccl: fitted by echo-plan calibrate nccl to {', '.join(Path(p).name for p in logs)}"]
        header = (f"# {spec.name} with the NCCL model calibrated by `echo-plan calibrate nccl` "
                  f"({record['provenance']['date']}).\n")
        write_atomic(output, header + yaml.safe_dump(data, sort_keys=False))
        if as_json:
            print_json({"output": output, "calibration": record,
                        "rows": [dict(log=r.log, nranks=r.nranks, size_bytes=r.size_bytes, placement=r.placement,
                                      measured_us=r.measured_us, predicted_us=r.predicted_us,
                                      error_pct=round(r.error_pct, 2), in_fit=r.in_fit, outlier=r.outlier,
                                      algorithm=r.algorithm, protocol=r.protocol) for r in fit.rows]})
            return
        typer.echo(f"fitted on {', '.join(fit.fit_logs)}" +
                   (f"; held out {', '.join(fit.holdout_logs)}" if fit.holdout_logs else ""))
        for name, why in fit.skipped:
            typer.echo(f"skipped {name}: {why}")
        for name, value in fit.values.items():
            typer.echo(f"  {name:<22} {value}")
        for line in error_table(fit):
            typer.echo(line)
        for s in fit.log_summary():
            typer.echo(f"{s['log']:<28} {s['role']:<8} median |err| {s['median_abs_error_pct']}%  "
                       f"max |err| {s['max_abs_error_pct']}%  outliers {s['outliers']}")
        typer.echo(f"wrote {output}")
