"""``echo-plan calibrate``: a sub-app whose subcommands fit the cost models to measurements.

Each subcommand lives in its own module with a ``register_<name>(calibrate_app)`` function; add a
line to ``SUBCOMMANDS`` to add one. The modules import heavy libraries only inside their commands.
"""

from __future__ import annotations

import importlib

import typer

# (module, registration function)
SUBCOMMANDS: list[tuple[str, str]] = [
    ("echo_plan.commands.calibrate_nccl", "register_nccl"),
    ("echo_plan.commands.calibrate_steps", "register_steps"),
    ("echo_plan.commands.calibrate_kernels", "register_kernels"),
    ("echo_plan.commands.calibrate_interference", "register_interference"),
]


def build_calibrate_app() -> typer.Typer:
    calibrate_app = typer.Typer(
        name="calibrate", no_args_is_help=True,
        help="Fit the cost models to measurements (step times, nccl-tests logs, kernel timings, interference).",
    )
    for module_name, func in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # that subcommand is not built yet
                continue
            raise
        getattr(module, func)(calibrate_app)
    return calibrate_app


def register(app: typer.Typer) -> None:
    app.add_typer(build_calibrate_app(), name="calibrate")
