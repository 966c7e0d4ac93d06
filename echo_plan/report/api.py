"""The one call the CLI makes: fill in the recommended plan's timeline if needed, render, write."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from echo_plan.report.enrich import TimelineSimulator, compare_with_timeline, search_with_timeline, \
    timeline_simulator
from echo_plan.report.render import detail_row, write_report
from echo_plan.search.results import CompareOutcome, SearchOutcome
from echo_plan.errors import EchoPlanError
from echo_plan.report.sensitivity_view import sensitivity_rows, sensitivity_view
from echo_plan.report.load import save_settings


@dataclass(frozen=True, slots=True)
class WrittenReport:
    path: Path
    size_bytes: int
    timeline_note: str | None  # set when the timeline was simulated for the report, or is missing


def make_report(outcome: SearchOutcome | CompareOutcome, path: str | Path, *, fill_timeline: bool = True,
                simulator: TimelineSimulator | None = None, notes: Sequence[str] = (),
                fresh: bool = False, cache_dir: str | None = None, sensitivity: bool = True) -> WrittenReport:
    """Write the HTML report of ``outcome`` to ``path`` atomically.

    With ``fill_timeline`` the recommended plan is simulated once (``simulate(timeline=True)``) when
    its result carries no timeline; nothing else is simulated. ``fresh``: the outcome is from a
    search that just ran, so that simulation is expected and noted only if something went wrong.
    """
    note = None
    if fill_timeline:
        if isinstance(outcome, CompareOutcome):
            row = detail_row(outcome)
            if row is not None:
                outcome, note = compare_with_timeline(outcome, row.num_gpus, simulator, fresh)
        else:
            outcome, note = search_with_timeline(outcome, simulator, fresh)
    view = None
    if sensitivity and isinstance(outcome, SearchOutcome) and outcome.ranked:
        try:
            view = sensitivity_view(sensitivity_rows(outcome, cache_dir))
        except (EchoPlanError, ImportError) as exc:
            notes = (*notes, f"No fault sensitivity: simulating the top plans with faults failed ({exc}).")
    written = write_report(outcome, path, notes=notes, timeline_note=note, sensitivity=view)
    return WrittenReport(written, written.stat().st_size, note)


def report_from_cli(outcome: SearchOutcome | CompareOutcome, path: str | None, cache_dir: str | None = None,
                    quiet_stdout: bool = False) -> WrittenReport | None:
    """What search and compare do at the end: store the search's settings with its study (so that
    ``echo-plan report`` can re-render it fully later), and with ``--report FILE`` write the report
    and say where it is (on stderr when stdout carries JSON)."""
    import typer

    for note in save_settings(outcome):
        typer.echo(f"note: {note}", err=True)
    if path is None:
        return None

    written = make_report(outcome, path, simulator=timeline_simulator(cache_dir), fresh=True, cache_dir=cache_dir)
    if written.timeline_note:
        typer.echo(f"note: {written.timeline_note}", err=True)
    typer.echo(f"report written: {written.path} ({written.size_bytes / 1e6:.1f} MB)", err=quiet_stdout)
    return written
