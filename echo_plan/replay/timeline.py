"""The simulated step as a timeline: events from the level-2 replay, and a Chrome/Perfetto trace.

The trace is the Trace Event Format that chrome://tracing and ui.perfetto.dev open: a JSON object
with ``traceEvents``; complete events (``"ph": "X"``) with microsecond ``ts``/``dur``; a process
(``pid``) per simulated rank named by ``process_name`` metadata ("stage s (rank r)") and a thread
(``tid``) per stream named by ``thread_name`` metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from echo_plan.replay.engine import ReplayResult
from echo_plan.replay.pipeline import StepTasks
from echo_plan.replay.results import StepResult, TimelineEvent
from echo_plan.files import write_atomic

STREAM_ORDER = ("compute", "tp_comm", "pp_fwd", "pp_bwd", "dp_comm")


def timeline_events(steps: StepTasks, result: ReplayResult) -> tuple[TimelineEvent, ...]:
    """One event per replayed task, with its actual (interference-stretched) span."""
    out = []
    for t in steps.tasks:
        start = result.start_s[t.id]
        dur = result.end_s[t.id] - start
        args: dict[str, Any] = {"isolated_us": t.work_s * 1e6}
        if dur - t.work_s > 1e-9 * max(dur, 1e-9):
            args["interference_us"] = (dur - t.work_s) * 1e6
        out.append(TimelineEvent(rank=t.device, stream=t.stream, name=t.name, start_s=start, duration_s=dur,
                                 category=t.category, args=args))
    out.sort(key=lambda e: (e.rank, e.start_s))
    return tuple(out)


def chrome_trace(step: StepResult) -> dict[str, Any]:
    """The Trace Event Format object of a StepResult that was simulated with ``timeline=True``."""
    plan = step.plan
    tp, dp = int(plan.get("tp", 1)), int(plan.get("dp", 1))
    events: list[dict[str, Any]] = []
    streams: dict[int, dict[str, int]] = {}
    for e in step.timeline:
        tids = streams.setdefault(e.rank, {})
        if e.stream not in tids:
            tids[e.stream] = _tid(e.stream, len(tids))
        events.append({
            "name": e.name, "cat": e.category, "ph": "X", "pid": e.rank, "tid": tids[e.stream],
            "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6, "args": e.args,
        })
    meta: list[dict[str, Any]] = []
    for rank in sorted(streams):
        first_global_rank = rank * tp * dp  # Megatron-LM order: tp fastest, then dp, then pp
        meta.append({"name": "process_name", "ph": "M", "pid": rank,
                     "args": {"name": f"stage {rank} (rank {first_global_rank})"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        for stream, tid in streams[rank].items():
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": stream}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                         "args": {"sort_index": tid}})
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"model": step.model, "cluster": step.cluster, "num_gpus": step.num_gpus,
                      "plan": plan, "step_time_s": step.step_time_s, "generator": "echo-plan simulate"},
    }


def _tid(stream: str, n: int) -> int:
    return STREAM_ORDER.index(stream) if stream in STREAM_ORDER else len(STREAM_ORDER) + n


def write_chrome_trace(path: str | Path, step: StepResult) -> Path:
    """Write the trace atomically (a temporary file, then a rename)."""
    return write_atomic(path, json.dumps(chrome_trace(step)))
