"""A progress bar on stderr for a running search: trials done, best so far, pruned counts."""

from __future__ import annotations

from typing import Protocol


class ProgressSink(Protocol):
    def update(self, simulated: int, budget: int, trials: int, pruned: int, best: str) -> None:
        """Called after each finished trial."""
        ...

    def close(self) -> None:
        ...


class RichProgress:
    """A rich progress bar on stderr (the command shows it when stderr is a TTY or with --progress)."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"), console=Console(stderr=True), transient=False,
        )
        self._task = self._progress.add_task(label, total=None, status="")
        self._progress.start()

    def update(self, simulated: int, budget: int, trials: int, pruned: int, best: str) -> None:
        status = f"trials {trials}, pruned {pruned}, best {best or '-'}"
        self._progress.update(self._task, completed=simulated, total=budget, status=status)

    def close(self) -> None:
        self._progress.stop()
