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
