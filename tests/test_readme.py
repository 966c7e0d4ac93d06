"""The README and the docs pages are true about the command line: every `echo-plan` command in their fenced code
blocks (and in their inline code) exists, answers --help, and takes every flag they give it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer

from echo_plan.cli import app, main

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))


def _fenced_lines(text: str) -> list[str]:
    """Shell lines of the README's fenced blocks, continuation lines joined, comments dropped."""
    lines: list[str] = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [ln.split(" #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return lines


def _inline_lines(text: str) -> list[str]:
    return [m for m in re.findall(r"`(echo-plan [^`]+)`", text)]


def _invocations(lines: list[str]) -> list[list[str]]:
    """The argument lists of every echo-plan call in the lines (after `&&`, `|`, `;` splits)."""
    calls = []
    for line in lines:
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                words = part.split()
            for i, w in enumerate(words):
                if w == "echo-plan" or w.endswith("/echo-plan"):
                    rest = words[i + 1:]
                    if not (rest and rest[0].isupper()):  # `echo-plan COMMAND --help` is a pattern, not a call
                        calls.append(rest)
                    break
    return calls


def _resolve(group, args: list[str]):
    """The command path the arguments name, and its command (typer vendors click: duck-typed)."""
    path, cmd = [], group
    for word in args:
        sub = cmd.get_command(None, word) if hasattr(cmd, "get_command") and not word.startswith("-") else None
        if sub is None:
            break
        path.append(word)
        cmd = sub
    return path, cmd


def _flags(cmd) -> set[str]:
    names = {"--help"}
    for p in cmd.params:
        names.update(p.opts)
        names.update(p.secondary_opts)
    return names


def _calls(path: Path) -> list[list[str]]:
    text = path.read_text(encoding="utf-8")
    return _invocations(_fenced_lines(text) + _inline_lines(text))


CALLS = _calls(README)
DOC_CALLS = [(p.name, c) for p in DOCS for c in _calls(p) if c and not c[0].startswith("-")]


def test_the_readme_has_commands_to_check():
    assert len(CALLS) >= 20
    assert ["search", "--report", "reports/quickstart.html"] in CALLS  # the main command


def _check_call(args: list[str], where: str = "README") -> None:
    root = typer.main.get_command(app)
    path, cmd = _resolve(root, args)
    assert path, f"{where}: echo-plan {args[0]}: no such command"
    assert not hasattr(cmd, "get_command"), f"{where}: echo-plan {' '.join(path)} needs a subcommand"
    known = _flags(cmd)
    rest = args[len(path):]
    rest = rest[:rest.index("--")] if "--" in rest else rest  # after --, arguments, not flags
    unknown = [w.split("=")[0] for w in rest if w.startswith("-") and w.split("=")[0] not in known
               and not re.fullmatch(r"-\d.*", w)]
    assert not unknown, f"{where}: echo-plan {' '.join(path)}: no flag {unknown} (has {sorted(known)})"


@pytest.mark.parametrize("args", CALLS, ids=[" ".join(c)[:60] for c in CALLS])
def test_every_readme_command_and_flag_exists(args):
    if not args or args[0].startswith("-"):
        pytest.skip("the bare program (--help or --version)")
    _check_call(args)


def test_every_docs_page_command_and_flag_exists():
    """The docs pages' commands too (one test: 70-odd calls over a dozen pages)."""
    assert len(DOC_CALLS) >= 50 and any(name == "deepseek-v3.md" for name, _ in DOC_CALLS)
    for name, args in DOC_CALLS:
        _check_call(args, f"docs/{name}")


def test_every_readme_command_answers_help(capsys):
    paths = sorted({tuple(_resolve(typer.main.get_command(app), c)[0]) for c in CALLS if c and c[0][0] != "-"})
    assert len(paths) >= 10
    for path in paths:
        assert main([*path, "--help"]) == 0, path
    capsys.readouterr()


def test_the_checker_catches_a_made_up_flag():
    root = typer.main.get_command(app)
    _, cmd = _resolve(root, ["search", "--no-such-flag"])
    assert "--no-such-flag" not in _flags(cmd) and "--report" in _flags(cmd)
    assert _resolve(root, ["whatif", "sensitivity"])[0] == ["whatif", "sensitivity"]


def _stated_figures(text: str) -> list[tuple[list[str], str, str | None]]:
    """(simulate arguments, step seconds, peak GiB or None, as written) of every fenced simulate call whose comment
    states what it prints: on its line ("# 5.6 s/step", "# 9.4 s/step, 45.8 GiB of 80") or on the comment lines
    right after it ("# step time 9.37 s ...", "# peak memory 45.8 GiB of 80 GiB")."""
    out = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, flags=re.S):
        lines = re.sub(r"\\\n\s*", " ", block).splitlines()
        for i, line in enumerate(lines):
            call, _, comment = line.partition(" #")
            if not call.strip().startswith("echo-plan simulate"):
                continue
            after = []
            for nxt in lines[i + 1:]:
                if not nxt.lstrip().startswith("#"):
                    break
                after.append(nxt)
            said = " ".join([comment] + after)
            step = re.search(r"(?:^|\s)([\d.]+) s/step|step time ([\d.]+) s", said)
            peak = re.search(r"([\d.]+) GiB of", said)
            if step:
                out.append((shlex.split(call)[1:], step.group(1) or step.group(2), peak and peak.group(1)))
    return out


STATED = [(name, *f) for name, path in [("README.md", README)] + [(p.name, p) for p in DOCS]
          for f in _stated_figures(path.read_text(encoding="utf-8"))]


def _as_written(value: float, written: str) -> str:
    return f"{value:.{len(written.partition('.')[2])}f}"


def test_the_readme_and_docs_state_figures_to_check():
    assert sum(name == "README.md" for name, *_ in STATED) >= 2 and any(gib for *_, gib in STATED)
    assert any(name == "fsdp.md" for name, *_ in STATED)


@pytest.mark.parametrize("name, args, step_s, peak_gib", STATED, ids=[f"{n}: {' '.join(a)[:50]}" for n, a, *_ in STATED])
def test_the_stated_figures_are_what_simulate_prints(name, args, step_s, peak_gib, capsys, tmp_path):
    """A figure the README or a docs page states beside a command is the one that command prints now, to the
    digits written."""
    assert main(args + ["--json", "--cache-dir", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert _as_written(result["step_time_s"], step_s) == step_s, name
    if peak_gib is not None:
        assert _as_written(result["memory_peak_gib"], peak_gib) == peak_gib, name
