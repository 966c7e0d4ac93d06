"""``simulate --emit-records DIR``: write the records a simulated job would leave, one file per rank.

Every rank is written (a diagnosis needs every member of a group to compare them), and each
file holds the rank's last ``buffer`` records, as torch's flight recorder keeps the last
``TORCH_NCCL_TRACE_BUFFER_SIZE`` (default 2,000) entries: a 1,024-GPU job gives 1,024 files of at
most 2,000 records, whatever the number of steps simulated.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from echo_plan.errors import SpecError
from echo_plan.limits import MAX_SEED, check_int
from echo_plan.interop.chakra_step import build_step_graph
from echo_plan.simulate import SimulationMemo
from echo_plan.specs.faults import check_faults
from echo_plan.files import write_atomic
from echo_plan.errors import FileFormatError

MAX_STEPS = 64
MAX_NOISE = 0.5
MAX_BUFFER = 1 << 20
DEFAULT_STEPS = 3
DEFAULT_BUFFER = 2000  # torch's default TORCH_NCCL_TRACE_BUFFER_SIZE (FlightRecorder.hpp)
MAX_EMIT_GPUS = 16384  # one file per rank; a larger job's records are more than this tool should write


class RecordFormat(str, Enum):
    FLIGHT_RECORDER = "flight-recorder"
    JSONL = "jsonl"
    CSV = "csv"


def check_emit_options(out: str, fmt: str, steps: int, noise: float, seed: int, buffer: int) -> RecordFormat:
    try:
        f = RecordFormat(fmt)
    except ValueError:
        raise SpecError("--record-format", fmt, "flight-recorder | jsonl | csv") from None
    check_int("--record-steps", steps, 1, MAX_STEPS)
    check_int("--record-seed", seed, 0, MAX_SEED)
    check_int("--record-buffer", buffer, 1, MAX_BUFFER, "records kept per rank")
    if not (0.0 <= noise <= MAX_NOISE):
        raise SpecError("--record-noise", noise, f"a share of each time from 0 to {MAX_NOISE} (0.03: 3% noise)")
    p = Path(out)
    if not str(out).strip():
        raise SpecError("--emit-records", out, "a folder path")
    try:
        busy = p.exists() and (not p.is_dir() or any(p.iterdir()))
    except OSError as exc:
        raise SpecError("--emit-records", out, f"a folder this user can read ({exc.strerror or exc})") from None
    if busy:
        raise SpecError("--emit-records", out, "a new or empty folder (records of another run would mix with these)")
    return f


def emit_records(model, cluster, plan, *, stack, cache, faults, out: str, fmt: RecordFormat, steps: int,
                 noise: float, seed: int, buffer: int) -> dict:
    """Simulate ``steps`` steps of every rank and write their records; returns a summary."""
    job = prepare_job(model, cluster, plan, stack=stack, cache=cache)
    return emit_job(job, faults, out=out, fmt=fmt, steps=steps, noise=noise, seed=seed, buffer=buffer)


def prepare_job(model, cluster, plan, *, stack=None, cache=None) -> tuple:
    """What every emission of this plan shares: (plan, cluster, per-stage programs, collective model)."""
    from echo_plan.resilience.diagnose.program import stage_programs  # deferred: loads numpy

    if plan.world_size > MAX_EMIT_GPUS:
        raise SpecError("--emit-records", plan.world_size, f"a plan of at most {MAX_EMIT_GPUS:,} GPUs")
    graph = build_step_graph(model, cluster, plan, cache=cache, stack=stack)
    return plan, cluster, stage_programs(graph), SimulationMemo().default_comm(cluster)


def emit_job(job: tuple, faults, *, out: str, fmt: RecordFormat, steps: int, noise: float, seed: int,
             buffer: int) -> dict:
    from echo_plan.resilience.diagnose.emit_sim import run_job  # deferred: loads numpy
    from echo_plan.resilience.diagnose.program import rank_faults  # deferred: loads numpy

    plan, cluster, programs, comm = job
    check_faults(tuple(faults), plan, cluster)
    recs = run_job(programs, plan, cluster, comm, rank_faults(tuple(faults), plan.world_size, cluster), steps,
                   noise, seed)
    written = write_records(recs, Path(out), fmt, buffer, cluster.gpus_per_node)
    return {"folder": str(out), "format": fmt.value, "ranks": len(recs), "files": written, "steps": steps,
            "records_per_rank_max": max((min(len(r), buffer) for r in recs), default=0), "noise": noise,
            "seed": seed, "faults": [f.label() for f in faults]}


def write_records(recs: list[list[list]], out: Path, fmt: RecordFormat, buffer: int, gpn: int) -> int:
    from echo_plan.resilience.diagnose import plain  # deferred: loads numpy

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FileFormatError(str(out), f"cannot create the records folder: {exc.strerror or exc}") from None
    world = len(recs)
    for rank, rows in enumerate(recs):
        rows = rows[-buffer:]
        if fmt is RecordFormat.FLIGHT_RECORDER:
            write_atomic(out / f"nccl_trace_rank_{rank}", _fr_dump(rank, rows, world))
            continue
        dicts = [{"rank": rank, "node": rank // gpn, "group": r[0], "group_ranks": r[1], "seq": r[2], "op": r[3],
                  "nbytes": r[4], "enqueue_s": r[5], "start_s": r[6], "end_s": r[7], "state": r[8], "conns": r[9]}
                 for r in rows]
        if fmt is RecordFormat.JSONL:
            write_atomic(out / f"rank_{rank}.jsonl", "".join(plain.jsonl_line(d) + "\n" for d in dicts))
        else:
            write_atomic(out / f"rank_{rank}.csv", plain.csv_text(dicts))
    return world


def _fr_dump(rank: int, rows: list[list], world: int) -> bytes:
    from echo_plan.resilience.diagnose.flight_recorder import dump_bytes  # deferred: loads numpy

    pgs: dict[str, tuple[str, tuple[int, ...]]] = {"0": ("default_pg", tuple(range(world)))}
    pg_ids: dict[str, int] = {"0": 0}
    entries = []
    for i, r in enumerate(rows):
        name, members, seq, op, nbytes, enq, start, end, state, _conns, p2p = r[:11]
        pg = name
        ranks = tuple(sorted(members))
        if pg not in pgs:
            pgs[pg] = (name.split("_")[0], ranks)
            pg_ids[pg] = len(pg_ids)
        if p2p:
            src, dst = ranks.index(members[0]), ranks.index(members[1])
            prof = f"nccl:send {src}->{dst}" if op == "send" else f"nccl:recv {dst}<-{src}"
        else:
            prof = f"nccl:{op}"
        numel = max(1, nbytes // 2)
        e = {"record_id": i, "pg_id": pg_ids[pg], "process_group": (pg, pgs[pg][0]), "collective_seq_id": 0 if p2p else seq,
             "p2p_seq_id": seq if p2p else 0, "op_id": i + 1, "profiling_name": prof, "is_p2p": bool(p2p),
             "time_created_ns": int(enq * 1e9), "input_sizes": [[numel]], "input_dtypes": ["BFloat16"],
             "output_sizes": [[numel]], "output_dtypes": ["BFloat16"], "state": state,
             "time_discovered_started_ns": int(start * 1e9) if start is not None else None,
             "time_discovered_completed_ns": int(end * 1e9) if end is not None else None,
             "duration_ms": (end - start) * 1e3 if end is not None and start is not None else None,
             "timeout_ms": 600000, "retired": state == "completed", "frames": [], "thread_id": "1",
             "thread_name": "echo-plan"}
        entries.append(e)
    return dump_bytes(pgs, entries)
