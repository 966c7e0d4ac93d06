"""Read Chakra ET files (``NAME.<rank>.et`` + ``NAME.comm_groups.json``) and replay them with
echo-plan's cost models: one replay device per rank, all ranks together.

* COMP_NODE: ``duration_micros`` as recorded; without one, a roofline from ``num_ops`` and
  ``tensor_size`` on the cluster's GPU. Kernel mix from echo-plan's ``echo_plan_mix`` attribute
  (GEMM when absent), for the interference model.
* COMM_COLL_NODE: the collective model's time for ``comm_type``, ``comm_size`` and the ranks of
  group ``pg_name``. Participants start together: each one's task also waits for what the other
  participants' matching node (the k-th on that group in their file) waits for.
* COMM_SEND_NODE: a point-to-point transfer of ``comm_size`` between ``comm_src`` and ``comm_dst``;
  the matching COMM_RECV_NODE (same src, dst and tag, in order) ends when it has arrived.
* Streams: the ``stream`` attribute when present (echo-plan writes one), else one per node type;
  a stream runs its nodes in dependency order (file order among independent ones).
* Anything else (memory, storage nodes, unknown types, collectives echo-plan does not model)
  takes no time, keeps its dependencies, and is reported.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo_plan.errors import FileFormatError
from echo_plan.files import parse_json, read_text
from echo_plan.interop import chakra_io as cio
from echo_plan.interop import chakra_schema as cs
from echo_plan.interop.chakra_export import MIX_ATTR
from echo_plan.replay.compiled.switch import CompiledSwitch
from echo_plan.replay.engine import Task, replay
from echo_plan.replay.kinds import TaskKind
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind
from echo_plan.cost.collectives import collective_model_for
from echo_plan.replay.interference import load_interference

KIND_OF_COMM_TYPE = {
    cs.COMM_TYPES["ALL_REDUCE"]: CollectiveKind.ALL_REDUCE,
    cs.COMM_TYPES["ALL_GATHER"]: CollectiveKind.ALL_GATHER,
    cs.COMM_TYPES["REDUCE_SCATTER"]: CollectiveKind.REDUCE_SCATTER,
    cs.COMM_TYPES["REDUCE_SCATTER_BLOCK"]: CollectiveKind.REDUCE_SCATTER,
    cs.COMM_TYPES["ALL_TO_ALL"]: CollectiveKind.ALL_TO_ALL,
    cs.COMM_TYPES["BROADCAST"]: CollectiveKind.BROADCAST,
}
DEFAULT_STREAM = {cs.COMP_NODE: "compute", cs.COMM_COLL_NODE: "comm", cs.COMM_SEND_NODE: "send",
                  cs.COMM_RECV_NODE: "recv"}


@dataclass(frozen=True, slots=True)
class ImportResult:
    step_time_s: float
    rank_time_s: dict[int, float]
    nodes: dict[str, int]  # node type name -> count, all ranks
    notes: tuple[str, ...]
    recorded_step_s: float | None  # what the producer said the step takes (echo-plan files)


def find_rank_files(prefix: str | Path) -> dict[int, Path]:
    base = Path(prefix)
    pattern = re.compile(re.escape(base.name) + r"\.(\d+)\.et$")
    folder = base.parent if str(base.parent) else Path(".")
    if not folder.is_dir():
        raise FileFormatError(str(folder), "no such folder")
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := pattern.match(p.name))}
    if not found:
        raise FileFormatError(str(base), f"no files {base.name}.<rank>.et in {folder}")
    return dict(sorted(found.items()))


def load_groups(prefix: str | Path) -> dict[str, tuple[int, ...]] | None:
    path = Path(f"{prefix}.comm_groups.json")
    if not path.exists():
        return None
    try:
        data = parse_json(read_text(path), str(path))
        return {str(k): tuple(int(r) for r in v) for k, v in data.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise FileFormatError(str(path), f"not a JSON object of group name -> list of ranks ({exc})")


def _group(ranks: tuple[int, ...]) -> tuple[CommGroup, bool]:
    """A CommGroup for ``ranks`` and whether it is exact (regularly strided)."""
    rs = sorted(ranks)
    if len(rs) <= 1:
        return CommGroup(GroupKind.WORLD, max(1, len(rs)), 1, rs[0] if rs else 0), True
    stride = rs[1] - rs[0]
    exact = stride > 0 and all(b - a == stride for a, b in zip(rs, rs[1:]))
    if not exact:
        stride = max(1, (rs[-1] - rs[0]) // (len(rs) - 1))
    return CommGroup(GroupKind.WORLD, len(rs), stride, rs[0]), exact


def _mix(node: cio.EtNode) -> tuple[TaskKind, tuple[tuple[TaskKind, float], ...] | None]:
    raw = node.attrs.get(MIX_ATTR)
    if not isinstance(raw, str) or not raw:
        return TaskKind.GEMM, None
    parts = []
    for item in raw.split(","):
        name, _, share = item.partition(":")
        try:
            kind = TaskKind(name)
            parts.append((kind, float(share)))
        except ValueError:
            return TaskKind.GEMM, None
    parts = [p for p in parts if p[1] > 0 and p[0].is_compute]
    if not parts:
        return TaskKind.GEMM, None
    return max(parts, key=lambda p: p[1])[0], tuple(parts)


def import_chakra(prefix: str | Path, cluster: ClusterSpec, *, comm: Any = None, interference: Any = None,
                  dtype: DType = DType.BF16) -> ImportResult:
    """Replay the ranks' graphs under ``prefix`` on ``cluster`` (see the module docstring)."""
    comm = comm if comm is not None else collective_model_for(cluster)
    interference = interference if interference is not None else load_interference(None)
    files = find_rank_files(prefix)
    groups = load_groups(prefix)
    notes: list[str] = []
    ets: dict[int, cio.EtFile] = {}
    for rank, path in files.items():
        et = cio.read_et(path)
        problems = cio.check_graph(et)
        if problems:
            raise FileFormatError(str(path), "; ".join(problems[:3]))
        ets[rank] = et
        notes.extend(f"rank {rank}: {n}" for n in et.notes)
    if groups is None:
        notes.append(f"no {Path(prefix).name}.comm_groups.json: every collective is taken to span the "
                     f"{len(ets)} ranks read")
    if max(ets) >= cluster.num_gpus:
        raise FileFormatError(str(files[max(ets)]), f"rank {max(ets)} does not exist on {cluster.name} "
                                                    f"({cluster.num_gpus} GPUs)")

    ordered = {r: cio.topological_order(et.nodes) or list(et.nodes) for r, et in ets.items()}
    tid: dict[tuple[int, int], int] = {}
    for r, nodes in ordered.items():
        for n in nodes:
            tid[(r, n.id)] = len(tid)

    # matching: the k-th collective on a group in each participant; the k-th send/recv of (src, dst, tag)
    coll_seq: dict[tuple[str, int], list[tuple[int, cio.EtNode]]] = {}
    sends: dict[tuple[int, int, int], list[int]] = {}
    counts: Counter[str] = Counter()
    seen: Counter[tuple] = Counter()
    for r, nodes in ordered.items():
        for n in nodes:
            counts[n.type_name] += 1
            if n.type == cs.COMM_COLL_NODE:
                pg = str(n.attrs.get("pg_name", ""))
                k = seen[("c", r, pg)]
                seen[("c", r, pg)] += 1
                coll_seq.setdefault((pg, k), []).append((r, n))
            elif n.type == cs.COMM_SEND_NODE:
                key = (int(n.attrs.get("comm_src", r)), int(n.attrs.get("comm_dst", -1)), int(n.attrs.get("comm_tag", 0)))
                sends.setdefault(key, []).append(tid[(r, n.id)])

    skipped: Counter[str] = Counter()
    unmatched = 0
    recv_seen: Counter[tuple] = Counter()
    gpu = cluster.gpu
    tasks: list[Task] = []
    for r, nodes in ordered.items():
        coll_k: Counter[str] = Counter()
        for n in nodes:
            deps = [tid[(r, d)] for d in n.deps]
            stream = str(n.attrs.get("stream") or DEFAULT_STREAM.get(n.type, "other"))
            work, kind, mix = 0.0, TaskKind.DELAY, None
            if n.type == cs.COMP_NODE:
                kind, mix = _mix(n)
                if n.duration_micros:
                    work = n.duration_micros * 1e-6
                else:
                    flops, size = float(n.attrs.get("num_ops", 0) or 0), float(n.attrs.get("tensor_size", 0) or 0)
                    work = max(flops / (gpu.peak_tflops(dtype) * 1e12), size / (gpu.hbm_bw_GBps * 1e9))
            elif n.type == cs.COMM_COLL_NODE:
                pg = str(n.attrs.get("pg_name", ""))
                k = coll_k[pg]
                coll_k[pg] += 1
                ctype = int(n.attrs.get("comm_type", -1))
                ckind = KIND_OF_COMM_TYPE.get(ctype)
                ranks = groups.get(pg) if groups is not None else tuple(sorted(ets))
                if ranks is None:
                    raise FileFormatError(str(files[r]), f"node {n.id} ({n.name}) names group {pg!r}, which the "
                                                         "comm_groups.json does not define")
                if ckind is None:
                    skipped[f"collective {cs.COMM_TYPE_NAMES.get(ctype, ctype)}"] += 1
                else:
                    group, exact = _group(ranks)
                    if not exact:
                        skipped[f"irregular group {pg} costed as a strided one"] += 1
                    work = comm.time(ckind, int(n.attrs.get("comm_size", 0)), group, cluster).time_s
                    kind = TaskKind.from_collective(ckind)
                for pr, pn in coll_seq.get((pg, k), ()):
                    if pr != r:
                        deps.extend(tid[(pr, d)] for d in pn.deps)
            elif n.type == cs.COMM_SEND_NODE:
                src, dst = int(n.attrs.get("comm_src", r)), int(n.attrs.get("comm_dst", -1))
                size = int(n.attrs.get("comm_size", 0))
                if dst < 0 or dst == src:
                    raise FileFormatError(str(files[r]), f"send node {n.id} has no valid comm_dst")
                group = CommGroup(GroupKind.PP, 2, abs(dst - src), min(src, dst))
                work = comm.time(CollectiveKind.SEND_RECV, size, group, cluster).time_s
                kind = TaskKind.P2P
            elif n.type == cs.COMM_RECV_NODE:
                src, dst = int(n.attrs.get("comm_src", -1)), int(n.attrs.get("comm_dst", r))
                key = (src, dst, int(n.attrs.get("comm_tag", 0)))
                k = recv_seen[key]
                recv_seen[key] += 1
                match = sends.get(key, [])
                if k < len(match):
                    deps.append(match[k])
                else:  # the sender's file was not read: the receive waits for the transfer itself
                    unmatched += 1
                    if 0 <= src != dst:
                        group = CommGroup(GroupKind.PP, 2, abs(dst - src), min(src, dst))
                        work = comm.time(CollectiveKind.SEND_RECV, int(n.attrs.get("comm_size", 0)), group, cluster).time_s
                        kind = TaskKind.P2P
            else:
                skipped[f"{n.type_name} node"] += 1
            tasks.append(Task(tid[(r, n.id)], r, stream, work, kind, tuple(dict.fromkeys(deps)), n.name, mix=mix))
    for what, count in sorted(skipped.items()):
        notes.append(f"{count} x {what}: no time modelled")
    if unmatched:
        notes.append(f"{unmatched} receive(s) whose sender file was not read: timed as the transfer alone")
    try:
        result = replay(tasks, interference, CompiledSwitch.from_environment())  # one large graph: compiled where it pays
    except ValueError as exc:
        raise FileFormatError(str(prefix), f"the ranks' graphs cannot be replayed: {exc}") from None
    recorded = next(iter(ets.values())).metadata.get("simulated_step_s")
    return ImportResult(
        step_time_s=result.makespan_s,
        rank_time_s={r: result.device_end(r) for r in ets},
        nodes=dict(sorted(counts.items())),
        notes=tuple(notes),
        recorded_step_s=float(recorded) if isinstance(recorded, (int, float)) else None,
    )
