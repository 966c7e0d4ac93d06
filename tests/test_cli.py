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
