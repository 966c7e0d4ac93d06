"""Reading users' files with limits and writing outputs whole, never over a special file."""

from __future__ import annotations

import os
import socket

import pytest

from echo_plan.errors import FileFormatError
from echo_plan.files import parse_json, parse_yaml, read_bytes, read_text, write_atomic


def test_special_files_are_refused_before_reading(tmp_path):
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)  # opening it would block forever
    with pytest.raises(FileFormatError, match="is a FIFO, not a regular file"):
        read_text(fifo)
    with pytest.raises(FileFormatError, match="is a folder"):
        read_text(tmp_path)
    with pytest.raises(FileFormatError, match="is a character device"):
        read_bytes("/dev/zero")  # would never end
    with pytest.raises(FileFormatError, match="no such file"):
        read_text(tmp_path / "missing.yaml")


def test_files_over_the_size_limit_are_refused(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_bytes(b"a" * 2000)
    assert len(read_bytes(p, limit=2000)) == 2000
    with pytest.raises(FileFormatError, match="2,000 bytes; input files are at most 1,000 bytes"):
        read_bytes(p, limit=1000)


@pytest.mark.parametrize("parse, text, says", [
    (parse_json, '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested more than 64"),
    (parse_yaml, "a: " + "[" * 50_000 + "]" * 50_000, "nested more than 64"),
    (parse_json, '{"a": ' + "[" * 70 + "]" * 70 + "}", "nested more than 64"),  # deep, but not for Python
    (parse_json, '{"n": ' + "9" * 5000 + "}", "more than 4,300 digits"),
    (parse_yaml, "n: " + "9" * 5000, "more than 4,300 digits"),
    (parse_yaml, "a: &x [*x]\n", "nested more than 64"),  # refers to itself
    (parse_yaml, "\x00", "malformed YAML"),
])
def test_parsers_turn_every_limit_into_one_line(parse, text, says):
    with pytest.raises(FileFormatError) as err:
        parse(text, "spec.yaml")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_alias_bombs_are_counted_as_used():
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]  # 10^8 values
    with pytest.raises(FileFormatError, match="holds more than"):
        parse_yaml("\n".join(levels), "bomb.yaml")


@pytest.mark.parametrize("make", ["fifo", "folder", "socket", "device"])
def test_write_atomic_never_replaces_a_special_file(tmp_path, make):
    target = tmp_path / "out.json"
    if make == "fifo":
        os.mkfifo(target)
    elif make == "folder":
        target.mkdir()
    elif make == "socket":
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(target))
    else:
        if os.geteuid() != 0:
            pytest.skip("making a device file needs root")
        os.mknod(target, 0o600 | 0o020000, os.makedev(1, 3))  # a private /dev/null
    before = os.lstat(target)
    with pytest.raises(FileFormatError, match="is never replaced"):
        write_atomic(target, "{}")
    after = os.lstat(target)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_write_atomic_follows_a_link_and_replaces_a_regular_file(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new"
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo.json").symlink_to(tmp_path / "fifo")
    with pytest.raises(FileFormatError, match="FIFO"):
        write_atomic(tmp_path / "to-fifo.json", "x")


def test_write_atomic_cleans_up_when_the_write_fails(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(FileFormatError, match="cannot write: No space left on device"):
        write_atomic(tmp_path / "out.json", "x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_write_atomic_refuses_an_empty_path():
    with pytest.raises(FileFormatError, match="empty output path"):
        write_atomic("", "x")
