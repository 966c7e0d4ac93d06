"""The entry point: every command listed, and a command imports only its own module."""

from __future__ import annotations

import subprocess
import sys

import typer

from echo_plan.cli import COMMANDS, app, command_module


def test_every_listed_command_has_a_module_that_registers_it():
    root = typer.main.get_command(app)
    for name in COMMANDS:
        assert command_module(name) is not None
        assert root.get_command(None, name) is not None, name
    assert command_module("nope") is None and root.get_command(None, "nope") is None


def test_a_command_imports_only_its_own_module():
    code = ("import sys; from echo_plan.cli import main; rc = main(['presets']); "
            "print(sorted(m for m in sys.modules if m.startswith('echo_plan.commands.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out.strip().splitlines()[-1])  # the printed list
    assert loaded == ["echo_plan.commands.common", "echo_plan.commands.presets_cmd"]


def test_the_listed_help_is_each_commands_own():
    from echo_plan.cli import COMMAND_HELP

    root = typer.main.get_command(app)
    for name, line in COMMAND_HELP.items():
        assert root.get_command(None, name).get_short_help_str(limit=300) == line, name


def test_the_root_help_imports_no_command():
    code = ("import sys; from echo_plan.cli import main; rc = main(['--help']); "
            "print(sorted(m for m in sys.modules if m.startswith('echo_plan.commands.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
