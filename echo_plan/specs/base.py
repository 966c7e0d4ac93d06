"""Shared base for the frozen pydantic specs and the conversion of pydantic errors to SpecError."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from echo_plan.errors import SpecError

T = TypeVar("T", bound="Spec")


class Spec(BaseModel):
    """A frozen spec: unknown fields are rejected, values are validated on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False, allow_inf_nan=False)

    @classmethod
    def build(cls: type[T], data: dict[str, Any], context: str = "") -> T:
        """Validate ``data`` into this spec, raising :class:`SpecError` that names the field."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise spec_error_from(exc, context or cls.__name__) from None

    def replace(self: T, **changes: Any) -> T:
        """A validated copy with some fields changed (model_copy would skip validation)."""
        data = self.model_dump()
        data.update(changes)
        return type(self).build(data)


def spec_error_from(exc: ValidationError, context: str) -> SpecError:
    """The first error of a pydantic ValidationError as a SpecError naming field, value and rule."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or "(spec)"
    value = err.get("input")
    msg = err.get("msg", "invalid")
    if not err.get("loc"):  # a rule about the whole spec: its message names what is wrong, not the input
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        return SpecError(field, None, msg, context, message=f"{context}: {msg}" if context else msg)
    if err.get("type") == "extra_forbidden":
        allowed = ", ".join(_field_names(exc.title))
        msg = f"unknown field; valid fields are: {allowed}" if allowed else "unknown field"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return SpecError(field, value, msg, context)


def _field_names(title: str) -> list[str]:
    for cls in _all_specs():
        if cls.__name__ == title:
            return sorted(cls.model_fields)
    return []


def _all_specs() -> list[type[Spec]]:
    out: list[type[Spec]] = []
    stack = list(Spec.__subclasses__())
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(c.__subclasses__())
    return out
