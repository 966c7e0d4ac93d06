"""Faults into the replay: per-stage slow-downs for ``simulate`` and what they cost, stage by stage.

``fault_hooks`` turns fault specs into what ``step_costs`` takes: a compute factor per pipeline stage
(``work_scale``), and for stages whose links are slow their own level-1 timings and collective
times, computed on the cluster as that stage sees it (``faults.slowed_cluster``). ``fault_summary``
reads, per stage, its busy time from the stage costs and its waiting time as the rest of the step:
the stages that wait are those whose neighbours or data-parallel peers are slower.
"""

from __future__ import annotations

from typing import Any

from echo_plan.specs.faults import Fault, check_faults, slowed_cluster, stage_effects


def fault_hooks(faults: tuple[Fault, ...], cluster, cluster_key: str, plan, traces, timing: dict, work_scale, memo,
                compute, comm, interference):
    """(effects, work_scale, stage_timing, stage_comm) for ``step_costs``."""
    check_faults(faults, plan, cluster)
    effects = stage_effects(faults, plan, cluster)
    scale = tuple((work_scale[i] if work_scale else 1.0) * e.compute_scale for i, e in enumerate(effects))
    clusters = [slowed_cluster(cluster, e) for e in effects]
    keys = [c.model_dump_json() if c is not cluster else cluster_key for c in clusters]
    per_stage: dict[int, dict] = {}

    def stage_timing(r: int) -> dict:
        if clusters[r] is cluster:
            return timing
        if r not in per_stage:
            per_stage[r] = memo.timings(traces, compute, comm, clusters[r], keys[r], plan, interference)
        return per_stage[r]

    def stage_comm(r: int):
        c, key = clusters[r], keys[r]

        def comm_time(kind, nbytes, group) -> float:
            return memo.comm_time(comm, key, c, kind, nbytes, group)
        return comm_time

    return effects, (scale if any(x != 1.0 for x in scale) else work_scale), stage_timing, stage_comm


def _busy(stage, microbatches: int, scale: float) -> float:
    per_mb = sum(f.work_s for f in stage.forward) + sum(b.work_s for b in stage.backward)
    return per_mb * microbatches * scale + stage.optimizer_s * scale


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
