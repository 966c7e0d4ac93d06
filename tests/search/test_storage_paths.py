"""--storage is checked before any work: SQLite never overwrites a file that is not its own."""

from __future__ import annotations

import os

import pytest

from echo_plan.cli import main
from echo_plan.errors import SpecError
from echo_plan.search.storage import check_storage, db_error, sqlite_file


def test_sqlite_file_of_a_url():
    assert sqlite_file("sqlite:////tmp/a.db") == "/tmp/a.db"
    assert sqlite_file("sqlite:///rel/a.db?timeout=5") == "rel/a.db"
    assert sqlite_file("sqlite:///:memory:") is None and sqlite_file("postgresql://h/db") is None


@pytest.mark.parametrize("make, says", [
    ("text", "is not an SQLite database; an existing file is never overwritten"),
    ("fifo", "is a FIFO"),
    ("folder", "is a folder"),
    ("empty-url", "a database URL"),
])
def test_unusable_storage_is_refused(tmp_path, make, says):
    target = tmp_path / "studies.db"
    if make == "text":
        target.write_text("my notes")
    elif make == "fifo":
        os.mkfifo(target)
    elif make == "folder":
        target.mkdir()
    url = "" if make == "empty-url" else f"sqlite:///{target}"
    with pytest.raises(SpecError) as err:
        check_storage(url)
    assert says in str(err.value)
    if make == "text":
        assert target.read_text() == "my notes"


def test_new_and_existing_databases_pass(tmp_path):
    check_storage(f"sqlite:///{tmp_path / 'new' / 'studies.db'}")
    check_storage("memory")
    check_storage(None)
    with pytest.raises(SpecError, match="no such database file"):
        check_storage(f"sqlite:///{tmp_path / 'missing.db'}", must_exist=True)


def test_search_into_a_new_folder_then_refuses_a_text_file(tmp_path, capsys):
    db = tmp_path / "deep" / "er" / "studies.db"
    base = ["search", "-m", "gpt-13b", "--gpus", "8", "--trials", "2", "--no-progress",
            "--cache-dir", str(tmp_path / "cache")]
    assert main([*base, "--storage", f"sqlite:///{db}"]) == 0
    assert db.read_bytes()[:16] == b"SQLite format 3\x00"
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    capsys.readouterr()
    assert main([*base, "--storage", f"sqlite:///{notes}"]) == 2
    assert "is not an SQLite database" in capsys.readouterr().err
    assert notes.read_text() == "keep me"


def test_database_errors_are_one_line():
    exc = RuntimeError("(sqlite3.OperationalError) unable to open\n[SQL: PRAGMA x]\n"
                       "(Background on this error at: https://sqlalche.me/e/21/e3q8)")
    assert db_error(exc) == "RuntimeError: (sqlite3.OperationalError) unable to open"


def test_the_code_that_computed_a_study_names_it(tmp_path):
    """A stored study is reused only by the code that computed it: editing a source or data file of the package
    (the tracer, a cost model, a calibration table) changes the version the study name is derived from."""
    from echo_plan.search.storage import model_code_version

    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "block.py").write_text("x = 1\n")
    (tmp_path / "compute.yaml").write_text("a: 1\n")
    first = model_code_version(tmp_path)
    assert model_code_version(tmp_path) == first  # deterministic
    (tmp_path / "compute.yaml").write_text("a: 2\n")
    second = model_code_version(tmp_path)
    (tmp_path / "trace" / "block.py").write_text("x = 2\n")
    assert len({first, second, model_code_version(tmp_path)}) == 3
    (tmp_path / "notes.txt").write_text("not code")
    assert model_code_version(tmp_path) == model_code_version(tmp_path)
    assert model_code_version() == model_code_version()  # the installed package
