"""PyTorch's flight recorder dumps: one pickle per rank, read and written.

The format, as torch 2.x defines it (``torch/csrc/distributed/c10d/FlightRecorder.hpp``, whose
keys this module uses, and ``torch/distributed/flight_recorder/components/``, the reader torch
ships): a dict with ``version`` (e.g. "2.10"), ``pg_config`` (process-group name -> {name, desc,
ranks: "[0, 1, ...]"}), optionally ``pg_status`` and ``comm_lib_version``, and ``entries``: the
last ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (``TORCH_FR_BUFFER_SIZE``, default 2,000) operations the
rank issued, oldest first, each with ``record_id``, ``pg_id``, ``process_group`` (name, desc),
``collective_seq_id``, ``p2p_seq_id``, ``op_id``, ``is_p2p``, ``profiling_name``
("nccl:all_reduce", "nccl:send 0->1", "gloo:all_reduce"), ``input_sizes``/``output_sizes`` and
their dtypes, ``time_created_ns`` (enqueue), ``state`` (scheduled | started | completed),
``time_discovered_started_ns``/``time_discovered_completed_ns`` (when the watchdog saw the kernel
start/finish) and ``duration_ms`` (GPU time between the kernel's CUDA events, with
``TORCH_NCCL_ENABLE_TIMING=1``), ``timeout_ms``, ``retired`` and ``frames``. The dump does not
name its rank: torch's writer puts it at the end of the file name (``nccl_trace_rank_<N>``), and
torch's reader takes it from there, as this one does.

Pickles are read with an unpickler that builds only plain data (dict, list, tuple, str, numbers):
a pickle that names any class or function is refused as foreign, so a dump cannot run code.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path

from echo_plan.errors import FileFormatError
from echo_plan.resilience.diagnose.records import STATE_NAMES, State, TableBuilder

DUMP_VERSION = "2.10"  # torch 2.10-2.13 writes this version (FlightRecorder.hpp)
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Int": 4, "Long": 8, "Short": 2, "Byte": 1,
               "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "ComplexFloat": 8}
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.pkl|\.pickle)?$")
_P2P = re.compile(r"^(send|recv) (\d+)(->|<-)(\d+)$")


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D401
        raise pickle.UnpicklingError(f"names {module}.{name}, not plain data")


def rank_from_name(path: Path) -> int | None:
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None


def load_dump(data: bytes, path: str) -> dict:
    try:
        dump = _DataOnly(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, RecursionError, OverflowError, UnicodeDecodeError) as exc:
        problem = "truncated" if isinstance(exc, EOFError) else " ".join(str(exc).split())[:120]
        raise FileFormatError(path, f"not a flight-recorder dump (a pickle that is {problem})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list) or "pg_config" not in dump:
        raise FileFormatError(path, "a pickle without 'entries' and 'pg_config': not a torch flight-recorder dump")
    return dump


def _ranks_of(cfg: object, path: str, name: str) -> tuple[int, ...]:
    text = cfg.get("ranks") if isinstance(cfg, dict) else None
    if isinstance(text, (list, tuple)):
        items = list(text)
    elif isinstance(text, str) and re.fullmatch(r"\[\s*(\d+\s*(,\s*\d+\s*)*)?\]", text):
        items = [int(x) for x in re.findall(r"\d+", text)]
    else:
        raise FileFormatError(path, f"pg_config[{name!r}].ranks is {text!r}; expected a list of ranks like '[0, 1]'")
    return tuple(int(x) for x in items)


def _nbytes(entry: dict) -> int:
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or (), entry.get("input_dtypes") or ()):
        total += math.prod(int(x) for x in shape) * DTYPE_BYTES.get(str(dtype), 4)
    return total


def read_dump(path: Path, data: bytes, builder: TableBuilder, node_of, default_rank: int | None = None) -> int:
    """Add one rank's dump to ``builder``; returns the rank. All entries at once when they are
    well formed; entry by entry (to name the bad one) when not."""
    where = str(path)
    dump = load_dump(data, where)
    try:
        return _read_fast(path, dump, builder, node_of, default_rank)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
        return _read_entries(path, dump, builder, node_of, default_rank)


def _members(dump: dict, where: str) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...] | None]:
    pgs = dump["pg_config"]
    if not isinstance(pgs, dict):
        raise FileFormatError(where, "pg_config is not a mapping of process groups")
    world = None
    members: dict[str, tuple[int, ...]] = {}
    for name, cfg in pgs.items():
        members[str(name)] = _ranks_of(cfg, where, str(name))
        if isinstance(cfg, dict) and cfg.get("desc") == "default_pg":
            world = members[str(name)]
    if world is None and len(members) == 1:  # torch's Gloo group lists its one group unnamed ('')
        world = next(iter(members.values()))
    return members, world


def _meta(builder: TableBuilder, members, world, pg_name: str, prof: str, is_p2p: bool) -> tuple[int, int, bool]:
    """(group id, op id, point-to-point) of an entry's process group and profiling name."""
    _lib, _, opname = prof.partition(":")
    is_p2p = bool(is_p2p) or opname.startswith(("send ", "recv "))
    ranks = members.get(pg_name, world)
    if ranks is None:
        raise KeyError(pg_name)
    op = opname.split(" ")[0] if opname else "unknown"
    m = _P2P.match(opname) if is_p2p else None
    if m:  # one 2-rank group per pair, so that a send and its recv meet on one key
        a, b = int(m.group(2)), int(m.group(4))
        ga, gb = (ranks[a] if a < len(ranks) else a), (ranks[b] if b < len(ranks) else b)
        pair = (min(ga, gb), max(ga, gb))
        return builder.group_id(f"{pg_name}:p2p{pair[0]}-{pair[1]}", pair), builder.op_id(op), True
    return builder.group_id(pg_name, ranks), builder.op_id(op), is_p2p


