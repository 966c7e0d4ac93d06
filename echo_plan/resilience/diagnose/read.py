"""Reading record files into a table in this process: what load.load_files does with one process and
what each worker of parallel_load.py does with its share of the files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from echo_plan.errors import FileFormatError
from echo_plan.files import read_bytes
from echo_plan.limits import MAX_GPUS
from echo_plan.resilience.diagnose import flight_recorder, plain
from echo_plan.resilience.diagnose.records import TableBuilder


def read_files(files: list[Path], node_of: Callable[[int], int], build: bool = True) -> Any:
    builder = TableBuilder()
    owner: dict[int, str] = {}
    for path in files:
        groups_before, conns_before = len(builder.group_ranks), len(builder.conn["peer"])
        data = read_bytes(path)
        where = str(path)
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json", ".csv"):
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise FileFormatError(where, "not UTF-8 text: not a JSONL/CSV record file") from None
            reader = plain.read_csv if suffix == ".csv" else plain.read_jsonl
            ranks = reader(text, where, builder, node_of)
            if not ranks:
                raise FileFormatError(where, "holds no records")
        else:
            if not data.startswith(b"\x80"):
                raise FileFormatError(where, "neither a flight-recorder pickle nor a .jsonl/.csv record file")
            ranks = {flight_recorder.read_dump(path, data, builder, node_of)}
        members = [m for g in builder.group_ranks[groups_before:] for m in g] + builder.conn["peer"][conns_before:]
        bad = [r for r in list(ranks) + members if not 0 <= r < MAX_GPUS]
        if bad:
            raise FileFormatError(where, f"rank {bad[0]} is outside 0 to {MAX_GPUS - 1:,} (ranks of one job)")
        for r in ranks:
            if r in owner and owner[r] != where:
                raise FileFormatError(where, f"rank {r} also has records in {owner[r]}; give each rank's records once")
            owner[r] = where
            builder.add_file(r, where)
    return builder.build() if build else builder


def cluster_node_of(gpus_per_node: int) -> Callable[[int], int]:
    return lambda rank: rank // gpus_per_node

