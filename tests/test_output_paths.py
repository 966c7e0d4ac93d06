"""Output paths are checked before any work: which problem, for which option."""

from __future__ import annotations

import os

import pytest

from echo_plan.errors import SpecError
from echo_plan.output_paths import check_output_dir, check_output_file, check_output_prefix


def test_good_paths_pass_and_create_nothing(tmp_path):
    assert check_output_file(None, "--csv") is None
    new = tmp_path / "a" / "b" / "out.csv"
    assert check_output_file(str(new), "--csv", (".csv",)) == new
    existing = tmp_path / "old.CSV"
    existing.write_text("x")
    assert check_output_file(existing, "--csv", (".csv",)) == existing  # suffix case does not matter
    assert check_output_dir(tmp_path / "cache", "--cache-dir") == tmp_path / "cache"
    assert check_output_prefix(tmp_path / "run" / "trace", "-o").name == "trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.CSV"]  # the probe file is gone too


@pytest.mark.parametrize("make, says", [
    ("folder", "is a folder, which an output never replaces; give a file path ending in .html"),
    ("fifo", "is a FIFO, which an output never replaces"),
    ("empty", "an empty path"),
    ("suffix", "should end in .html or .htm"),
    ("file-as-folder", "is a regular file, not a folder"),
    ("proc", "cannot create files in /proc"),
])
def test_bad_output_files_name_the_option_and_the_problem(tmp_path, make, says):
    value = {"folder": str(tmp_path), "empty": "", "suffix": str(tmp_path / "r.txt"),
             "proc": "/proc/echo-plan-test/r.html"}.get(make)
    if make == "fifo":
        value = str(tmp_path / "r.html")
        os.mkfifo(value)
    elif make == "file-as-folder":
        (tmp_path / "f").write_text("x")
        value = str(tmp_path / "f" / "r.html")
    with pytest.raises(SpecError) as err:
        check_output_file(value, "--report", (".html", ".htm"))
    message = str(err.value)
    assert message.startswith(f"--report {value!r}: ") and says in message


def test_cache_dir_must_be_a_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="is a regular file, not a folder"):
        check_output_dir(tmp_path / "file", "--cache-dir")
    with pytest.raises(SpecError, match="cannot create files in /proc"):
        check_output_dir("/proc/echo-plan-cache", "--cache-dir")


def test_prefix_needs_a_name(tmp_path):
    with pytest.raises(SpecError, match="DIR/NAME"):
        check_output_prefix(str(tmp_path) + "/", "-o")


def test_cli_refuses_a_bad_report_path_before_searching(tmp_path, capsys):
    from echo_plan.cli import main

    code = main(["search", "--report", "/proc/echo-plan-test/r.html", "--storage", "memory", "--no-progress"])
    err = capsys.readouterr()
    assert code == 2 and err.err.strip().splitlines()[-1].startswith("error: --report")
    assert err.out == ""  # nothing was searched
