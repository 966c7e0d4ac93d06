"""Checking where a command will write, before it does any work.

A command calls these on its output options first thing, so that ``--report /proc/x.html`` or
``--csv /dev/null`` fail in a second with one line, not after an hour's search, and so that a
folder, device, FIFO or socket is never replaced (``files.write_atomic`` checks again when it
writes). Whether a folder is writable is found by creating and removing a temporary file in it:
permission bits do not tell (root, read-only mounts, ``/proc``).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Sequence

from echo_plan.errors import SpecError
from echo_plan.files import file_kind, non_regular


def _fail(option: str, value: str, problem: str) -> SpecError:
    return SpecError(option, value, problem, message=f"{option} {value!r}: {problem}")


def _writable_folder(option: str, value: str, folder: Path) -> None:
    """``folder`` exists and files can be created in it, or it can be made inside such a folder."""
    existing = folder
    while not existing.exists():
        if existing.is_symlink():  # a dangling link
            raise _fail(option, value, f"{existing} is a broken symbolic link")
        if existing.parent == existing:
            break
        existing = existing.parent
    try:
        st = os.stat(existing)
    except (OSError, ValueError) as exc:
        raise _fail(option, value, f"cannot use folder {existing}: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise _fail(option, value, f"{existing} is {file_kind(st.st_mode)}, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".echo-plan-probe.", dir=str(existing))
    except OSError as exc:
        raise _fail(option, value, f"cannot create files in {existing} ({exc.strerror or exc}); "
                                   "give a path in a writable folder") from None
    os.close(fd)
    os.unlink(probe)


def _resolve(option: str, value: str) -> Path:
    if not value.strip():
        raise _fail(option, value, "an empty path; give a file path")
    if "\x00" in value:
        raise _fail(option, value, "a path cannot contain a NUL byte")
    p = Path(value).expanduser()
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def check_output_file(path: str | Path | None, option: str, suffixes: Sequence[str] = ()) -> Path | None:
    """The path ``option`` will write, checked: not empty, the right suffix (case-insensitive),
    a regular file or a new path, in a folder where files can be created. None stays None."""
    if path is None:
        return None
    value = str(path)
    p = _resolve(option, value)
    want = " or ".join(suffixes)
    kind = non_regular(p)
    if kind is not None:
        hint = f"; give a file path ending in {want}" if want else "; give a regular file or a new path"
        raise _fail(option, value, f"is {kind}, which an output never replaces{hint}")
    if suffixes and p.suffix.lower() not in tuple(s.lower() for s in suffixes):
        raise _fail(option, value, f"the file name should end in {want}")
    _writable_folder(option, value, p.parent)
    return p


def check_output_dir(path: str | Path | None, option: str) -> Path | None:
    """A folder ``option`` will write files into: an existing folder or a new path, where files
    can be created. None stays None."""
    if path is None:
        return None
    value = str(path)
    p = _resolve(option, value)
    try:
        st = os.stat(p)
    except (OSError, ValueError):
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise _fail(option, value, f"is {file_kind(st.st_mode)}, not a folder")
    _writable_folder(option, value, p)
    return p


def check_output_prefix(prefix: str | Path, option: str) -> Path:
    """``DIR/NAME`` for several files ``DIR/NAME.<suffix>``: NAME not empty, DIR a folder where
    files can be created."""
    value = str(prefix)
    p = _resolve(option, value)
    if not p.name or value.endswith(("/", os.sep)):
        raise _fail(option, value, "give DIR/NAME: a folder and a file-name prefix")
    _writable_folder(option, value, p.parent)
    return p
