"""SearchOutcome and CompareOutcome to and from JSON (what ``--json`` prints and reports read back).

``*_to_json`` give plain dicts for ``json.dumps``; ``*_from_json`` rebuild the frozen records and
raise FileFormatError on anything that is not such a document. StepResults carry their breakdown,
per-stage memory and timeline, so a round trip gives equal records.
"""

from __future__ import annotations

from typing import Any

from echo_plan.errors import FileFormatError
from echo_plan.cost.stage_memory import StageMemory
from echo_plan.replay.results import Breakdown, StepResult, TimelineEvent
from echo_plan.search.results import CompareOutcome, CompareRow, SearchOutcome, TrialRecord, TrialState

FORMAT = "echo-plan/search-outcome"
COMPARE_FORMAT = "echo-plan/compare-outcome"
VERSION = 1

_BREAKDOWN_KEYS = {
    "compute": "compute_s", "tp_comm_exposed": "tp_comm_exposed_s", "pp_comm_exposed": "pp_comm_exposed_s",
    "dp_comm_exposed": "dp_comm_exposed_s", "bubble": "bubble_s", "interference": "interference_s",
    "optimizer": "optimizer_s", "ep_comm_exposed": "ep_comm_exposed_s", "host_exposed": "host_exposed_s",
}
_BREAKDOWN_SINCE = {"ep_comm_exposed", "host_exposed"}  # added later: a stored outcome without it had none (0)
_MEMORY_FIELDS = ("stage", "weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
                  "buffers_bytes", "capacity_bytes")
_MEMORY_SINCE = ("headroom_bytes", "outside_allocator_bytes", "cached_extra_bytes", "host_bytes",
                 "host_capacity_bytes")  # 0 in records written before them


def step_result_to_json(r: StepResult) -> dict[str, Any]:
    d = r.as_json()
    if r.timeline:
        d["timeline"] = [
            {"rank": e.rank, "stream": e.stream, "name": e.name, "start_s": e.start_s,
             "duration_s": e.duration_s, "category": e.category, "args": e.args}
            for e in r.timeline
        ]
    return d


