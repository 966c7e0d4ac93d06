"""The analytical compute model against kernels measured on a GPU, op class by op class.

Run: .venv/bin/python benchmarks/kernel_accuracy.py [--db FILE] [--cluster h800] [--traces DIR] [--bandwidth]
     [--attention-library flash-attn-2] [--kernels pytorch]

The measured database (default: ``echo_plan/data/measured/h100_sxm5/H100-80GB-HBM3.json``, made
by ``echo-plan calibrate kernels --traces`` on an H100 SXM5 lent to this project on 2026-11-27) is keyed
by op and shapes; the ops come from traces. Without ``--traces`` the H100 validate suites are run into a
temporary trace cache first (about a minute on 2 cores), which makes the same traces the database was
measured from. For each class of op the table gives how many measured ops it holds, the median and the
10th/90th percentile of predicted/measured time, and the time-weighted ratio (sum predicted over sum
measured), over every op and over the ops that took 200 us or more. Measurements whose 10th and 90th
percentiles are over 25% apart are left out as noisy. Nothing is fitted here.

The model times attention with the cluster's default library (cuDNN's on Hopper) and GEMMs with its default kernel
family's figures; ``--attention-library`` and ``--kernels`` set them to a stack's (a database measured with
``calibrate kernels --sdpa-backend flash`` against ``--attention-library flash-attn-2 --kernels pytorch``: PyTorch's
FlashAttention-2 and aten GEMMs, as torchtitan, fms-fsdp and OLMo-core ran them). The database's SDPA backend is
printed with it (``auto`` where it was not named, as in the 2026-11-27 file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_plan.cost.kernel_db import KernelDatabase, compute_model_for, kernel_key  # noqa: E402
from echo_plan.specs import DType, load_cluster  # noqa: E402
from echo_plan.specs.software_kinds import AttentionLibrary, KernelFamily  # noqa: E402
from echo_plan.trace.cache import TraceCache  # noqa: E402
from echo_plan.trace.records import OpKind  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DB = ROOT / "echo_plan" / "data" / "measured" / "h100_sxm5" / "H100-80GB-HBM3.json"
SUITES = ("nemo_h100_dgxc", "moe_h100", "long_context_h100", "megatron_bridge_h100")


def op_class(op) -> str:
    if op.kind is OpKind.GEMM:
        if "grouped" in op.name:
            return "gemm grouped fp8"
        return "gemm fp8" if "_scaled_mm" in op.name else "gemm bf16"
    if op.kind is OpKind.ATTENTION:
        return "attention backward" if "backward" in op.name else "attention forward"
    return op.kind.value


def fill_cache(folder: Path) -> None:
    env = dict(os.environ, ECHO_PLAN_CACHE_DIR=str(folder))
    exe = Path(sys.executable).parent / "echo-plan"
    for suite in SUITES:
        print(f"  tracing the rows of {suite} ...", file=sys.stderr, flush=True)
        subprocess.run([str(exe), "validate", "--suite", suite, "--json"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _analytical(cluster, library: str | None = None, kernels: str | None = None):
    with tempfile.TemporaryDirectory() as empty:  # the analytical model alone, even where kernels/ serves
        model = compute_model_for(cluster, empty, kernels=kernels)
    return model.with_attention_library(library) if library else model


def measured_ops(db: KernelDatabase, traces):
    """(trace, op, entry) once per distinct kernel the database measured soundly (p10 and p90 within 25%)."""
    seen = set()
    for trace in traces:
        for op in trace.ops:
            key = kernel_key(op)
            if op.kind in (OpKind.VIEW, OpKind.COLLECTIVE) or key in seen:
                continue
            seen.add(key)
            entry = db.lookup(op)
            if entry is not None and entry.p90_us <= 1.25 * entry.p10_us:
                yield trace, op, entry


def compare(db: KernelDatabase, traces, cluster_name: str, library: str | None = None,
            kernels: str | None = None) -> dict[str, list[tuple[float, float]]]:
    cluster = load_cluster(cluster_name)
    model = _analytical(cluster, library, kernels)
    groups: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for trace, op, entry in measured_ops(db, traces):
        predicted = model.op_time(op, cluster.gpu, DType(trace.key.dtype)) * 1e6
        groups[op_class(op)].append((predicted, entry.median_us))
    return groups


MEMORY_BOUND = (OpKind.ELEMENTWISE, OpKind.COPY, OpKind.EMBEDDING, OpKind.REDUCTION, OpKind.NORM, OpKind.SOFTMAX)


def bandwidth(db: KernelDatabase, traces, cluster_name: str, min_us: float = 100.0) -> None:
    """What the measured memory-bound ops reach of the GPU's HBM bandwidth (bytes as the trace counts them over the
    measured time), op by op, beside the fraction the model assumes for the op's kind (compute.yaml's
    hbm_efficiency times the preset's memory_bandwidth_scale). Ops under ``min_us`` are left out: their time is
    mostly launch."""
    cluster = load_cluster(cluster_name)
    model = _analytical(cluster)
    peak = cluster.gpu.hbm_bw_GBps * 1e9
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for _, op, entry in measured_ops(db, traces):
        moved = op.bytes_read + op.bytes_written
        if op.kind not in MEMORY_BOUND or entry.median_us < min_us or moved == 0:
            continue
        name = op.name.split(".")[1] if "." in op.name else op.name
        by[(op.kind.value, name)].append(moved / (entry.median_us * 1e-6) / peak)
    print(f"\nmemory-bound ops of {min_us:.0f} us or more: the measured fraction of {cluster.gpu.name}'s "
          f"{cluster.gpu.hbm_bw_GBps:,.0f} GB/s, against the model's for the kind")
    print(f"{'kind':12s} {'op':32s} {'n':>4s} {'median':>7s} {'min':>6s} {'max':>6s} {'model':>6s}")
    for (kind, name), fracs in sorted(by.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        assumed = model.constants.hbm_efficiency.get(OpKind(kind), model.constants.hbm_efficiency[OpKind.OTHER])
        print(f"{kind:12s} {name:32s} {len(fracs):4d} {statistics.median(fracs):7.2f} {min(fracs):6.2f} "
              f"{max(fracs):6.2f} {assumed:6.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", type=Path, default=DEFAULT_DB)
    parser.add_argument("--cluster", default="h800")
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--attention-library", choices=[a.value for a in AttentionLibrary], default=None,
                        help="time attention as this library's kernels (default: the cluster's, cuDNN on Hopper)")
    parser.add_argument("--kernels", choices=[k.value for k in KernelFamily], default=None,
                        help="the kernel family whose compute figures time the ops (default: the cluster's default)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="also print what each measured memory-bound op reaches of the HBM bandwidth")
    args = parser.parse_args(argv)
    db = KernelDatabase.load(args.db)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.traces
        if folder is None:
            folder = Path(tmp)
            fill_cache(folder)
        traces, _ = TraceCache(folder).stored()
        groups = compare(db, traces, args.cluster, args.attention_library, args.kernels)
    print(f"measured: {db.gpu.name} ({len(db)} ops, {db.provenance.get('date')}, SDPA backend "
          f"{db.provenance.get('sdpa_backend', 'auto')}); model: {args.cluster} preset, analytical with its calibration"
          f" (attention {args.attention_library or 'default'}, kernels {args.kernels or 'default'}); {len(traces)} traces")
    print(f"{'class':22s} {'n':>5s} {'median':>7s} {'p10':>6s} {'p90':>6s} {'weighted':>8s} {'n>=200us':>8s} "
          f"{'weighted':>8s} {'measured ms':>11s}")
    for name, rows in sorted(groups.items(), key=lambda kv: -sum(m for _, m in kv[1])):
        ratios = sorted(p / m for p, m in rows)
        big = [(p, m) for p, m in rows if m >= 200]
        big_w = f"{sum(p for p, _ in big) / sum(m for _, m in big):8.3f}" if big else f"{'-':>8s}"
        print(f"{name:22s} {len(rows):5d} {statistics.median(ratios):7.3f} {ratios[len(ratios) // 10]:6.3f} "
              f"{ratios[(9 * len(ratios)) // 10]:6.3f} {sum(p for p, _ in rows) / sum(m for _, m in rows):8.3f} "
              f"{len(big):8d} {big_w} {sum(m for _, m in rows) / 1e3:11.1f}")
    if args.bandwidth:
        bandwidth(db, traces, args.cluster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
