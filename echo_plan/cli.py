"""The ``echo-plan`` command: one typer app, a subcommand per job (see echo_plan/commands/)."""

from __future__ import annotations

import sys

import typer
from typer.core import TyperCommand, TyperGroup

from echo_plan.errors import EchoPlanError

# Every command, in the order `echo-plan --help` lists them, with its one-line help: the list is shown
# without importing any command's module (tests/test_cli.py holds each line equal to the command's own).
COMMAND_HELP: dict[str, str] = {
    "presets": "List the model, cluster and software-stack presets.",
    "trace": "Trace the model's transformer layer, embedding and output stage (or one of them) for one micro-batch.",
    "comm": "Time, algorithm, protocol, algbw and busbw (nccl-tests sense) of one collective.",
    "simulate": "Predict the training step of one plan: time, throughput, MFU, memory per stage, breakdown.",
    "search": "Find the fastest plans that fit: prune the space, simulate candidates (Optuna), rank them.",
    "compare": "Search each cluster size: best plan, throughput, scaling efficiency, time and GPU-hours to train.",
    "report": "Write the HTML report from a saved result or a study, without re-running the search.",
    "calibrate": "Fit the cost models to measurements (step times, nccl-tests logs, kernel timings, interference).",
    "validate": "Run every validation suite (or --suite ones): one summary line per suite, then each row.",
    "export": "Write echo-plan's workloads and plans in other tools' formats (Chakra ET, launch configs).",
    "import": "Read other tools' workloads (Chakra ET) and running jobs' launch configs.",
    "sparsify": "Break-even density of each sparse data-parallel exchange against the dense reduction, for one plan.",
    "whatif": "What-ifs on one plan: faults and stragglers.",
    "diagnose": "Healthy, or which syndrome (communication or non-communication hang or slowdown), the suspect "
                "rank/server and component (gpu, nic, nvlink, link), the evidence and a confidence.",
}
COMMANDS: tuple[str, ...] = tuple(COMMAND_HELP)


def command_module(name: str):
    """The module that registers command ``name`` (``register(app)``). Imported here, only when that
    command is looked up (run, or its help shown): a command does not pay for importing the others."""
    match name:
        case "presets":
            from echo_plan.commands import presets_cmd as module  # deferred: a command imports only its own module
        case "trace":
            from echo_plan.commands import trace_cmd as module  # deferred: a command imports only its own module
        case "comm":
            from echo_plan.commands import comm_cmd as module  # deferred: a command imports only its own module
        case "simulate":
            from echo_plan.commands import simulate_cmd as module  # deferred: a command imports only its own module
        case "search" | "compare":
            from echo_plan.commands import search_cmd as module  # deferred: a command imports only its own module
        case "report":
            from echo_plan.commands import report_cmd as module  # deferred: a command imports only its own module
        case "calibrate":
            from echo_plan.commands import calibrate_cmd as module  # deferred: a command imports only its own module
        case "validate":
            from echo_plan.commands import validate_cmd as module  # deferred: a command imports only its own module
        case "export" | "import":
            from echo_plan.commands import interop_cmd as module  # deferred: a command imports only its own module
        case "sparsify":
            from echo_plan.commands import sparsify_cmd as module  # deferred: a command imports only its own module
        case "whatif":
            from echo_plan.commands import whatif_cmd as module  # deferred: a command imports only its own module
        case "diagnose":
            from echo_plan.commands import diagnose_cmd as module  # deferred: a command imports only its own module
        case _:
            return None
    return module


class LazyCommands(TyperGroup):
    """The root group: lists :data:`COMMANDS` and builds a command from its module when it is looked up to
    run (or for its own help); the root's help lists them from :data:`COMMAND_HELP` alone."""

    _listing = False  # set while the root's help is written

    def list_commands(self, ctx) -> list[str]:  # noqa: ANN001
        return list(COMMANDS)

    def format_help(self, ctx, formatter) -> None:  # noqa: ANN001
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def get_command(self, ctx, name: str):  # noqa: ANN001
        if self._listing and name in COMMAND_HELP:  # a row of the root's help: no module imported for it
            return TyperCommand(name, help=COMMAND_HELP[name])
        module = command_module(name)
        if module is None:
            return None
        sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        module.register(sub)
        return typer.main.get_group(sub).commands.get(name)


app = typer.Typer(
    name="echo-plan",
    help="Find the fastest LLM training plan that fits, by simulating it (Echo-style).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=LazyCommands,
)


@app.callback()
def _root() -> None:
    """Find the fastest LLM training plan that fits, by simulating it (Echo-style)."""


def _plain_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """Warnings reach the user as one plain line, without Python's source path and code line."""
    typer.echo(f"warning: {message}", err=True)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user mistakes print one line on stderr and exit with code 2."""
    import warnings

    with warnings.catch_warnings():
        warnings.showwarning = _plain_warning
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    try:
        rv = app(args=argv, standalone_mode=False)
    except EchoPlanError as exc:
        typer.echo(f"error: {exc}", err=True)
        return 2
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return 130
    except SystemExit as exc:  # typer/click exits (--help, usage errors)
        return int(exc.code or 0)
    except Exception as exc:
        # Usage errors and exits from the click layer under typer (vendored in recent typer, so
        # recognised by shape rather than by import).
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            return int(exc.exit_code)
        if type(exc).__name__ == "Exit" and hasattr(exc, "exit_code"):
            return int(exc.exit_code)
        raise
    # In non-standalone mode click hands back typer.Exit's code instead of raising it.
    return rv if isinstance(rv, int) else 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