def step_result_from_json(d: dict[str, Any]) -> StepResult:
    try:
        bd = d["breakdown"]
        breakdown = Breakdown(**{field: float(bd[key] if key in bd or key not in _BREAKDOWN_SINCE else 0.0)
                                 for key, field in _BREAKDOWN_KEYS.items()})
        memory = tuple(StageMemory(**{f: int(m[f]) for f in _MEMORY_FIELDS},
                                   **{f: int(m.get(f, 0)) for f in _MEMORY_SINCE})
                       for m in d["memory_per_stage"])
        rng = d.get("step_time_range_s")
        timeline = tuple(
            TimelineEvent(int(e["rank"]), str(e["stream"]), str(e["name"]), float(e["start_s"]),
                          float(e["duration_s"]), str(e["category"]), dict(e.get("args") or {}))
            for e in d.get("timeline") or ()
        )
        return StepResult(
            model=str(d["model"]), cluster=str(d["cluster"]), num_gpus=int(d["num_gpus"]), plan=dict(d["plan"]),
            step_time_s=float(d["step_time_s"]), tokens_per_s=float(d["tokens_per_s"]),
            model_tflops_per_gpu=float(d["model_tflops_per_gpu"]),
            hardware_tflops_per_gpu=float(d["hardware_tflops_per_gpu"]), mfu=float(d["mfu"]),
            memory=memory, breakdown=breakdown, timeline=timeline, notes=tuple(d.get("notes") or ()),
            stack=str(d.get("stack") or ""),
            step_time_range_s=(float(rng[0]), float(rng[1])) if rng else None,
            range_coverage=None if d.get("range_coverage") is None else float(d["range_coverage"]),
            range_basis=str(d.get("range_basis") or ""),
            dp_exchange=dict(d["dp_exchange"]) if isinstance(d.get("dp_exchange"), dict) else None,
            goodput=dict(d["goodput"]) if isinstance(d.get("goodput"), dict) else None,
            faults=({"healthy_step_time_s": float(d["healthy_step_time_s"]), "applied": list(d["faults"]),
                     "stages": list(d.get("fault_waits") or [])} if d.get("faults") else None),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError("step result", f"not a StepResult document ({type(exc).__name__}: {exc})") from None


def trial_to_json(t: TrialRecord) -> dict[str, Any]:
    return {
        "number": t.number, "plan": t.plan, "state": t.state.value,
        "result": step_result_to_json(t.result) if t.result is not None else None,
        "pruned_reason": t.pruned_reason, "detail": t.detail, "wall_s": t.wall_s,
    }


def trial_from_json(d: dict[str, Any]) -> TrialRecord:
    try:
        return TrialRecord(
            number=int(d["number"]), plan=dict(d["plan"]), state=TrialState(d["state"]),
            result=step_result_from_json(d["result"]) if d.get("result") else None,
            pruned_reason=d.get("pruned_reason"), detail=str(d.get("detail") or ""), wall_s=float(d.get("wall_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError("trial", f"not a trial record ({type(exc).__name__}: {exc})") from None


def outcome_to_json(o: SearchOutcome) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION,
        "model": o.model, "cluster": o.cluster, "space": o.space, "sampler": o.sampler, "seed": o.seed,
        "study_name": o.study_name, "storage": o.storage,
        "best": step_result_to_json(o.best) if o.best is not None else None,
        "ranked": [step_result_to_json(r) for r in o.ranked],
        "pareto": [step_result_to_json(r) for r in o.pareto],
        "pruned_counts": dict(o.pruned_counts), "pruned_by_knob": o.pruned_by_knob,
        "candidates_total": o.candidates_total, "traces_made": o.traces_made,
        "trace_cache_hits": o.trace_cache_hits, "wall_s": o.wall_s, "tokens_budget": o.tokens_budget,
        "notes": list(o.notes), "trials": [trial_to_json(t) for t in o.trials],
        "stack": o.stack, "memory_headroom_gib": o.memory_headroom_gib,
    }


def outcome_from_json(d: dict[str, Any]) -> SearchOutcome:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FileFormatError("search outcome", f"not an echo-plan search result (format {FORMAT!r} expected)")
    try:
        return SearchOutcome(
            model=dict(d["model"]), cluster=dict(d["cluster"]), space=dict(d["space"]), sampler=str(d["sampler"]),
            seed=int(d["seed"]), study_name=str(d["study_name"]), storage=str(d["storage"]),
            trials=tuple(trial_from_json(t) for t in d["trials"]),
            ranked=tuple(step_result_from_json(r) for r in d["ranked"]),
            pruned_counts={str(k): int(v) for k, v in d["pruned_counts"].items()},
            candidates_total=int(d["candidates_total"]), traces_made=int(d["traces_made"]),
            trace_cache_hits=int(d["trace_cache_hits"]), wall_s=float(d["wall_s"]),
            tokens_budget=None if d.get("tokens_budget") is None else float(d["tokens_budget"]),
            notes=tuple(d.get("notes") or ()),
            pareto=tuple(step_result_from_json(r) for r in d.get("pareto") or ()),
            pruned_by_knob=dict(d.get("pruned_by_knob") or {}),
            stack=dict(d.get("stack") or {}),
            memory_headroom_gib=None if d.get("memory_headroom_gib") is None else float(d["memory_headroom_gib"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError("search outcome", f"missing or bad field ({type(exc).__name__}: {exc})") from None


def compare_to_json(c: CompareOutcome) -> dict[str, Any]:
    return {
        "format": COMPARE_FORMAT, "version": VERSION, "model": c.model, "cluster": c.cluster,
        "tokens_budget": c.tokens_budget, "price_per_gpu_hour": c.price_per_gpu_hour, "wall_s": c.wall_s,
        "notes": list(c.notes),
        "rows": [
            {"num_gpus": r.num_gpus, "scaling_efficiency": r.scaling_efficiency, "train_time_s": r.train_time_s,
             "gpu_hours": r.gpu_hours, "cost": r.cost, "goodput_tokens_per_s": r.goodput_tokens_per_s,
             "effective_training_time_ratio": r.ettr, "train_time_with_failures_s": r.train_time_failures_s,
             "outcome": outcome_to_json(r.outcome)}
            for r in c.rows
        ],
    }


def compare_from_json(d: dict[str, Any]) -> CompareOutcome:
    if not isinstance(d, dict) or d.get("format") != COMPARE_FORMAT:
        raise FileFormatError("compare outcome", f"not an echo-plan compare result (format {COMPARE_FORMAT!r} expected)")

    def opt(x: Any) -> float | None:
        return None if x is None else float(x)

    try:
        rows = tuple(
            CompareRow(num_gpus=int(r["num_gpus"]), outcome=outcome_from_json(r["outcome"]),
                       scaling_efficiency=opt(r["scaling_efficiency"]), train_time_s=opt(r["train_time_s"]),
                       gpu_hours=opt(r["gpu_hours"]), cost=opt(r["cost"]),
                       goodput_tokens_per_s=opt(r.get("goodput_tokens_per_s")),
                       ettr=opt(r.get("effective_training_time_ratio")),
                       train_time_failures_s=opt(r.get("train_time_with_failures_s")))
            for r in d["rows"]
        )
        return CompareOutcome(model=dict(d["model"]), cluster=dict(d["cluster"]), rows=rows,
                              tokens_budget=opt(d.get("tokens_budget")),
                              price_per_gpu_hour=opt(d.get("price_per_gpu_hour")), wall_s=float(d["wall_s"]),
                              notes=tuple(d.get("notes") or ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise FileFormatError("compare outcome", f"missing or bad field ({type(exc).__name__}: {exc})") from None
