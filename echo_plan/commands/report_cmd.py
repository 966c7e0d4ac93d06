"""``echo-plan report``: the HTML recommendation report from a saved result or a stored study."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from echo_plan.commands.common import CacheDirOpt
from echo_plan.report.api import make_report
from echo_plan.report.enrich import timeline_simulator
from echo_plan.report.load import load_source
from echo_plan.output_paths import check_output_file


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        source: Optional[str] = typer.Argument(
            None, help="a saved result (`search --json` / `compare --json` output, .json) or a study database (.db)"),
        output: Path = typer.Option(..., "--report", "--output", "-o",
                                   help="the HTML file to write (atomically); --report as in search, compare, sparsify and whatif (-o, --output: the older names)"),
        storage: Optional[str] = typer.Option(
            None, "--storage", help="Optuna storage URL of the study (default: where `echo-plan search` keeps them)"),
        study_name: Optional[str] = typer.Option(None, "--study-name", help="the study in that storage"),
        no_simulate: bool = typer.Option(
            False, "--no-simulate", help="never simulate; without a stored timeline the report has none"),
        cache_dir: Optional[str] = CacheDirOpt,
    ) -> None:
        """Write the HTML report from a saved result or a study, without re-running the search.

        Nothing is simulated, except the recommended plan once when its stored result has no timeline (the report says so; --no-simulate skips it).
        """
        check_output_file(output, "--report", (".html", ".htm"))
        outcome = load_source(source, storage, study_name)
        written = make_report(outcome, output, fill_timeline=not no_simulate, simulator=timeline_simulator(cache_dir))
        if written.timeline_note:
            typer.echo(f"note: {written.timeline_note}", err=True)
        typer.echo(f"report written: {written.path} ({written.size_bytes / 1e6:.1f} MB)")
