"""Closed loop for ``echo-plan diagnose`` (issue 15, C4D), and its speed on a 1,024-GPU job.

1. Faults: ``--faults`` random single faults (a slow GPU, a slow server, a slow NIC, slow NVLink,
   a hung GPU, a hung NIC; random place and severity) on several plans and clusters, each emitted
   as ``simulate --emit-records`` does (random format among flight-recorder, jsonl, csv, with
   ``--noise`` timing noise) and diagnosed: the share with the right syndrome and component, and
   with the right place too (the rank, or the server for server-wide faults).
2. Healthy: ``--healthy`` runs without a fault: the share where no fault is named.
3. Speed: records of a 1,024-GPU job (flight-recorder dumps of 2,000 entries per rank, torch's
   default buffer) diagnosed end to end (reading included); prints the seconds.

    PYTHONPATH=. python benchmarks/diagnose_bench.py [--faults 200 --healthy 100 --noise 0.03 --seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from echo_plan.resilience.diagnose.analyze import diagnose_paths
from echo_plan.resilience.diagnose.parallel_load import processes_for
from echo_plan.resilience.diagnose.emit import RecordFormat, emit_job, prepare_job
from echo_plan.specs.faults import nic_ranks, parse_fault
from echo_plan.specs import PlanSpec, load_cluster, load_model

# (model, cluster, nodes, tp, pp, micro-batches per DP rank): several shapes of group and placement
SETUPS = [
    ("llama2-7b", "h800", 4, 4, 2, 4),  # TP inside half a server, DP across servers
    ("llama2-7b", "dgx-h100", 4, 8, 2, 4),  # TP = a whole server
    ("gpt-13b", "dgx-a100", 4, 2, 4, 4),  # deeper pipeline, DP partly inside a server
    ("llama3-8b", "h800", 2, 2, 1, 2),  # no pipeline: DP only between TP pairs
]
EXPECT = {"straggler": ("non_communication_slow", "gpu"), "node": ("non_communication_slow", "gpu"),
          "link": ("communication_slow", "nic"), "nvlink": ("communication_slow", "nvlink"),
          "gpu-hang": ("non_communication_hang", "gpu"), "nic-hang": ("communication_hang", "nic")}


def random_fault(rng: random.Random, plan, cluster) -> str:
    kinds = ["straggler", "node", "nvlink", "gpu-hang"] + (["link", "nic-hang"] if cluster.num_nodes > 1 else [])
    kind = rng.choice(kinds)
    rank, node = rng.randrange(plan.world_size), rng.randrange(cluster.num_nodes)
    nic = rng.randrange(cluster.network.nics_per_node)
    if kind == "straggler":
        return f"straggler:rank={rank},compute={rng.uniform(1.2, 2.0):.2f}"
    if kind == "node":
        return f"node:node={node},compute={rng.uniform(1.2, 2.0):.2f}"
    if kind == "link":
        return f"link:node={node},nic={nic},bw={rng.uniform(0.2, 0.6):.2f}"
    if kind == "nvlink":
        return f"nvlink:node={node},bw={rng.uniform(0.2, 0.6):.2f}"
    if kind == "gpu-hang":
        return f"gpu-hang:rank={rank}"
    return f"nic-hang:node={node},nic={nic}"


def place_right(fault, top, cluster) -> bool:
    if top is None:
        return False
    kind = fault.kind.value
    if kind in ("straggler", "gpu-hang"):
        return top["rank"] == int(fault.get("rank"))
    if kind in ("node", "nvlink"):
        return top["node"] == int(fault.get("node"))
    ranks = set(nic_ranks(int(fault.get("node")), int(fault.get("nic")), cluster))
    return top["rank"] in ranks or top.get("peer") in ranks


def closed_loop(n_faults: int, n_healthy: int, noise: float, seed: int) -> None:
    rng = random.Random(seed)
    jobs = []
    for model, cl, nodes, tp, pp, m in SETUPS:
        cluster = load_cluster(cl, nodes=nodes)
        dp = cluster.num_gpus // (tp * pp)
        plan = PlanSpec.build(dict(tp=tp, pp=pp, dp=dp, micro_batch_size=1, global_batch_size=m * dp), context="plan")
        jobs.append((f"{model} on {nodes}x {cl}, tp{tp} pp{pp} dp{dp}", cluster,
                     prepare_job(load_model(model), cluster, plan)))
    tmp = Path(tempfile.mkdtemp(prefix="diagnose_bench_"))
    per_kind: Counter = Counter()
    right_kind: Counter = Counter()
    right_place: Counter = Counter()
    misses = []
    t0 = time.perf_counter()
    try:
        for i in range(n_faults + n_healthy):
            name, cluster, job = jobs[i % len(jobs)]
            fmt = rng.choice(list(RecordFormat))
            healthy = i >= n_faults
            text = None if healthy else random_fault(rng, job[0], cluster)
            faults = () if healthy else (parse_fault(text),)
            out = tmp / f"run{i}"
            emit_job(job, faults, out=str(out), fmt=fmt, steps=2, noise=noise, seed=rng.randrange(1 << 30),
                     buffer=2000)
            d = diagnose_paths([str(out)], cluster.gpus_per_node).as_json()
            shutil.rmtree(out)
            top = d["suspects"][0] if d["suspects"] else None
            kind = "healthy" if healthy else faults[0].kind.value
            per_kind[kind] += 1
            want = ("healthy", None) if healthy else EXPECT[kind]
            got = (d["syndrome"], top["component"] if top else None)
            ok = got == want
            right_kind[kind] += ok
            right_place[kind] += ok and (healthy or place_right(faults[0], top, cluster))
            if not ok:
                misses.append(f"  {kind:<10} {text or '-':<38} {fmt.value:<15} {name}: got {got[0]} "
                              f"{got[1] or ''} ({d['verdict']})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    faulty = [k for k in per_kind if k != "healthy"]
    n_f = sum(per_kind[k] for k in faulty)
    print(f"closed loop: {n_f} single faults + {per_kind['healthy']} healthy runs, noise {noise:.0%}, "
          f"{len(jobs)} plans/clusters, {time.perf_counter() - t0:.0f} s")
    print(f"{'fault':<12}{'runs':>6}{'syndrome+component':>20}{'+ place':>10}")
    for k in sorted(faulty) + ["healthy"]:
        if per_kind[k]:
            print(f"{k:<12}{per_kind[k]:>6}{right_kind[k] / per_kind[k]:>20.1%}{right_place[k] / per_kind[k]:>10.1%}")
    if n_f:
        print(f"faults: right syndrome and component in {sum(right_kind[k] for k in faulty) / n_f:.1%} "
              f"(target >= 95%); right place as well in {sum(right_place[k] for k in faulty) / n_f:.1%}")
    if per_kind["healthy"]:
        print(f"healthy: no fault named in {right_kind['healthy'] / per_kind['healthy']:.1%} (target >= 95%)")
    if misses:
        print("misses:")
        print("\n".join(misses[:40]))


def speed(seed: int) -> None:
    model = load_model("gpt3-175b")
    cluster = load_cluster("h800", nodes=128)
    plan = PlanSpec.build(dict(tp=8, pp=8, dp=16, micro_batch_size=1, global_batch_size=16 * 16), context="plan")
    tmp = Path(tempfile.mkdtemp(prefix="diagnose_speed_"))
    try:
        t0 = time.perf_counter()
        job = prepare_job(model, cluster, plan)
        s = emit_job(job, (parse_fault("straggler:rank=517,compute=1.3"),), out=str(tmp / "r"),
                     fmt=RecordFormat.FLIGHT_RECORDER, steps=2, noise=0.03, seed=seed, buffer=2000)
        t1, c1 = time.perf_counter(), time.process_time()
        d = diagnose_paths([str(tmp / "r")], cluster.gpus_per_node)
        t2, c2 = time.perf_counter(), time.process_time()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"speed: {plan.world_size} GPUs, {d.records:,} flight-recorder entries ({s['records_per_rank_max']:,} "
          f"per rank): diagnosed in {t2 - t1:.1f} s wall (target < 10 s on 2 cores; files read by "
          f"{processes_for(plan.world_size)} processes), {c2 - c1:.1f} s of "
          f"this process's CPU, emitted in {t1 - t0:.0f} s; load average {os.getloadavg()[0]:.1f}; verdict: {d.verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", type=int, default=200)
    ap.add_argument("--healthy", type=int, default=100)
    ap.add_argument("--noise", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args()
    closed_loop(args.faults, args.healthy, args.noise, args.seed)
    if not args.no_speed:
        speed(args.seed)


if __name__ == "__main__":
    main()
