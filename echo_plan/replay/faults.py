"""What faults cost a replayed step, stage by stage.

``simulate`` turns fault specs into what ``step_costs`` takes (a compute factor per pipeline stage, and
for stages whose links are slow their own level-1 timings and collective times, computed on the
cluster as that stage sees it: ``specs/faults.py``'s ``slowed_cluster``). ``fault_summary`` reads, per stage, its busy time from the stage costs and its waiting time as the rest of the step:
the stages that wait are those whose neighbours or data-parallel peers are slower.
"""

from __future__ import annotations

from typing import Any

from echo_plan.specs.faults import Fault


def _busy(stage, microbatches: int, scale: float) -> float:
    per_mb = sum(f.work_s for f in stage.forward) + sum(b.work_s for b in stage.backward)
    return per_mb * microbatches * scale + stage.optimizer_time(scale)


def fault_summary(faults: tuple[Fault, ...], effects, costs, step_s: float, healthy, plan) -> dict[str, Any]:
    """The JSON of a faulty step: faults as applied, and per stage what it does and how long it waits."""
    m = plan.num_microbatches
    stages = []
    for r, (st, e) in enumerate(zip(costs.stages, effects)):
        scale = costs.work_scale[r] if costs.work_scale else 1.0
        busy = _busy(st, m, scale)
        stages.append({"stage": r, "causes": list(e.causes), "compute_scale": e.compute_scale,
                       "network_bw": e.net_bw, "nvlink_bw": e.nvlink_bw, "busy_s": busy,
                       "wait_s": max(0.0, step_s - busy),
                       "dp_reduce_s": sum(b.reduce_s + b.gather_s for bs in st.buckets for b in bs)})
    applied = []
    for f in faults:
        hit = [s["stage"] for s in stages if f.label() in s["causes"]]
        applied.append({**f.as_json(), "stages": hit, "note": "" if hit else "hits no GPU this plan uses"})
    return {"healthy_step_time_s": healthy.step_time_s, "slowdown": step_s / healthy.step_time_s - 1.0,
            "applied": applied, "stages": stages}
