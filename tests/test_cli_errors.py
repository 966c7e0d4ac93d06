"""The CLI turns every user mistake into one line on stderr and exit code 2, never a traceback."""

import subprocess
import sys

from echo_plan.cli import main
from echo_plan.specs import parse_size
import pytest


def test_unknown_command_exits_2(capsys):
    assert main(["no-such-command"]) == 2


def test_presets_lists_models_and_clusters(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "gpt3-175b" in out and "h800" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
    assert "host 2048 GiB" in lines["dgx-h100"] and "host issue time" in lines["dgx-h100"]
    assert "host " not in lines["h100-gt"]  # no CPU figures: --offload-optimizer is refused there


def test_help_is_fast_and_lazy():
    code = ("import sys, echo_plan.cli; "
            "heavy = [m for m in ('torch', 'optuna', 'ray', 'plotly') if m in sys.modules]; "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing the CLI pulled in heavy modules: {out}"


@pytest.mark.parametrize("text,value", [("1048576", 1048576), ("64MB", 64_000_000), ("1GiB", 2**30),
                                        ("512KiB", 512 * 1024), ("1.5 GB", 1_500_000_000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["lots", "12XB", "-5MB"])
def test_parse_size_errors(text):
    from echo_plan.errors import EchoPlanError

    with pytest.raises(EchoPlanError):
        parse_size(text)
