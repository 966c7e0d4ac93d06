"""Reading a large record set on several processes.

A 1,024-rank job writes 1,024 dumps of a few thousand entries each; unpickling them and pulling out
their columns is most of a diagnosis. The files are independent, so worker processes (a fork
server, as the search's pool: nothing of this process is copied mid-use) each read a share of them
into a table of their own, and this process merges the shares: group and op ids are renumbered into
one table, connection rows shifted by the rows before them, and the check that every rank's records
come from one file is made over all shares. The merged table is the one a single process builds (the
table is sorted by rank and time when built, so the order of the shares does not matter).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from echo_plan.errors import EchoPlanError, FileFormatError
from echo_plan.replay.no_gc import paused_gc
from echo_plan.resilience.diagnose.read import cluster_node_of, read_files
from echo_plan.resilience.diagnose.records import RecordTable, TableBuilder
from echo_plan.search.process_pool import MAX_AUTO_PROCESSES, usable_cpus
from echo_plan.search.process_pool import worker_context

MIN_FILES_PER_PROCESS = 64  # below this, starting a worker costs more than reading the files


@dataclass(frozen=True)
class Share:
    """What one worker read: its rows as arrays, its own group and op numbering, its connections."""

    arrays: dict[str, np.ndarray]
    group_names: list[str]
    group_ranks: list[tuple[int, ...]]
    op_names: list[str]
    conn: dict[str, list]
    files: dict[int, str]
    error: str = ""  # a FileFormatError's line: exceptions with their own arguments do not cross processes


def processes_for(n_files: int) -> int:
    return max(1, min(usable_cpus(), MAX_AUTO_PROCESSES, n_files // MIN_FILES_PER_PROCESS))


def read_share(files: list[str], gpus_per_node: int | None) -> Share:
    """One worker's files, read as a single process reads them (load.load_files)."""

    node_of = cluster_node_of(gpus_per_node) if gpus_per_node else (lambda rank: -1)
    try:
        with paused_gc():
            builder = read_files([Path(f) for f in files], node_of, build=False)
    except EchoPlanError as exc:
        return Share({}, [], [], [], {}, {}, error=str(exc))
    return Share(builder.columns(), builder.group_names, builder.group_ranks, builder.op_names, builder.conn, builder.files)


def load_parallel(files: list[Path], gpus_per_node: int | None, processes: int) -> RecordTable:
    """The table of ``files`` read by ``processes`` workers (contiguous shares, in file order)."""
    from concurrent.futures import ProcessPoolExecutor

    names = [str(f) for f in files]
    step = -(-len(names) // processes)
    shares_in = [names[i:i + step] for i in range(0, len(names), step)]
    with ProcessPoolExecutor(max_workers=len(shares_in), mp_context=worker_context()) as pool:
        shares = list(pool.map(read_share, shares_in, [gpus_per_node] * len(shares_in)))
    for share in shares:
        if share.error:
            raise EchoPlanError(share.error)
    return merge(shares)


def merge(shares: list[Share]) -> RecordTable:
    out = TableBuilder()
    owner: dict[int, str] = {}
    with paused_gc():
        for share in shares:
            for rank, path in share.files.items():
                if rank in owner and owner[rank] != path:
                    raise FileFormatError(path, f"rank {rank} also has records in {owner[rank]}; give each rank's "
                                                "records once")
                owner[rank] = path
                out.add_file(rank, path)
            if not share.arrays or not len(share.arrays["rank"]):
                continue
            gmap = np.asarray([out.group_id(n, r) for n, r in zip(share.group_names, share.group_ranks)], np.int64)
            omap = np.asarray([out.op_id(n) for n in share.op_names], np.int64)
            arrays: dict[str, Any] = dict(share.arrays)
            arrays["group"] = gmap[arrays["group"]]
            arrays["op"] = omap[arrays["op"]]
            offset = out.nrows
            out.add_chunk(**arrays)
            out.conn["row"].extend(r + offset for r in share.conn["row"])
            for key in ("peer", "dir", "busy_s", "done"):
                out.conn[key].extend(share.conn[key])
        return out.build()
