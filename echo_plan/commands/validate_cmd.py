"""``echo-plan validate``: predictions against the validation suites, error per row, pass/fail."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from echo_plan.commands.common import CacheDirOpt, JsonOpt, print_json
from echo_plan.errors import EchoPlanError


def register(app: typer.Typer) -> None:
    @app.command("validate")
    def validate(
        suite: Optional[List[str]] = typer.Option(None, "--suite", "-s", help="run only these suites (names as listed by --list)"),
        dirs: Optional[List[Path]] = typer.Option(None, "--dir", help="another folder of suites (CSV files, nccl-tests/<cluster>/)"),
        list_only: bool = typer.Option(False, "--list", help="list the suites found and exit"),
        as_json: bool = JsonOpt,
        cache_dir: Optional[Path] = CacheDirOpt,
    ) -> None:
        """Run validation suites: predicted vs measured per row, mean and max error, within tolerance or not.

        Suites are found in $ECHO_PLAN_VALIDATION_DIR (default ../shared/validation) and in every
        --dir. Adding a suite is adding a CSV file in the format documented in docs/validation.md.
        Exits 1 when a suite is outside its tolerance.
        """
        from echo_plan.validation.megatron import validation_dir
        from echo_plan.validation.suites import discover, run_suite

        folders = [validation_dir()] + list(dirs or [])
        for d in folders[1:]:
            if not d.is_dir():
                raise EchoPlanError(f"--dir {d}: no such folder")
        refs = discover([d for d in folders if d.is_dir()])
        if not refs:
            raise EchoPlanError(f"no validation suites found in {', '.join(map(str, folders))} "
                                f"(set ECHO_PLAN_VALIDATION_DIR or pass --dir)")
        if suite:
            known = {r.name for r in refs}
            unknown = [s for s in suite if s not in known]
            if unknown:
                raise EchoPlanError(f"unknown suite {unknown[0]!r}; found: {', '.join(sorted(known))}")
            refs = [r for r in refs if r.name in suite]
        if list_only:
            for r in refs:
                typer.echo(f"{r.name:<40} {r.kind:<10} {r.path}")
            return
        from echo_plan.trace.cache import TraceCache

        cache = TraceCache(cache_dir)
        results = []
        for ref in refs:
            if not as_json:
                typer.echo(f"running {ref.name} ...", err=True)
            results.append(run_suite(ref, cache))
        if as_json:
            print_json({"suites": [r.as_json() for r in results], "passed": all(r.passed for r in results)})
        else:
            for r in results:
                _print_suite(r)
        if not all(r.passed for r in results):
            raise typer.Exit(1)


def _print_suite(r) -> None:
    typer.echo(f"\n== {r.name} ({r.kind}, {r.unit})")
    for note in r.notes:
        typer.echo(f"   {note}")
    typer.echo(f"   {'row':<34} {'measured':>10} {'predicted':>10} {'error':>8}")
    for row in r.rows:
        mark = " (held out)" if row.held_out and r.kind == "training" else ""
        typer.echo(f"   {row.label:<34} {row.measured:>10.1f} {row.predicted:>10.1f} {row.error * 100:>+7.1f}%  "
                   f"{row.detail}{mark}")
    verdict = "PASS" if r.passed else "FAIL"
    typer.echo(f"   mean |error| {r.mean_abs_error * 100:.1f}%, max |error| {r.max_abs_error * 100:.1f}%, "
               f"tolerance {r.tolerance * 100:.0f}%: {verdict}")
