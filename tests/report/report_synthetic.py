"""Realistic synthetic search and compare outcomes for the report tests and benchmark.

The numbers follow simple closed forms (not echo-plan's simulator) shaped like GPT-3 175B on H800s:
memory from parameter counts and sharding, step time from compute plus bubble and communication
terms, a 1F1B timeline from a tiny event simulation. They are test data, not predictions.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from echo_plan.cost.stage_memory import StageMemory
from echo_plan.replay.results import Breakdown, StepResult, TimelineEvent
from echo_plan.search.results import CompareOutcome, CompareRow, SearchOutcome, TrialRecord, TrialState

GiB = 2**30
MODEL = {"name": "gpt3-175b", "num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96,
         "num_kv_heads": 96, "ffn_hidden_size": 49152, "vocab_size": 51200, "seq_length": 2048,
         "activation": "gelu", "norm": "layernorm", "position_embedding": "learned", "tied_embeddings": True,
         "source": "Brown et al. 2020"}


def cluster(nodes: int = 12) -> dict[str, Any]:
    return {"name": "h800", "gpus_per_node": 8, "num_nodes": nodes, "nvlink_latency_us": 0.6,
            "gpu": {"name": "H800-SXM5-80GB", "peak_bf16_tflops": 989.4, "peak_fp16_tflops": 989.4,
                    "peak_fp32_tflops": 66.9, "peak_fp8_tflops": 1978.9, "hbm_GiB": 80, "hbm_bw_GBps": 3350,
                    "nvlink_bw_GBps": 400, "nvlink_links": 8, "nvlink_link_bw_GBps": 20.6, "sm_count": 132,
                    "sm_arch": 90, "nvls": True},
            "network": {"nics_per_node": 8, "nic_bw_Gbps": 400, "nic_efficiency": 0.94,
                        "fabric": "rail-optimized", "oversubscription": 1.0, "latency_us": 5.0},
            "sources": ["Feng et al. 2024, Echo (12 x 8 H800 cluster)", "NVIDIA H100 datasheet"],
            "calibration": {}}


def plan(tp: int, pp: int, dp: int, mbs: int = 1, vpp: int = 1, recompute: str = "none", sp: bool = False,
         dopt: bool = False, gbs: int = 1536) -> dict[str, Any]:
    return {"tp": tp, "pp": pp, "dp": dp, "micro_batch_size": mbs, "global_batch_size": gbs,
            "virtual_stages": vpp, "schedule": "interleaved" if vpp > 1 else "1f1b", "recompute": recompute,
            "sequence_parallel": sp and tp > 1, "distributed_optimizer": dopt, "overlap_grad_reduce": True,
            "overlap_param_gather": True, "dtype": "bf16", "layer_split": None}


def one_f_one_b(pp: int, m: int, f_s: float, b_s: float, p2p_s: float, dp_s: float,
                opt_s: float) -> tuple[TimelineEvent, ...]:
    """Events of a 1F1B step: per stage, warm-up forwards, steady 1F1B, cool-down backwards."""
    orders = []
    for s in range(pp):
        warm = min(pp - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
            b += 1
        orders.append(seq)
    done: dict[tuple[str, int, int], float] = {}
    events: list[TimelineEvent] = []
    ptr, free = [0] * pp, [0.0] * pp
    while any(ptr[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while ptr[s] < len(orders[s]):
                kind, i = orders[s][ptr[s]]
                dep = ("F", s - 1, i) if kind == "F" and s > 0 else ("B", s + 1, i) if kind == "B" and s < pp - 1 \
                    else None
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + p2p_s if dep is not None else 0.0
                if dep is not None:
                    events.append(TimelineEvent(s, "pp_comm", f"recv {kind} mb{i}", done[dep], p2p_s, "p2p"))
                start = max(free[s], ready)
                dur = f_s if kind == "F" else b_s
                events.append(TimelineEvent(s, "compute", f"{kind} mb{i}", start, dur,
                                            "forward" if kind == "F" else "backward", {"microbatch": i}))
                free[s] = done[(kind, s, i)] = start + dur
                ptr[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B order deadlocked")
    end = max(free)
    for s in range(pp):
        events.append(TimelineEvent(s, "dp_comm", "grad reduce-scatter", free[s] - 0.3 * dp_s, dp_s, "dp"))
        events.append(TimelineEvent(s, "compute", "optimizer step", end + 0.7 * dp_s, opt_s, "optimizer"))
    return tuple(events)


def result(p: dict[str, Any], num_gpus: int, rng: random.Random, timeline: bool = False) -> StepResult:
    tp, pp, dp, mbs = p["tp"], p["pp"], p["dp"], p["micro_batch_size"]
    params = 175e9 / (tp * pp)
    m = p["global_batch_size"] // (dp * mbs)
    act_per_mb = 2048 * mbs * 12288 * 96 / pp * {"none": 34, "selective": 18, "full": 2}[p["recompute"]] / tp
    memory = tuple(StageMemory(
        stage=s, weights_bytes=int(2 * params), gradients_bytes=int(4 * params),
        optimizer_bytes=int(12 * params / (dp if p["distributed_optimizer"] else 1)),
        activations_bytes=int(act_per_mb * min(pp - s, m)), buffers_bytes=int(1.5 * GiB), capacity_bytes=80 * GiB)
        for s in range(pp))
    tokens = p["global_batch_size"] * 2048
    flops = 6 * 175e9 * tokens
    eff = 0.55 - 0.03 * (tp > 8) + 0.02 * min(mbs, 2) + rng.uniform(-0.04, 0.04)
    compute = flops / num_gpus / (989.4e12 * eff) * (1 + {"none": 0, "selective": 0.03, "full": 0.33}[p["recompute"]])
    bubble = compute * (pp - 1) / (m * p["virtual_stages"])
    bd = Breakdown(compute_s=compute, tp_comm_exposed_s=compute * 0.02 * (tp - 1) / (2 if p["sequence_parallel"] else 1),
                   pp_comm_exposed_s=0.004 * m * (pp > 1), dp_comm_exposed_s=0.05 * (dp > 1) * rng.uniform(0.5, 1.5),
                   bubble_s=bubble, interference_s=compute * 0.03, optimizer_s=0.04 / (dp if p["distributed_optimizer"] else 1))
    step = bd.total_s
    r = StepResult(model="gpt3-175b", cluster="h800", num_gpus=num_gpus, plan=p, step_time_s=step,
                      tokens_per_s=tokens / step, model_tflops_per_gpu=flops / step / num_gpus / 1e12,
                      hardware_tflops_per_gpu=flops / step / num_gpus / 1e12 * 1.1,
                      mfu=flops / step / num_gpus / 989.4e12, memory=memory, breakdown=bd)
    return with_timeline(r) if timeline else r


def with_timeline(r: StepResult) -> StepResult:
    """The result with a 1F1B timeline made from its own breakdown."""
    p = r.plan
    m = p["global_batch_size"] // (p["dp"] * p["micro_batch_size"])
    f = r.breakdown.compute_s / m / 3
    events = one_f_one_b(p["pp"], m, f, 2 * f, 0.003, r.breakdown.dp_comm_exposed_s + 0.1, r.breakdown.optimizer_s)
    return replace(r, timeline=events)


def candidate_plans(num_gpus: int, gbs: int = 1536) -> list[dict[str, Any]]:
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 3, 4, 6, 8, 12, 16, 24):
            if num_gpus % (tp * pp) or 96 % pp:
                continue
            dp = num_gpus // (tp * pp)
            if gbs % dp:
                continue
            for mbs in (1, 2, 4):
                for vpp in (1, 2):
                    for rc in ("none", "selective", "full"):
                        for dopt in (False, True):
                            if gbs % (dp * mbs) or (vpp > 1 and (pp == 1 or (gbs // (dp * mbs)) % pp
                                                                  or 96 % (pp * vpp))):
                                continue
                            out.append(plan(tp, pp, dp, mbs, vpp, rc, tp > 1, dopt, gbs))
    return out


def search_outcome(n_trials: int = 60, seed: int = 0, nodes: int = 12, timeline: bool = True,
                   gbs: int = 1536) -> SearchOutcome:
    rng = random.Random(seed)
    num_gpus = nodes * 8
    cands = candidate_plans(num_gpus, gbs)
    trials = []
    pruned: dict[str, int] = {}
    reasons = ("tp exceeds a node", "out of memory (estimate)", "pp x virtual stages does not divide layers")
    for n in range(n_trials):
        p = rng.choice(cands)
        roll = rng.random()
        if roll < 0.15:
            reason = reasons[n % len(reasons)]
            pruned[reason] = pruned.get(reason, 0) + 1
            trials.append(TrialRecord(n, p, TrialState.PRUNED, pruned_reason=reason, detail=f"{reason} ({n})"))
        elif roll < 0.17:
            trials.append(TrialRecord(n, p, TrialState.FAILED, detail="simulated failure"))
        else:
            trials.append(TrialRecord(n, p, TrialState.COMPLETE, result=result(p, num_gpus, rng), wall_s=0.2))
    fitting: dict[str, StepResult] = {}
    for t in trials:
        if t.result is not None and t.result.fits:
            fitting.setdefault(repr(sorted(t.plan.items())), t.result)
    ranked = sorted(fitting.values(), key=lambda r: r.step_time_s)
    if ranked and timeline:
        ranked[0] = with_timeline(ranked[0])
    by_knob: dict[str, dict[str, dict[str, int]]] = {}
    simulated = {repr(sorted(t.plan.items())): t.plan for t in trials if t.result is not None}
    for knob in ("tp", "pp", "recompute"):
        for c in cands + [plan(16, 1, num_gpus // 16)]:  # tp16 stands for a value every plan of fails
            row = by_knob.setdefault(knob, {}).setdefault(str(c[knob]), {"candidates": 0, "valid": 0, "evaluated": 0})
            row["candidates"] += 1
            if c["tp"] > 8:
                row["tp exceeds a node"] = row.get("tp exceeds a node", 0) + 1
            else:
                row["valid"] += 1
        for p in simulated.values():
            by_knob[knob][str(p[knob])]["evaluated"] += 1
    return SearchOutcome(model=MODEL, cluster=cluster(nodes), space={"file": "search_spaces/default.yaml",
                                                                     "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8]},
                         sampler="tpe", seed=seed, study_name=f"gpt3-175b-h800-{num_gpus}", storage="sqlite:///x.db",
                         trials=tuple(trials), ranked=tuple(ranked), pruned_counts=pruned,
                         candidates_total=len(cands), traces_made=12, trace_cache_hits=40, wall_s=95.0,
                         tokens_budget=300e9, pruned_by_knob=by_knob)


def compare_outcome(nodes: tuple[int, ...] = (6, 12, 24), n_trials: int = 40, price: float | None = 2.5,
                    gbs: int = 1536) -> CompareOutcome:
    rows = []
    base = None
    for k, n in enumerate(nodes):
        o = search_outcome(n_trials, seed=k, nodes=n, gbs=gbs)
        b = o.best
        if b is None:
            rows.append(CompareRow(n * 8, o, None, None, None, None))
            continue
        base = base or b.tokens_per_s / (n * 8)
        t = 300e9 / b.tokens_per_s
        hours = t / 3600 * n * 8
        rows.append(CompareRow(n * 8, o, b.tokens_per_s / (n * 8) / base, t, hours,
                               None if price is None else hours * price))
    return CompareOutcome(model=MODEL, cluster=cluster(nodes[0]), rows=tuple(rows), tokens_budget=300e9,
                          price_per_gpu_hour=price, wall_s=300.0)
