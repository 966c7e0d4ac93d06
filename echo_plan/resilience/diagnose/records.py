"""Per-rank collective records as columns: one row per rank per collective (or point-to-point op).

Every reader (flight-recorder pickles, JSONL, CSV) fills a :class:`TableBuilder`; the diagnosis
reads the finished :class:`RecordTable`, whose columns are numpy arrays so that a 1,024-rank dump
of a few thousand entries per rank is analysed in vectorised passes.

Times are seconds on each rank's own clock (flight-recorder nanoseconds are divided by 1e9).
``start_s``/``end_s`` are NaN where the library did not record them (torch's Gloo group leaves
them empty; NCCL fills them only with ``TORCH_NCCL_ENABLE_TIMING=1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class State(IntEnum):
    """Where a record's work stands when the records were written."""

    SCHEDULED = 0  # enqueued by the CPU; its kernel has not started (the rank has not entered it)
    STARTED = 1  # entered: its kernel runs, the collective has not finished
    COMPLETED = 2
    UNKNOWN = 3  # the library does not track it (torch Gloo records stay 'scheduled' forever)


STATE_NAMES = {"scheduled": State.SCHEDULED, "started": State.STARTED, "completed": State.COMPLETED,
               "unknown": State.UNKNOWN}


class ConnDir(IntEnum):
    SEND = 0
    RECV = 1


@dataclass(frozen=True)
class RecordTable:
    """All records of a record set, as columns (one row per rank per op)."""

    rank: np.ndarray  # int64, global rank
    node: np.ndarray  # int64, server index (-1 unknown)
    group: np.ndarray  # int64 index into group_names
    seq: np.ndarray  # int64 collective (or p2p) sequence number within its group
    p2p: np.ndarray  # bool
    op: np.ndarray  # int64 index into op_names
    nbytes: np.ndarray  # int64
    enqueue_s: np.ndarray  # float64
    start_s: np.ndarray  # float64 (NaN: not recorded)
    end_s: np.ndarray  # float64 (NaN: not recorded or not finished)
    state: np.ndarray  # int8 State
    group_names: tuple[str, ...]
    group_ranks: tuple[tuple[int, ...], ...]  # members of each group (global ranks)
    op_names: tuple[str, ...]
    # per-connection records (optional; JSONL/CSV only): which row, the peer, the direction, the
    # seconds the connection spent moving its data (not waiting for it), and the share it moved
    conn_row: np.ndarray
    conn_peer: np.ndarray
    conn_dir: np.ndarray
    conn_busy_s: np.ndarray
    conn_done: np.ndarray
    files: dict  # rank -> the file it came from
    ranks_present: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    @property
    def expected_ranks(self) -> tuple[int, ...]:
        """Every rank any group names, and every rank that wrote records."""
        out = set(self.ranks_present)
        for members in self.group_ranks:
            out.update(members)
        return tuple(sorted(out))

    @property
    def missing_ranks(self) -> tuple[int, ...]:
        present = set(self.ranks_present)
        return tuple(r for r in self.expected_ranks if r not in present)


DTYPES = {"rank": np.int64, "node": np.int64, "group": np.int64, "seq": np.int64, "p2p": bool, "op": np.int64,
          "nbytes": np.int64, "enqueue_s": np.float64, "start_s": np.float64, "end_s": np.float64, "state": np.int8}
CONN_DTYPES = {"row": np.int64, "peer": np.int64, "dir": np.int8, "busy_s": np.float64, "done": np.float64}


class TableBuilder:
    """Accumulates rows from the readers, row by row (``cols`` lists) or a file's rows at once
    (``add_chunk`` arrays); group names are interned with their members."""

    def __init__(self) -> None:
        self._chunks: dict[str, list[np.ndarray]] = {k: [] for k in DTYPES}
        self._flushed = 0
        self.cols: dict[str, list] = {k: [] for k in ("rank", "node", "group", "seq", "p2p", "op", "nbytes",
                                                      "enqueue_s", "start_s", "end_s", "state")}
        self.conn: dict[str, list] = {k: [] for k in ("row", "peer", "dir", "busy_s", "done")}
        self._groups: dict[tuple[str, tuple[int, ...]], int] = {}
        self.group_names: list[str] = []
        self.group_ranks: list[tuple[int, ...]] = []
        self._ops: dict[str, int] = {}
        self.op_names: list[str] = []
        self.files: dict[int, str] = {}

    def group_id(self, name: str, ranks: tuple[int, ...]) -> int:
        key = (name, ranks)
        gid = self._groups.get(key)
        if gid is None:
            gid = self._groups[key] = len(self.group_names)
            self.group_names.append(name)
            self.group_ranks.append(ranks)
        return gid

    def op_id(self, name: str) -> int:
        oid = self._ops.get(name)
        if oid is None:
            oid = self._ops[name] = len(self.op_names)
            self.op_names.append(name)
        return oid

    def add_file(self, rank: int, path: str) -> None:
        self.files[rank] = path

    @property
    def nrows(self) -> int:
        return self._flushed + len(self.cols["rank"])

    def flush(self) -> None:
        n = len(self.cols["rank"])
        if n:
            for name, dtype in DTYPES.items():
                self._chunks[name].append(np.asarray(self.cols[name], dtype=dtype))
                self.cols[name] = []
            self._flushed += n

    def add_chunk(self, **arrays: np.ndarray) -> None:
        """One file's rows at once: an array (or list) per column, all of the same length."""
        self.flush()
        n = len(arrays["rank"])
        for name, dtype in DTYPES.items():
            self._chunks[name].append(np.asarray(arrays[name], dtype=dtype))
        self._flushed += n

    def columns(self) -> dict[str, np.ndarray]:
        """Every row so far, one array per column (in the order added)."""
        self.flush()
        return {name: np.concatenate(ch) if ch else np.zeros(0, dtype=DTYPES[name]) for name, ch in self._chunks.items()}

    def build(self) -> RecordTable:
        c = self.columns()
        k = self.conn
        order = np.lexsort((c["enqueue_s"], c["rank"]))
        remap = np.empty_like(order)
        remap[order] = np.arange(order.size)

        def col(name: str, dtype) -> np.ndarray:
            return c[name].astype(dtype, copy=False)[order]

        rows = np.asarray(k["row"], dtype=np.int64)
        return RecordTable(
            rank=col("rank", np.int64), node=col("node", np.int64), group=col("group", np.int64),
            seq=col("seq", np.int64), p2p=col("p2p", bool), op=col("op", np.int64), nbytes=col("nbytes", np.int64),
            enqueue_s=col("enqueue_s", np.float64), start_s=col("start_s", np.float64),
            end_s=col("end_s", np.float64), state=col("state", np.int8),
            group_names=tuple(self.group_names), group_ranks=tuple(self.group_ranks), op_names=tuple(self.op_names),
            conn_row=remap[rows] if rows.size else rows, conn_peer=np.asarray(k["peer"], dtype=np.int64),
            conn_dir=np.asarray(k["dir"], dtype=np.int8), conn_busy_s=np.asarray(k["busy_s"], dtype=np.float64),
            conn_done=np.asarray(k["done"], dtype=np.float64), files=dict(self.files),
            ranks_present=tuple(sorted(self.files)))
