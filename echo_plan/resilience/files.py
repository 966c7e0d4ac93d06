"""Faults from the command line (``--fault``, repeatable) and from a YAML fault file (``--fault-file``)."""

from __future__ import annotations

from typing import Iterable

from echo_plan.errors import FileFormatError
from echo_plan.specs.faults import MAX_FAULTS, Fault, fault_from_mapping, parse_fault
from echo_plan.files import parse_yaml, read_text


def read_faults(texts: Iterable[str], path: str | None = None) -> tuple[Fault, ...]:
    """The --fault specs, then the file's (a YAML list, or a mapping with a ``faults`` list)."""
    faults = [parse_fault(t) for t in texts]
    if path:
        data = parse_yaml(read_text(path), path)
        items = data.get("faults") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise FileFormatError(path, "a fault file is a list of faults (or a mapping with a 'faults' list), "
                                        "each with kind and its keys, e.g. - {kind: straggler, rank: 3, compute: 1.2}")
        if len(items) > MAX_FAULTS:
            raise FileFormatError(path, f"{len(items):,} faults; at most {MAX_FAULTS:,}")
        faults += [fault_from_mapping(item, f"{path}, fault {i + 1}") for i, item in enumerate(items)]
    return tuple(faults)