_KEYS = ("process_group", "profiling_name", "is_p2p", "collective_seq_id", "p2p_seq_id", "time_created_ns",
         "time_discovered_started_ns", "time_discovered_completed_ns", "state", "retired", "input_sizes",
         "input_dtypes")


def _nb(sizes, dtypes) -> int:
    if len(sizes) == 1 and len(sizes[0]) == 1:
        return int(sizes[0][0]) * DTYPE_BYTES.get(dtypes[0], 4)
    return sum(math.prod(int(x) for x in s) * DTYPE_BYTES.get(str(d), 4) for s, d in zip(sizes, dtypes))


def _read_fast(path: Path, dump: dict, builder: TableBuilder, node_of, default_rank: int | None) -> int:
    import numpy as np

    where = str(path)
    rank = rank_from_name(path) if default_rank is None else default_rank
    if rank is None:
        raise ValueError
    members, world = _members(dump, where)
    entries = dump["entries"]
    if not entries:
        raise ValueError
    from operator import itemgetter

    timed_keys = ("duration_ms",) if "duration_ms" in entries[0] else ()
    cols = list(zip(*map(itemgetter(*_KEYS, *timed_keys), entries)))
    pg, prof, isp, cseq, pseq, created, t_start, t_end, names, retired, sizes, dtypes = cols[:12]
    keys = [(g[0], p, i) for g, p, i in zip(pg, prof, isp)]
    cache = {k: _meta(builder, members, world, str(k[0]), str(k[1]), k[2]) for k in set(keys)}
    meta = [cache[k] for k in keys]
    seq = [int(p if m[2] else c) for c, p, m in zip(cseq, pseq, meta)]
    nan = math.nan
    created = np.asarray(created, dtype=np.float64) / 1e9
    t_end = np.asarray([nan if x is None else x for x in t_end], dtype=np.float64) / 1e9
    t_start = np.asarray([nan if x is None else x for x in t_start], dtype=np.float64) / 1e9
    dur = np.asarray([nan if x is None else x for x in cols[12]], dtype=np.float64) / 1e3 if timed_keys else \
        np.full(len(entries), nan)
    start = np.where(np.isfinite(dur) & np.isfinite(t_end), t_end - dur, t_start)
    timed = bool(np.isfinite(t_end).any() or np.isfinite(dur).any())
    codes = {k: int(v) for k, v in STATE_NAMES.items()}
    state = np.asarray([codes.get(n, int(State.UNKNOWN)) for n in names], dtype=np.int64)
    if not timed:  # Gloo: entries never move past 'scheduled'
        state[(state == int(State.SCHEDULED)) & np.asarray(retired, dtype=bool)] = int(State.UNKNOWN)
    # one 1-D tensor per op, the usual case, without a call per entry
    numel = [s[0][0] if len(s) == 1 and len(s[0]) == 1 else -1 for s in sizes]
    width = [DTYPE_BYTES.get(d[0], 4) if d else 4 for d in dtypes]
    nbytes = [n * w if n >= 0 else _nb(sz or (), dt or ()) for n, w, sz, dt in zip(numel, width, sizes, dtypes)]
    n = len(entries)
    builder.add_chunk(rank=np.full(n, rank), node=np.full(n, node_of(rank)), group=[m[0] for m in meta], seq=seq,
                      p2p=[m[2] for m in meta], op=[m[1] for m in meta], nbytes=nbytes, enqueue_s=created,
                      start_s=start, end_s=t_end, state=state)
    builder.add_file(rank, where)
    return rank


