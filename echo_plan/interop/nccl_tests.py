"""Reading nccl-tests output (all_reduce_perf, all_gather_perf, reduce_scatter_perf, alltoall_perf,
sendrecv_perf, broadcast_perf) into a frozen :class:`NcclTestsLog`.

Copes with what real logs contain: Open MPI ``[1,0]<stdout>:`` tags (at line starts and in the
middle of a line, where a row was written in several pieces), CRLF line ends, NCCL INFO/WARN and
launcher noise between rows, the header of column names in its several versions (with or without
``redop`` and ``root``), and the ``# Out of bounds`` / ``# Avg bus bandwidth`` footers. A file that
is not nccl-tests output, or is truncated or corrupted, raises :class:`FileFormatError` naming the
line.

The collective is not printed by nccl-tests itself: it comes from the caller, else the file name
or command line in the log (``all_reduce_perf``, ``alltoall``, ...), else the redop column and the
busbw/algbw ratio.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from echo_plan.cost.nccl_algos import bus_factor
from echo_plan.errors import FileFormatError
from echo_plan.files import read_text
from echo_plan.trace.records import CollectiveKind

MPI_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")
RANK_LINE = re.compile(r"#\s*Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid\s+\d+\s+on\s+(\S+)\s+device\s+(\d+)")
HEADER_KV = re.compile(r"#\s*nThread\s+(\d+)\s+nGpus\s+(\d+)")
NAME_HINTS: tuple[tuple[str, CollectiveKind], ...] = (
    ("all_reduce", CollectiveKind.ALL_REDUCE), ("allreduce", CollectiveKind.ALL_REDUCE),
    ("all_gather", CollectiveKind.ALL_GATHER), ("allgather", CollectiveKind.ALL_GATHER),
    ("reduce_scatter", CollectiveKind.REDUCE_SCATTER), ("reducescatter", CollectiveKind.REDUCE_SCATTER),
    ("alltoall", CollectiveKind.ALL_TO_ALL), ("all_to_all", CollectiveKind.ALL_TO_ALL),
    ("sendrecv", CollectiveKind.SEND_RECV), ("send_recv", CollectiveKind.SEND_RECV),
    ("broadcast", CollectiveKind.BROADCAST),
)


@dataclass(frozen=True, slots=True)
class NcclTestsRow:
    size_bytes: int
    count: int
    dtype: str
    time_us_oop: float
    algbw_oop: float
    busbw_oop: float
    time_us_ip: float
    algbw_ip: float
    busbw_ip: float
    line: int  # line number in the file, for error messages and reports


@dataclass(frozen=True, slots=True)
class NcclTestsLog:
    kind: CollectiveKind
    nranks: int
    rows: tuple[NcclTestsRow, ...]
    source: str
    hosts: tuple[str, ...] = ()  # host of each rank, from the "#  Rank" lines (empty if absent)

    @property
    def ranks_per_node(self) -> int | None:
        if not self.hosts:
            return None
        counts = {h: self.hosts.count(h) for h in set(self.hosts)}
        return max(counts.values())

    @property
    def num_nodes(self) -> int | None:
        return len(set(self.hosts)) if self.hosts else None

    @property
    def name(self) -> str:
        return Path(self.source).name


def _clean_lines(text: str) -> list[str]:
    return [MPI_TAG.sub("", line).rstrip("\r\n") for line in text.replace("\r\n", "\n").split("\n")]


def _kind_from_hint(text: str) -> CollectiveKind | None:
    low = text.lower()
    for hint, kind in NAME_HINTS:
        if hint in low:
            return kind
    return None


def _num(tok: str, what: str, path: str, lineno: int) -> float:
    if tok.upper() == "N/A":
        return float("nan")
    try:
        return float(tok)
    except ValueError:
        raise FileFormatError(path, f"{what} {tok!r} is not a number (corrupted row?)", lineno) from None


def _parse_row(tokens: list[str], lead: int, path: str, lineno: int) -> NcclTestsRow:
    # lead tokens (size count type [redop] [root]), then time algbw busbw wrong, twice
    want = lead + 8
    if len(tokens) != want:
        raise FileFormatError(path, f"a result row needs {want} columns, found {len(tokens)} (truncated or corrupted)", lineno)
    try:
        size, count = int(tokens[0]), int(tokens[1])
    except ValueError:
        raise FileFormatError(path, f"size/count {tokens[0]!r} {tokens[1]!r} are not integers", lineno) from None
    vals = [_num(t, c, path, lineno) for t, c in zip(
        tokens[lead:lead + 3] + tokens[lead + 4:lead + 7],
        ("time", "algbw", "busbw", "in-place time", "in-place algbw", "in-place busbw"))]
    row = NcclTestsRow(size, count, tokens[2], *vals, line=lineno)
    if size < 0 or count < 0 or not (row.time_us_oop > 0):
        raise FileFormatError(path, "size, count and time must be positive", lineno)
    for t, bw in ((row.time_us_oop, row.algbw_oop), (row.time_us_ip, row.algbw_ip)):
        # nccl-tests prints algbw = size / time; a mismatch means a garbled number
        if t > 1.0 and bw >= 1.0 and abs(size / t / 1e3 - bw) > 0.03 * bw + 0.02:
            raise FileFormatError(path, f"algbw {bw} does not match size/time = {size / t / 1e3:.2f} (corrupted row)", lineno)
    return row


def parse_nccl_tests_text(text: str, source: str = "<text>", kind: CollectiveKind | None = None) -> NcclTestsLog:
    """Parse nccl-tests output held in a string (see :func:`parse_nccl_tests`)."""
    lines = _clean_lines(text)
    ranks: dict[int, str] = {}
    header_gpus: int | None = None
    lead: int | None = None
    rows: list[NcclTestsRow] = []
    footer = False
    saw_header = False
    redops: set[str] = set()
    for lineno, line in enumerate(lines, start=1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            if (m := HEADER_KV.match(s)) is not None:
                saw_header = True
                header_gpus = int(m.group(1)) * int(m.group(2))
            elif (m := RANK_LINE.match(s)) is not None:
                ranks[int(m.group(1))] = m.group(2)
            elif "size" in s and "count" in s and "time" in s:
                toks = s.lstrip("#").split()
                saw_header = True
                lead = toks.index("time")
            elif s.startswith("# Avg bus bandwidth"):
                footer = True
            continue
        if not s[0].isdigit():
            if kind is None and "_perf" in s:
                kind = _kind_from_hint(s)
            continue  # launcher or NCCL INFO/WARN noise between rows
        toks = s.split()
        if lead is None:  # no column header: infer from the row's width (12, or 13 with root)
            if len(toks) not in (12, 13):
                raise FileFormatError(source, "a result row before any nccl-tests column header", lineno)
            lead = len(toks) - 8
        rows.append(_parse_row(toks, lead, source, lineno))
        if lead >= 4:
            redops.add(toks[3].lower())
        if footer:
            raise FileFormatError(source, "a result row after the '# Avg bus bandwidth' footer", lineno)
    if not saw_header:
        raise FileFormatError(source, "not nccl-tests output: no '# nThread ... nGpus' header or column header")
    if not rows:
        raise FileFormatError(source, "no result rows (is this nccl-tests output?)")
    if not footer:
        raise FileFormatError(source, "truncated: no '# Avg bus bandwidth' footer after the last row", rows[-1].line)
    nranks = len(ranks) if ranks else header_gpus
    if nranks is None or nranks < 1:
        raise FileFormatError(source, "cannot tell the number of ranks (no '#  Rank' lines or nGpus header)")
    if kind is None:
        kind = _kind_from_hint(Path(source).name) or _kind_from_ratio(rows, nranks, redops, source)
    _check_ratio(rows, nranks, kind, source)
    hosts = tuple(ranks[r] for r in sorted(ranks)) if ranks else ()
    return NcclTestsLog(kind=kind, nranks=nranks, rows=tuple(rows), source=source, hosts=hosts)


def parse_nccl_tests(path: str | Path, kind: CollectiveKind | None = None) -> NcclTestsLog:
    """Parse one nccl-tests log file; ``kind`` overrides the collective read from the file name."""
    p = Path(path)
    text = read_text(p, errors="replace")
    if "\x00" in text:
        raise FileFormatError(str(p), "binary data: not nccl-tests output")
    return parse_nccl_tests_text(text, source=str(p), kind=kind)


def _ratio(rows: list[NcclTestsRow]) -> float | None:
    good = [r.busbw_oop / r.algbw_oop for r in rows if r.algbw_oop >= 1.0 and r.busbw_oop > 0]
    return sorted(good)[len(good) // 2] if good else None


def _kind_from_ratio(rows: list[NcclTestsRow], n: int, redops: set[str], source: str) -> CollectiveKind:
    ratio = _ratio(rows)
    if ratio is None or n < 2:
        raise FileFormatError(source, "cannot tell which collective this is: name the file after the nccl-tests "
                                      "binary (e.g. all_reduce_perf.log) or pass the kind")
    reduces = bool(redops) and not redops <= {"none"}
    if abs(ratio - bus_factor(CollectiveKind.ALL_REDUCE, n)) < 0.02 and reduces:
        return CollectiveKind.ALL_REDUCE
    if abs(ratio - bus_factor(CollectiveKind.REDUCE_SCATTER, n)) < 0.02 and reduces:
        return CollectiveKind.REDUCE_SCATTER
    raise FileFormatError(source, f"cannot tell which collective this is (busbw/algbw = {ratio:.3f} on {n} ranks): "
                                  "name the file after the nccl-tests binary or pass the kind")


def _check_ratio(rows: list[NcclTestsRow], n: int, kind: CollectiveKind, source: str) -> None:
    ratio = _ratio(rows)
    if ratio is None or n < 2:
        return
    want = bus_factor(kind, n)
    if abs(ratio - want) > 0.03 * want + 0.02:
        raise FileFormatError(source, f"busbw/algbw = {ratio:.3f} but {kind.value} on {n} ranks gives {want:.3f}: "
                                      "wrong collective or rank count")


def render_nccl_tests(kind: CollectiveKind, hosts: list[str], sizes_and_times: list[tuple[int, float, float]],
                      dtype: str = "float", elem_bytes: int = 4, mpi_tag: bool = False) -> str:
    """nccl-tests-style text for (size, out-of-place us, in-place us) rows, one rank per host entry.

    Used to make synthetic logs (calibration tests, examples). Layout of nccl-tests 2.13 with the
    ``redop`` and ``root`` columns.
    """
    n = len(hosts)
    bf = bus_factor(kind, n)
    redop = "sum" if kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER) else "none"
    out = [f"# nThread 1 nGpus {1 if mpi_tag else n} minBytes {sizes_and_times[0][0]} "
           f"maxBytes {sizes_and_times[-1][0]} step: 2(factor) warmup iters: 5 iters: 20 validation: 1",
           "#", "# Using devices"]
    for r, h in enumerate(hosts):
        local = hosts[:r].count(h)
        out.append(f"#  Rank {r:2d} Pid {1000 + r:6d} on {h} device {local:2d} [0x00] A100-SXM4-40GB")
    out += ["#",
            "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong",
            "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"]
    for size, t_oop, t_ip in sizes_and_times:
        cells = [f"{size:12d}", f"{size // elem_bytes:12d}", f"{dtype:>8s}", f"{redop:>6s}", f"{-1:6d}"]
        for t in (t_oop, t_ip):
            alg = size / t / 1e3
            cells += [f"{t:8.2f}", f"{alg:7.2f}", f"{alg * bf:7.2f}", f"{0:6d}"]
        out.append(" ".join(cells))
    out += ["# Out of bounds values : 0 OK", "# Avg bus bandwidth    : 0", "#"]
    if mpi_tag:
        out = ["[1,0]<stdout>:" + line for line in out]
    return "\n".join(out) + "\n"
