"""The ``echo-plan`` command: one typer app, a subcommand per job (see echo_plan/commands/)."""

from __future__ import annotations

import importlib
import sys

import typer

from echo_plan.errors import EchoPlanError

app = typer.Typer(
    name="echo-plan",
    help="Find the fastest LLM training plan that fits, by simulating it (Echo-style).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module has ``register(app)``; they import heavy libraries only inside their commands.
COMMAND_MODULES = [
    "echo_plan.commands.presets_cmd",
    "echo_plan.commands.trace_cmd",
    "echo_plan.commands.comm_cmd",
    "echo_plan.commands.simulate_cmd",
    "echo_plan.commands.search_cmd",
    "echo_plan.commands.report_cmd",
    "echo_plan.commands.calibrate_cmd",
    "echo_plan.commands.validate_cmd",
    "echo_plan.commands.interop_cmd",
    "echo_plan.commands.sparsify_cmd",
    "echo_plan.commands.whatif_cmd",
    "echo_plan.commands.diagnose_cmd",
]


def _register_all() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command is not built yet
                continue
            raise
        module.register(app)


@app.callback()
def _root() -> None:
    """Find the fastest LLM training plan that fits, by simulating it (Echo-style)."""


_register_all()


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
