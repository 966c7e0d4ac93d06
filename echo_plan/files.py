"""Reading and writing a user's files: the one place that applies the limits on input files (a
regular file, at most ``limits.MAX_FILE_BYTES``, nesting at most ``limits.MAX_NESTING`` deep,
integers of at most ~4,300 digits) and writes output files whole or not at all.

Every failure is a FileFormatError naming the file: never a traceback, a hang on a FIFO, or a
MemoryError on ``/dev/zero``.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from echo_plan.errors import FileFormatError
from echo_plan.limits import MAX_FILE_BYTES, MAX_NESTING, structure_problem


def file_kind(mode: int) -> str:
    """What a stat mode is, in words: 'a regular file', 'a folder', 'a FIFO', ..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def read_bytes(path: str | Path, *, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. A missing file, a folder, a device,
    a FIFO or a socket (which could block or never end) or a larger file raise FileFormatError."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileFormatError(str(p), "no such file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise FileFormatError(str(p), f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileFormatError(str(p), f"is {file_kind(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise FileFormatError(str(p), f"is {st.st_size:,} bytes; input files are at most {limit:,} bytes")
    try:
        with open(p, "rb") as fh:
            data = fh.read(limit + 1)
    except OSError as exc:
        raise FileFormatError(str(p), f"cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:  # grew while being read
        raise FileFormatError(str(p), f"is more than {limit:,} bytes; input files are at most {limit:,} bytes")
    return data


def read_text(path: str | Path, *, errors: str = "strict") -> str:
    """The UTF-8 text of a regular file (see read_bytes for the limits)."""
    data = read_bytes(path)
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise FileFormatError(str(path), f"cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def _value_problem(exc: Exception) -> str:
    if "integer string conversion" in str(exc):
        return "an integer of more than 4,300 digits (no spec value needs more than 20)"
    return str(exc)


def _check_structure(data: Any, where: str) -> Any:
    problem = structure_problem(data)
    if problem is not None:
        raise FileFormatError(where, problem)
    return data


def parse_json(text: str | bytes, where: str) -> Any:
    """JSON with the input limits: malformed text, nesting past MAX_NESTING and over-long integers
    raise FileFormatError (with the line where JSON says it)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileFormatError(where, f"malformed JSON: {exc.msg}", exc.lineno) from None
    except RecursionError:
        raise FileFormatError(where, f"nested more than {MAX_NESTING} levels deep") from None
    except (ValueError, UnicodeDecodeError) as exc:  # an integer of more than 4,300 digits; bad bytes
        raise FileFormatError(where, f"malformed JSON: {_value_problem(exc)}") from None
    return _check_structure(data, where)


def safe_load(text: str, packaged: bool = False) -> Any:
    """``yaml.safe_load``; for the package's own data files (``packaged``) with libyaml's C parser
    when PyYAML has it (about 10x faster on the presets a command reads at start-up). Never for
    user files: libyaml overflows the C stack on deeply nested input instead of raising."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader) if packaged else yaml.SafeLoader
    return yaml.load(text, Loader=loader)


def parse_yaml(text: str, where: str) -> Any:
    """YAML (safe subset) with the input limits, as parse_json; errors name the line."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise FileFormatError(where, f"malformed YAML: {exc.problem}", line) from None
    except yaml.YAMLError as exc:  # e.g. a reader error on a control character: one line
        raise FileFormatError(where, "malformed YAML: " + " ".join(str(exc).split())) from None
    except RecursionError:
        raise FileFormatError(where, f"nested more than {MAX_NESTING} levels deep") from None
    except ValueError as exc:  # an integer of more than 4,300 digits
        raise FileFormatError(where, f"malformed YAML: {_value_problem(exc)}") from None
    return _check_structure(data, where)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write a whole file or nothing: a temporary file in the same folder, then a rename (readable
    by others like any file, 0o644). Safe when several processes write the same path.

    The target must be a regular file or a new path: a folder, device, FIFO or socket is never
    replaced (FileFormatError); a symbolic link is followed and its target written. Any failure
    removes the temporary file and raises FileFormatError naming the path.
    """
    import tempfile

    target = Path(path)
    if not str(path).strip():
        raise FileFormatError(repr(str(path)), "an empty output path")
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    refuse_special(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    except (OSError, ValueError) as exc:
        raise FileFormatError(str(target), f"cannot write: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        refuse_special(target)  # checked again just before the rename
        os.replace(tmp, target)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise FileFormatError(str(target), f"cannot write: {exc.strerror or exc}") from None
        raise
    return target


def non_regular(path: str | Path) -> str | None:
    """What ``path`` is, in words, when it exists and is not a regular file (a folder, device, FIFO,
    socket); None for a regular file or a path that does not exist (or cannot be looked at)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)


def refuse_special(target: Path) -> None:
    """FileFormatError when ``target`` exists and is not a regular file (a folder, device, FIFO, socket)."""
    kind = non_regular(target)
    if kind is not None:
        raise FileFormatError(str(target), f"is {kind}; an output must be a regular file or a new path, and is "
                                           "never replaced")