def _read_entries(path: Path, dump: dict, builder: TableBuilder, node_of, default_rank: int | None) -> int:
    where = str(path)
    rank = rank_from_name(path) if default_rank is None else default_rank
    if rank is None:
        raise FileFormatError(where, "a flight-recorder dump's name must end in its rank, as torch writes it "
                                     "(nccl_trace_rank_<N>)")
    members, world = _members(dump, where)
    entries = dump["entries"]
    timed = any(isinstance(e, dict) and (e.get("time_discovered_completed_ns") or e.get("duration_ms"))
                for e in entries)
    c = builder.cols
    node = node_of(rank)
    for i, e in enumerate(entries):
        try:
            pg_name = str(e["process_group"][0])
            prof = str(e["profiling_name"])
            _lib, _, opname = prof.partition(":")
            is_p2p = bool(e.get("is_p2p", False)) or opname.startswith(("send ", "recv "))
            ranks = members.get(pg_name)
            if ranks is None:  # a group torch did not list (older dumps): the world, when known
                if world is None:
                    raise FileFormatError(where, f"entry {i} names process group {pg_name!r}, which pg_config "
                                                 "does not list")
                ranks = world
            op = opname.split(" ")[0] if opname else "unknown"
            seq = int(e["p2p_seq_id"] if is_p2p else e["collective_seq_id"])
            if is_p2p:  # one 2-rank group per pair, so that a send and its recv meet on one key
                m = _P2P.match(opname)
                if m:
                    a, b = int(m.group(2)), int(m.group(4))
                    ga, gb = (ranks[a] if a < len(ranks) else a), (ranks[b] if b < len(ranks) else b)
                    pair = (min(ga, gb), max(ga, gb))
                    gid = builder.group_id(f"{pg_name}:p2p{pair[0]}-{pair[1]}", pair)
                else:
                    gid = builder.group_id(pg_name, ranks)
            else:
                gid = builder.group_id(pg_name, ranks)
            state = STATE_NAMES.get(str(e.get("state")), State.UNKNOWN)
            if not timed and state is State.SCHEDULED and e.get("retired", True):
                state = State.UNKNOWN  # Gloo: never moves past 'scheduled'
            created = float(e["time_created_ns"]) / 1e9
            t_start = e.get("time_discovered_started_ns")
            t_end = e.get("time_discovered_completed_ns")
            dur = e.get("duration_ms")
            end = float(t_end) / 1e9 if t_end is not None else math.nan
            if dur is not None and t_end is not None:
                start = end - float(dur) / 1e3
            else:
                start = float(t_start) / 1e9 if t_start is not None else math.nan
        except FileFormatError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError):
            raise FileFormatError(where, f"entry {i} is not a flight-recorder entry (needs process_group, "
                                         "profiling_name, collective_seq_id, p2p_seq_id, time_created_ns)") from None
        c["rank"].append(rank)
        c["node"].append(node)
        c["group"].append(gid)
        c["seq"].append(seq)
        c["p2p"].append(is_p2p)
        c["op"].append(builder.op_id(op))
        c["nbytes"].append(_nbytes(e) if isinstance(e, dict) else 0)
        c["enqueue_s"].append(created)
        c["start_s"].append(start)
        c["end_s"].append(end)
        c["state"].append(int(state))
    builder.add_file(rank, where)
    return rank


def dump_bytes(pg_config: dict[str, tuple[str, tuple[int, ...]]], entries: list[dict]) -> bytes:
    """A dump as torch writes it: ``pg_config`` maps a group name to (desc, ranks)."""
    dump = {"version": DUMP_VERSION,
            "pg_config": {name: {"name": name, "desc": desc, "ranks": str(list(ranks))}
                          for name, (desc, ranks) in pg_config.items()},
            "comm_lib_version": "echo-plan simulated", "entries": entries}
    return pickle.dumps(dump, protocol=4)
