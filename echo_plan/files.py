"""Reading a user's file: one place that turns a missing or unreadable file into FileFormatError."""

from __future__ import annotations

from pathlib import Path

from echo_plan.errors import FileFormatError


def read_text(path: str | Path, *, errors: str = "strict") -> str:
    """The file's UTF-8 text; a missing, unreadable or undecodable file raises FileFormatError."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8", errors=errors)
    except FileNotFoundError:
        raise FileFormatError(str(p), "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FileFormatError(str(p), f"cannot read: {exc}") from None


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write a whole file or nothing: a temporary file in the same folder, then a rename (readable
    by others like any file, 0o644). Safe when several processes write the same path."""
    import os
    import tempfile

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target
