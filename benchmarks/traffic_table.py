"""ECMP vs planned routing (C4P) on the h800 preset's fabric: collective and step times (docs/traffic.md).

    PYTHONPATH=. .venv/bin/python benchmarks/traffic_table.py [--flows 1,4,16] [--quick]

For GPT-3 175B and DeepSeek-V3 plans on the h800 preset (32 servers per leaf and rail plane, 32
uplinks per leaf; DeepSeek's H800 multi-plane fat-tree) at several sizes, servers filling leaves in
order (and once scattered round-robin over the leaves, as a busy scheduler may), prints two Markdown
tables: the step time under each routing (none, planned, ECMP with N flows per connection), and for
every collective group whose flows cross leaves, its time at its largest message under planned
routing and under ECMP (expected over hash draws, and the 99th percentile, which is what one job in
a hundred sees every step, since a job's flows keep their hash). Deterministic: same output every run.
"""

from __future__ import annotations

import argparse
import time

GPT3_1024 = dict(tp=8, pp=8, dp=16, global_batch_size=1536, sequence_parallel=True, recompute="selective",
                 distributed_optimizer=True)
CASES = [  # (label, model, GPUs, plan fields[, server placement over leaves])
    ("GPT-3 175B, 96 GPUs (Echo's 12 servers)", "gpt3-175b", 96,
     dict(tp=8, pp=12, dp=1, global_batch_size=1536, sequence_parallel=True, recompute="selective",
          distributed_optimizer=True)),
    ("GPT-3 175B, 1,024 GPUs", "gpt3-175b", 1024, GPT3_1024),
    ("GPT-3 175B, 1,024 GPUs, servers round-robin over leaves", "gpt3-175b", 1024, GPT3_1024, "round-robin"),
    ("GPT-3 175B, 4,096 GPUs", "gpt3-175b", 4096,
     dict(tp=8, pp=8, dp=64, global_batch_size=1536, sequence_parallel=True, recompute="selective",
          distributed_optimizer=True)),
    ("DeepSeek-V3, 2,048 GPUs", "deepseek-v3", 2048,
     dict(tp=1, pp=16, dp=128, ep=64, global_batch_size=15360, distributed_optimizer=True, layer_split="auto")),
]


def plan_for(model, fields):
    from echo_plan.specs import PlanSpec
    from echo_plan.specs.plan import balanced_split

    fields = dict(fields)
    if fields.pop("layer_split", None) == "auto":
        fields["layer_split"] = balanced_split(model.num_layers, fields["pp"])
    return PlanSpec.build(fields, context="plan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flows", default="1,4,16", help="flows per connection under ECMP")
    ap.add_argument("--quick", action="store_true", help="GPT-3 at 1,024 GPUs only (both placements)")
    args = ap.parse_args()
    flows = [int(x) for x in args.flows.split(",")]

    from echo_plan.simulate import SimulationMemo, simulate
    from echo_plan.specs import load_cluster, load_model
    from echo_plan.trace.cache import TraceCache

    cache, memo = TraceCache(None), SimulationMemo()
    cases = [c for c in CASES if not args.quick or c[2] == 1024]
    step_rows, group_rows = [], []
    t0 = time.perf_counter()
    for label, model_name, gpus, fields, *placement in cases:
        model = load_model(model_name)
        base = load_cluster("h800", gpus=gpus)
        if placement:
            base = base.replace(network=base.network.replace(placement=placement[0]).model_dump())
        plan = plan_for(model, fields)

        def run(routing, k=1, traffic=False):
            return simulate(model, base.with_routing(routing, k), plan, cache=cache, memo=memo, traffic=traffic)

        none, planned = run("none"), run("planned")
        ecmp = {k: run("ecmp", k, traffic=k == flows[0]) for k in flows}
        steps = [none.step_time_s, planned.step_time_s] + [ecmp[k].step_time_s for k in flows]
        slow = ecmp[flows[0]].step_time_s / planned.step_time_s - 1.0
        step_rows.append(f"| {label}, {plan.short()} | {base.num_leaves} | " + " | ".join(f"{s:.3f}" for s in steps)
                         + f" | {slow:+.1%} |")
        by_k = {k: {g["group"]: g for g in ecmp[k].traffic["groups"]} for k in flows[:1]}
        for g in by_k[flows[0]].values():
            if not g["crosses_leaves"]:
                continue
            s = g["slowdown"]
            group_rows.append(
                f"| {label} | {g['group']} | {g['bytes'] / 2**20:,.1f} MiB | {s['cross_leaf_flows']:,} | "
                f"{g['time_planned_s'] * 1e3:.3f} | {g['time_ecmp_expected_s'] * 1e3:.3f} | "
                f"x{s['expected']:.2f} / x{s['p99']:.2f} / x{s['worst']:.1f} |")
        if not any(g["crosses_leaves"] for g in by_k[flows[0]].values()):
            group_rows.append(f"| {label} | (every group stays inside one leaf) | | | | | |")

    print("Step time (s) on the h800 preset's fabric (64-port leaves, 32 servers per leaf and rail plane, "
          "32 uplinks); ECMP expected over hash draws\n")
    print("| case | leaves per plane | none | planned (C4P) | " + " | ".join(f"ECMP, {k} flow(s)" for k in flows)
          + f" | ECMP {flows[0]} vs planned |")
    print("|---|---|---|---|" + "---|" * len(flows) + "---|")
    for r in step_rows:
        print(r)
    print(f"\nCollective groups that cross leaves, at their largest message, ECMP with {flows[0]} flow(s) per "
          "connection\n")
    print("| case | group (n ranks, stride s) | message | cross-leaf flows | planned ms | ECMP ms (expected) | "
          "ECMP slowdown expected / p99 / worst |")
    print("|---|---|---|---|---|---|---|")
    for r in group_rows:
        print(r)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
