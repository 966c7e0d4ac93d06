"""The plain record formats, JSONL and CSV, for collective libraries other than torch's.

One record per rank per collective (or point-to-point op), in the rank's issue order. Fields
(docs/diagnose.md has the full description):

``rank`` (int), ``node`` (int, optional), ``group`` (name), ``group_ranks`` (the group's global
ranks: a JSON list, or in CSV the ranks separated by spaces), ``seq`` (the op's number within its
group, the same on every member), ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all,
broadcast, send, recv, ...), ``nbytes``, ``enqueue_s`` (the CPU issued it), ``start_s`` (its
kernel started: the rank entered), ``end_s`` (it finished; empty/null while not finished),
``state`` (scheduled | started | completed), and optionally ``conns``: the connections the rank
used in this op, each with ``peer``, ``dir`` (send | recv), ``busy_s`` (seconds spent moving data,
not waiting for it) and ``done`` (the share of its bytes moved, 1 when finished); in CSV
``dir:peer:busy_s:done`` items separated by ``;``. Times are seconds on the rank's own clock.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any

import numpy as np

from echo_plan.errors import FileFormatError
from echo_plan.resilience.diagnose.records import STATE_NAMES, ConnDir, TableBuilder

FIELDS = ("rank", "node", "group", "group_ranks", "seq", "op", "nbytes", "enqueue_s", "start_s", "end_s", "state",
          "conns")
REQUIRED = ("rank", "group", "group_ranks", "seq", "op", "enqueue_s", "state")


def _num(v: Any, what: str, where: str, line: int, integer: bool = False) -> float:
    if v is None or v == "":
        if integer:
            raise FileFormatError(where, f"{what} is empty; expected an integer", line)
        return math.nan
    try:
        if isinstance(v, bool):
            raise ValueError
        x = int(v) if integer else float(v)
    except (TypeError, ValueError):
        raise FileFormatError(where, f"{what}={v!r} is not {'an integer' if integer else 'a number'}", line) from None
    if not integer and not math.isfinite(x):
        raise FileFormatError(where, f"{what}={v!r} is not a finite number", line)
    return x


def _conns(raw: Any, where: str, line: int) -> list[tuple[int, int, float, float]]:
    if raw is None or raw == "":
        return []
    if isinstance(raw, str):
        items = []
        for part in raw.split(";"):
            bits = part.split(":")
            if len(bits) != 4:
                raise FileFormatError(where, f"conns item {part!r} is not dir:peer:busy_s:done", line)
            items.append({"dir": bits[0], "peer": bits[1], "busy_s": bits[2], "done": bits[3]})
        raw = items
    if not isinstance(raw, list):
        raise FileFormatError(where, "conns is not a list of {peer, dir, busy_s, done}", line)
    out = []
    for item in raw:
        if not isinstance(item, dict) or item.get("dir") not in ("send", "recv"):
            raise FileFormatError(where, f"conns item {item!r} needs dir (send | recv), peer, busy_s, done", line)
        out.append((int(_num(item.get("peer"), "conns.peer", where, line, True)),
                    ConnDir.SEND if item["dir"] == "send" else ConnDir.RECV,
                    _num(item.get("busy_s"), "conns.busy_s", where, line),
                    _num(item.get("done", 1.0), "conns.done", where, line)))
    return out


def add_row(rec: dict, builder: TableBuilder, where: str, line: int, node_of) -> int:
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise FileFormatError(where, f"a record without {', '.join(missing)} (fields: {', '.join(FIELDS)})", line)
    rank = int(_num(rec["rank"], "rank", where, line, True))
    members = rec["group_ranks"]
    if isinstance(members, str):
        members = members.split()
    if not isinstance(members, list) or not members:
        raise FileFormatError(where, f"group_ranks={rec['group_ranks']!r} is not a list of ranks", line)
    ranks = tuple(int(_num(m, "group_ranks", where, line, True)) for m in members)
    state = STATE_NAMES.get(str(rec["state"]))
    if state is None:
        raise FileFormatError(where, f"state={rec['state']!r} is not one of scheduled, started, completed", line)
    node = rec.get("node")
    node = int(_num(node, "node", where, line, True)) if node not in (None, "") else node_of(rank)
    c = builder.cols
    row = builder.nrows
    op = str(rec["op"])
    c["rank"].append(rank)
    c["node"].append(node)
    c["group"].append(builder.group_id(str(rec["group"]), ranks))
    c["seq"].append(int(_num(rec["seq"], "seq", where, line, True)))
    c["p2p"].append(op in ("send", "recv"))
    c["op"].append(builder.op_id(op))
    nb = rec.get("nbytes")
    c["nbytes"].append(int(_num(nb, "nbytes", where, line, True)) if nb not in (None, "") else 0)
    c["enqueue_s"].append(_num(rec["enqueue_s"], "enqueue_s", where, line))
    c["start_s"].append(_num(rec.get("start_s"), "start_s", where, line))
    c["end_s"].append(_num(rec.get("end_s"), "end_s", where, line))
    c["state"].append(int(state))
    k = builder.conn
    for peer, d, busy, done in _conns(rec.get("conns"), where, line):
        k["row"].append(row)
        k["peer"].append(peer)
        k["dir"].append(int(d))
        k["busy_s"].append(busy)
        k["done"].append(done)
    return rank


def read_jsonl(text: str, where: str, builder: TableBuilder, node_of) -> set[int]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        recs = json.loads("[" + ",".join(lines) + "]")
        if all(type(r) is dict for r in recs):
            return _fast(builder, {k: [r.get(k) for r in recs] for k in FIELDS}, node_of, len(recs))
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError, OverflowError):
        pass
    return _read_jsonl_rows(text, where, builder, node_of)  # finds the bad line


def _read_jsonl_rows(text: str, where: str, builder: TableBuilder, node_of) -> set[int]:
    ranks: set[int] = set()
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise FileFormatError(where, f"not a JSON record ({getattr(exc, 'msg', exc)}); a truncated or foreign "
                                         "file?", i) from None
        if not isinstance(rec, dict):
            raise FileFormatError(where, "a record line is not a JSON object", i)
        ranks.add(add_row(rec, builder, where, i, node_of))
    return ranks


def read_csv(text: str, where: str, builder: TableBuilder, node_of) -> set[int]:
    try:
        rows = list(csv.reader(io.StringIO(text)))
        header = rows[0] if rows else []
        if rows and all(len(r) == len(header) for r in rows) and all(k in header for k in REQUIRED):
            cols = dict(zip(header, map(list, zip(*rows[1:])))) if len(rows) > 1 else {k: [] for k in header}
            cols = {k: cols.get(k) or [None] * (len(rows) - 1) for k in FIELDS}
            for k in ("node", "nbytes", "start_s", "end_s", "conns"):
                cols[k] = [v if v != "" else None for v in cols[k]]
            cols["group_ranks"] = [v.split() for v in cols["group_ranks"]]
            cols["conns"] = [_split_conns(v) for v in cols["conns"]]
            return _fast(builder, cols, node_of, len(rows) - 1)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, csv.Error):
        pass
    return _read_csv_rows(text, where, builder, node_of)  # finds the bad line


def _read_csv_rows(text: str, where: str, builder: TableBuilder, node_of) -> set[int]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    missing = [k for k in REQUIRED if k not in header]
    if missing:
        raise FileFormatError(where, f"a CSV header without {', '.join(missing)} (columns: {', '.join(FIELDS)})", 1)
    ranks: set[int] = set()
    try:
        for i, rec in enumerate(reader, 2):
            if None in rec or any(v is None for v in rec.values()):
                raise FileFormatError(where, f"a row with {'more' if None in rec else 'fewer'} columns than the "
                                             "header (truncated?)", i)
            ranks.add(add_row(rec, builder, where, i, node_of))
    except csv.Error as exc:
        raise FileFormatError(where, f"malformed CSV: {exc}") from None
    return ranks


def _split_conns(v):
    if not v:
        return None
    out = []
    for part in v.split(";"):
        d, p, b, f = part.split(":")
        out.append({"dir": d, "peer": int(p), "busy_s": float(b), "done": float(f)})
    return out


def _ints(values: list, nullable: bool = False) -> np.ndarray:
    if nullable:
        values = [-1 if v is None else v for v in values]
    if not all(type(v) is int for v in values):
        values = [int(v) for v in values]  # '12' from CSV; 1.5 or 'x' raise ValueError -> the slow path
        if any(type(v) is bool for v in values):
            raise ValueError
    return np.asarray(values, dtype=np.int64)


def _floats(values: list) -> np.ndarray:
    arr = np.asarray([np.nan if v is None else v for v in values], dtype=np.float64)
    if np.isinf(arr).any():
        raise ValueError
    return arr


def _fast(builder: TableBuilder, cols: dict, node_of, n: int) -> set[int]:
    """All rows of one file at once; any surprise raises, and the caller reads row by row instead
    (which names the bad line)."""
    if n == 0:
        return set()
    rank = _ints(cols["rank"])
    seq = _ints(cols["seq"])
    nbytes = _ints(cols["nbytes"], nullable=True)
    node = _ints(cols["node"], nullable=True)
    if (rank < 0).any() or (seq < 0).any():
        raise ValueError
    node = np.where(node >= 0, node, np.asarray([node_of(int(r)) for r in rank], dtype=np.int64)) \
        if (node < 0).any() else node
    enq, start, end = _floats(cols["enqueue_s"]), _floats(cols["start_s"]), _floats(cols["end_s"])
    if np.isnan(enq).any():
        raise ValueError
    state = [int(STATE_NAMES[s]) for s in cols["state"]]
    gcache: dict = {}
    gids = []
    for name, members in zip(cols["group"], cols["group_ranks"]):
        key = (name, tuple(members))
        gid = gcache.get(key)
        if gid is None:
            ranks = tuple(int(m) for m in members)
            if not ranks or type(name) is not str:
                raise ValueError
            gid = gcache[key] = builder.group_id(name, ranks)
        gids.append(gid)
    ops = [str(o) for o in cols["op"]]
    crow, cpeer, cdir, cbusy, cdone = [], [], [], [], []
    base = builder.nrows
    dirs = {"send": 0, "recv": 1}
    for i, conns in enumerate(cols["conns"]):
        if conns:
            for item in conns:
                crow.append(base + i)
                cpeer.append(int(item["peer"]))
                cdir.append(dirs[item["dir"]])
                cbusy.append(float(item["busy_s"]))
                cdone.append(float(item.get("done", 1.0)))
    builder.add_chunk(rank=rank, node=node, group=gids, seq=seq, p2p=[o in ("send", "recv") for o in ops],
                      op=[builder.op_id(o) for o in ops], nbytes=np.maximum(nbytes, 0), enqueue_s=enq, start_s=start,
                      end_s=end, state=state)
    k = builder.conn
    k["row"] += crow
    k["peer"] += cpeer
    k["dir"] += cdir
    k["busy_s"] += cbusy
    k["done"] += cdone
    return set(rank.tolist())


def _fmt(x: float) -> Any:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, 9)


def jsonl_line(rec: dict) -> str:
    out = {k: rec[k] for k in FIELDS if k in rec and k != "conns"}
    for k in ("enqueue_s", "start_s", "end_s"):
        out[k] = _fmt(out.get(k))
    out["group_ranks"] = list(rec["group_ranks"])
    if rec.get("conns"):
        out["conns"] = [{"peer": p, "dir": d, "busy_s": round(b, 9), "done": round(f, 4)} for p, d, b, f in rec["conns"]]
    return json.dumps(out, separators=(",", ":"))


def csv_text(records: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(FIELDS)
    for r in records:
        conns = ";".join(f"{d}:{p}:{b:.9g}:{f:.4g}" for p, d, b, f in r.get("conns") or ())
        w.writerow([r["rank"], r.get("node", ""), r["group"], " ".join(map(str, r["group_ranks"])), r["seq"], r["op"],
                    r.get("nbytes", 0)] + ["" if _fmt(r.get(k)) is None else f"{r[k]:.9f}"
                                           for k in ("enqueue_s", "start_s", "end_s")] + [r["state"], conns])
    return buf.getvalue()
