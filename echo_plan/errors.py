"""User-facing errors.

Every mistake a user can make (a bad value, an unknown preset, a malformed file) raises an
:class:`EchoPlanError`. The CLI turns it into one readable line and exit code 2, never a traceback.
"""

from __future__ import annotations

from typing import Any


class EchoPlanError(Exception):
    """Base class of every error caused by user input."""


class SpecError(EchoPlanError, ValueError):
    """A field has a value that cannot work; names the field, the value and what is valid."""

    def __init__(self, field: str, value: Any, valid: str, context: str = "", message: str | None = None) -> None:
        self.field = field
        self.value = value
        self.valid = valid
        where = f"{context}: " if context else ""
        super().__init__(message if message is not None else f"{where}{field}={value!r} is invalid: {valid}")


class UnknownPresetError(EchoPlanError, KeyError):
    """A preset name that does not exist; lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = sorted(known)
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {', '.join(self.known)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class FileFormatError(EchoPlanError):
    """A file that cannot be read as what it should be; says which file and, when known, the line."""

    def __init__(self, path: str, problem: str, line: int | None = None) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{path}, line {line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {problem}")
