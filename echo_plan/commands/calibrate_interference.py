"""``echo-plan calibrate interference fit|measure``: interference factors from measurements.

Registered on the ``calibrate`` sub-app by ``calibrate_cmd.py`` via ``register_interference``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from echo_plan.commands.common import JsonOpt, print_json, write_atomic
from echo_plan.calibrate.interference_fit import fit_interference, read_measurements
from echo_plan.output_paths import check_output_file
from echo_plan.replay.interference import load_interference
from echo_plan.calibrate.interference_measure import MeasureConfig, MeasureMode
from echo_plan.errors import SpecError


def register_interference(calibrate_app: typer.Typer) -> None:
    app = typer.Typer(help="Interference factors: fit them from measurements, or measure them on a CUDA GPU.",
                      no_args_is_help=True)

    @app.command("fit")
    def fit(
        csv_path: Path = typer.Argument(..., help="measurement CSV: compute_kind,comm_kind,isolated_us,"
                                                  "overlapped_us[,slowed][,source]"),
        out: Path = typer.Option(..., "--output", "-o", "--out", help="interference YAML to write (use it with --interference); --out: the older name"),
        as_json: bool = JsonOpt,
    ) -> None:
        """Fit the median overlapped/isolated ratio per (compute kind, communication kind)."""
        check_output_file(out, "--output", (".yaml", ".yml"))
        result = fit_interference(read_measurements(csv_path), str(csv_path))
        path = write_atomic(out, result.to_yaml())
        load_interference(str(path))  # what we wrote must load
        if as_json:
            print_json({"out": str(path), "rows": result.rows, "pairs": [
                {"slowed": p.slowed.value, "compute_kind": p.compute_kind.value, "comm_kind": p.comm_kind.value,
                 "factor": p.factor, "median_ratio": p.median_ratio, "count": p.count,
                 "min_ratio": p.min_ratio, "max_ratio": p.max_ratio} for p in result.pairs]})
            return
        typer.echo(f"{'slowed':8s} {'compute':10s} {'comm':15s} {'factor':>7s} {'n':>4s} {'min':>7s} {'max':>7s}")
        for p in result.pairs:
            typer.echo(f"{p.slowed.value:8s} {p.compute_kind.value:10s} {p.comm_kind.value:15s} {p.factor:7.3f} "
                       f"{p.count:4d} {p.min_ratio:7.3f} {p.max_ratio:7.3f}")
        typer.echo(f"wrote {path} ({len(result.pairs)} pairs from {result.rows} rows; unmeasured pairs keep "
                   "the defaults when loaded with --interference)")
        stand_ins = result.stand_in_pairs()
        if stand_ins:
            typer.echo(f"note: {len(stand_ins)} of the {len(result.pairs)} pairs come from stand-ins measured on one GPU "
                       "(a copy or elementwise kernel on every SM in place of NCCL, which uses a few): upper bounds, "
                       "above all for the communication side; measure with --mode nccl on several GPUs for factors "
                       "to plan with")

    @app.command("measure")
    def measure(
        out: Path = typer.Option(..., "--output", "-o", "--out", help="measurement CSV to write; --out: the older name"),
        mode: str = typer.Option("auto", "--mode", help="auto (NCCL with several GPUs, else stand-ins) | nccl | standin"),
        iters: int = typer.Option(20, "--iters", min=1, max=100_000, help="timed launches per measurement"),
        gemm_n: int = typer.Option(8192, "--gemm-n", min=64, max=65_536, help="size of the square bf16 matmul"),
        mem_mib: int = typer.Option(512, "--mem-mib", min=1, max=65_536, help="operand size of the memory-bound kernel"),
        comm_mib: int = typer.Option(256, "--comm-mib", min=1, max=65_536, help="collective (or stand-in) buffer size"),
    ) -> None:
        """Time compute kernels alone and beside a communication kernel on another stream (CUDA only)."""
        from echo_plan.calibrate.interference_cuda import measure_to_csv  # torch only when it measures

        check_output_file(out, "--output", (".csv",))
        try:
            m = MeasureMode(mode)
        except ValueError:
            raise SpecError("--mode", mode, "one of: " + ", ".join(x.value for x in MeasureMode)) from None
        outcome = measure_to_csv(out, MeasureConfig(gemm_n=gemm_n, mem_mib=mem_mib, comm_mib=comm_mib,
                                                    iters=iters, mode=m))
        typer.echo(outcome.message)

    calibrate_app.add_typer(app, name="interference")
