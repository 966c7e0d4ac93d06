"""Every command that takes a plan takes the same plan flags (or refuses one with one line), and one
builder turns them into the plan."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from echo_plan.cli import app, main
from echo_plan.commands.plan_flags import DEFAULTS, FIELDS, FLAG_NAMES, PLAN_OPTIONS, PlanFlags, build_plan
from echo_plan.errors import SpecError

PLAN_COMMANDS = (["simulate"], ["sparsify"], ["whatif", "sensitivity"], ["export", "chakra"])


def command(path):
    cmd = typer.main.get_command(app)
    for word in path:
        cmd = cmd.get_command(None, word)
    return cmd


def test_the_flags_and_their_record_list_the_same_fields():
    assert FIELDS == tuple(f.name for f in dataclasses.fields(PlanFlags))


@pytest.mark.parametrize("path", PLAN_COMMANDS, ids=" ".join)
def test_every_plan_command_takes_every_plan_flag(path):
    opts = {o for p in command(path).params for o in (*p.opts, *p.secondary_opts)}
    for _, _, opt in PLAN_OPTIONS:
        names = {n for decl in opt.param_decls for n in decl.split("/")}  # "--a/--no-a": both
        assert names <= opts, (path, opt.param_decls)


def flags(**changes):
    return PlanFlags(**{**DEFAULTS, **changes})


def test_build_plan_defaults_and_one_global_batch_rule():
    got = build_plan(flags(tp=4, pp=2, gpus=16, vpp=2))
    assert (got.plan.tp, got.plan.pp, got.plan.dp, got.plan.virtual_stages) == (4, 2, 2, 2)
    assert got.plan.schedule.value == "interleaved"  # vpp above 1 implies it
    assert got.plan.global_batch_size == got.plan.micro_batch_size * got.plan.dp  # the default: mbs x dp
    with pytest.raises(SpecError, match="global_batch_size"):  # 0 is a bad value, not "no value"
        build_plan(flags(tp=4, pp=2, gpus=16, gbs=0))


def test_a_refused_flag_is_one_line_naming_it_and_a_default_one_is_not_refused():
    refuse = {"density": "not here"}
    assert build_plan(flags(gpus=8), refuse=refuse).plan.dp == 8
    with pytest.raises(SpecError, match="--density=0.1 is invalid: not here"):
        build_plan(flags(gpus=8, density=0.1), refuse=refuse)
    assert FLAG_NAMES["sequence_parallel"] == "--sequence-parallel"


@pytest.mark.parametrize("argv,flag", [
    (["sparsify", "--dp-comm", "topk"], "--dp-comm"),
    (["sparsify", "--density", "0.01"], "--density"),
    (["export", "chakra", "-o", "OUT/x", "--dp-comm", "exdyna", "--density", "0.01"], "--dp-comm"),
])
def test_commands_refuse_what_they_cannot_use_in_one_line(argv, flag, tmp_path, capsys):
    argv = [str(tmp_path / a) if a.startswith("OUT/") else a for a in argv]
    assert main([*argv, "--gpus", "8", "--cache-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and flag in err and "\n" not in err


def test_a_plan_flag_reaches_the_plan_in_every_command(tmp_path, capsys):
    """--schedule gpipe and --recompute full, given to each command, are the plan each one runs."""
    import json

    base = ["--model", "llama2-7b", "--gpus", "8", "--tp", "2", "--pp", "2", "--schedule", "gpipe",
            "--recompute", "full", "--gbs", "16", "--cache-dir", str(tmp_path / "c"), "--json"]
    assert main(["simulate", *base]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert (plan["schedule"], plan["recompute"], plan["global_batch_size"]) == ("gpipe", "full", 16)
    assert main(["whatif", "sensitivity", *base]) == 0
    assert json.loads(capsys.readouterr().out)["plan"] == plan
