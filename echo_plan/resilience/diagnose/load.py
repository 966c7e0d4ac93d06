"""Reading a record set: files and folders given on the command line, in any of the three formats.

A ``.jsonl`` (or ``.json``) file is the plain JSONL format, a ``.csv`` file the plain CSV format,
anything else a torch flight-recorder pickle (which torch names ``nccl_trace_rank_<N>`` without a
suffix). A folder stands for every regular file inside it (not hidden ones, not sub-folders).
Every problem is a FileFormatError naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from echo_plan.errors import FileFormatError
from echo_plan.replay.no_gc import paused_gc
from echo_plan.resilience.diagnose.parallel_load import load_parallel, processes_for
from echo_plan.resilience.diagnose.read import cluster_node_of, read_files
from echo_plan.resilience.diagnose.records import RecordTable

__all__ = ["MAX_RECORD_FILES", "record_files", "load_records", "load_files", "cluster_node_of"]

MAX_RECORD_FILES = 1 << 17  # 131,072 ranks: well above any job whose dumps one machine would read


def record_files(paths: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if not str(p).strip():
            raise FileFormatError(repr(str(p)), "an empty path; give record files or folders")
        path = Path(p)
        if path.is_dir():
            try:
                inside = sorted(q for q in path.iterdir() if not q.name.startswith(".") and q.is_file())
            except OSError as exc:
                raise FileFormatError(str(path), f"cannot read the folder: {exc.strerror or exc}") from None
            if not inside:
                raise FileFormatError(str(path), "a folder without record files")
            out += inside
        else:
            out.append(path)
        if len(out) > MAX_RECORD_FILES:
            raise FileFormatError(str(path), f"more than {MAX_RECORD_FILES:,} record files")
    if not out:
        raise FileFormatError("RECORDS", "no record files given")
    return out


def load_records(paths: Iterable[str], gpus_per_node: int | None = None) -> RecordTable:
    """Every record of the files and folders in ``paths``. Where the records do not say which
    server a rank is on (flight-recorder dumps never do), rank // ``gpus_per_node``; unknown
    without it."""
    return load_files(record_files(paths), gpus_per_node)


def load_files(files: list[Path], gpus_per_node: int | None, processes: int | None = None) -> RecordTable:
    """``processes``: worker processes reading shares of the files (parallel_load.py); None: one per
    CPU (at most 4) for a set of 128 files or more, or ``$ECHO_PLAN_PROCESSES`` when set."""
    import os

    if processes is None:
        env = os.environ.get("ECHO_PLAN_PROCESSES", "")
        processes = int(env) if env.isdigit() and int(env) > 0 else processes_for(len(files))
    if processes > 1 and len(files) > 1:
        return load_parallel(files, gpus_per_node, min(processes, len(files)))
    node_of = cluster_node_of(gpus_per_node) if gpus_per_node else (lambda rank: -1)
    with paused_gc():  # millions of live numbers and no cycles: the collector would only rescan them
        return read_files(files, node_of)
