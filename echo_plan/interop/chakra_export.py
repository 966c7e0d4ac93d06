"""Write a simulated step (``chakra_step.StepGraph``) as Chakra ET files, one per rank.

Ranks follow Megatron-LM's order (tensor-parallel fastest, then data-parallel, then pipeline):
``rank = stage * tp * dp + d * tp + t``. Every rank of a pipeline stage gets that stage's graph
with its own communicator groups and point-to-point peers. Files: ``NAME.<rank>.et`` and
``NAME.comm_groups.json`` (group name -> ranks, the ``pg_name`` of collective nodes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from echo_plan.errors import SpecError
from echo_plan.interop import chakra_io as cio
from echo_plan.interop import chakra_schema as cs
from echo_plan.interop.chakra_step import GNode, GroupRef, NodeKind, StepGraph
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import CollectiveKind
from echo_plan.files import write_atomic

COMM_TYPE = {
    CollectiveKind.ALL_REDUCE: cs.COMM_TYPES["ALL_REDUCE"],
    CollectiveKind.ALL_GATHER: cs.COMM_TYPES["ALL_GATHER"],
    CollectiveKind.REDUCE_SCATTER: cs.COMM_TYPES["REDUCE_SCATTER"],
    CollectiveKind.ALL_TO_ALL: cs.COMM_TYPES["ALL_TO_ALL"],
    CollectiveKind.BROADCAST: cs.COMM_TYPES["BROADCAST"],
}
MIX_ATTR = "echo_plan_mix"  # compute work shares by kernel kind, for echo-plan's interference model


@dataclass(frozen=True, slots=True)
class RankCoords:
    stage: int
    d: int
    t: int


def coords(rank: int, plan: PlanSpec) -> RankCoords:
    """``d`` counts the data-and-context-parallel ranks (dp x cp; Megatron-Core's order tp-cp-dp-pp:
    d = dp index x cp + cp index)."""
    per_stage = plan.stage_ranks
    stage, rest = divmod(rank, per_stage)
    d, t = divmod(rest, plan.tp)
    return RankCoords(stage, d, t)


def rank_of(c: RankCoords, plan: PlanSpec) -> int:
    return c.stage * plan.stage_ranks + c.d * plan.tp + c.t


def group_of(ref: GroupRef, c: RankCoords, plan: PlanSpec) -> tuple[str, tuple[int, ...]]:
    tp, dp, pp = plan.tp, plan.grad_dp, plan.pp
    base = c.stage * tp * dp
    if ref is GroupRef.TP:
        return f"tp_s{c.stage}_d{c.d}", tuple(base + c.d * tp + i for i in range(tp))
    if ref is GroupRef.DP:  # the gradient group: data- and context-parallel ranks
        return f"dp_s{c.stage}_t{c.t}", tuple(base + j * tp + c.t for j in range(dp))
    if ref is GroupRef.CP:
        first = c.d - c.d % plan.cp
        return f"cp_s{c.stage}_d{first}_t{c.t}", tuple(base + (first + i) * tp + c.t for i in range(plan.cp))
    if ref in (GroupRef.EP, GroupRef.ETP, GroupRef.EDP):  # Megatron-Core's expert order: etp, ep, edp
        etp, ep = plan.expert_tp, plan.ep
        local = c.d * tp + c.t
        i_etp, i_ep, i_edp = local % etp, (local // etp) % ep, local // (etp * ep)
        if ref is GroupRef.EP:
            return (f"ep_s{c.stage}_x{i_edp}_t{i_etp}",
                    tuple(base + i_edp * etp * ep + e * etp + i_etp for e in range(ep)))
        if ref is GroupRef.ETP:
            return f"etp_s{c.stage}_x{i_edp}_e{i_ep}", tuple(base + i_edp * etp * ep + i_ep * etp + j for j in range(etp))
        return (f"edp_s{c.stage}_e{i_ep}_t{i_etp}",
                tuple(base + x * etp * ep + i_ep * etp + i_etp for x in range(plan.edp)))
    first = c.d * tp + c.t
    return f"tied_d{c.d}_t{c.t}", (first, (pp - 1) * tp * dp + first)


def all_groups(plan: PlanSpec, graph: StepGraph) -> dict[str, list[int]]:
    refs = {n.group for stage in graph.stages for n in stage if n.group is not None}
    out: dict[str, list[int]] = {}
    for rank in range(plan.world_size):
        c = coords(rank, plan)
        for ref in refs:
            if ref is GroupRef.TIED and c.stage not in (0, plan.pp - 1):
                continue
            name, ranks = group_of(ref, c, plan)
            out[name] = list(ranks)
    return dict(sorted(out.items()))


def _node_msg(n: GNode, rank: int, c: RankCoords, plan: PlanSpec) -> Any:
    msg = cs.Node(id=n.id, name=n.name)
    msg.data_deps.extend(n.deps)
    a = msg.attr
    a.append(cio.attr("is_cpu_op", False))
    a.append(cio.attr("stream", n.stream))
    if n.kind is NodeKind.COMP:
        msg.type = cs.COMP_NODE
        msg.duration_micros = max(0, round(n.duration_s * 1e6))
        a.append(cio.attr("num_ops", int(round(n.flops))))
        a.append(cio.attr("tensor_size", int(n.tensor_bytes), "uint64_val"))
        total = sum(s for _, s in n.mix) or 1.0
        a.append(cio.attr(MIX_ATTR, ",".join(f"{k.value}:{s / total:.6f}" for k, s in n.mix)))
    elif n.kind is NodeKind.COLL:
        msg.type = cs.COMM_COLL_NODE
        name, _ = group_of(n.group or GroupRef.TP, c, plan)
        a.append(cio.attr("comm_type", COMM_TYPE[n.coll]))  # type: ignore[index]
        a.append(cio.attr("comm_size", int(n.nbytes)))
        a.append(cio.attr("pg_name", name))
    else:
        if n.ring and n.group is GroupRef.CP:  # CP ring attention: the next / previous rank of the CP group
            first = c.d - c.d % plan.cp
            peer = rank_of(RankCoords(c.stage, first + (c.d - first + n.ring) % plan.cp, c.t), plan)
        elif n.ring:  # TP ring exchange: the next (send) or previous (receive) rank of the TP group
            peer = rank_of(RankCoords(c.stage, c.d, (c.t + n.ring) % plan.tp), plan)
        else:
            peer = rank_of(RankCoords(n.peer_stage, c.d, c.t), plan)
        send = n.kind is NodeKind.SEND
        msg.type = cs.COMM_SEND_NODE if send else cs.COMM_RECV_NODE
        a.append(cio.attr("comm_src", rank if send else peer, "int32_val"))
        a.append(cio.attr("comm_dst", peer if send else rank, "int32_val"))
        a.append(cio.attr("comm_tag", int(n.tag), "int32_val"))
        a.append(cio.attr("comm_size", int(n.nbytes)))
    return msg


def rank_messages(graph: StepGraph, rank: int, meta_attrs: dict[str, Any]) -> list[Any]:
    plan = graph.plan
    c = coords(rank, plan)
    attrs = dict(meta_attrs, rank=rank, world_size=plan.world_size, pipeline_stage=c.stage)
    return [cio.metadata(attrs)] + [_node_msg(n, rank, c, plan) for n in graph.stages[c.stage]]


def parse_ranks(text: str | None, world: int) -> tuple[int, ...]:
    if not text:
        return tuple(range(world))
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(lo), int(lo))
        except ValueError:
            raise SpecError("--ranks", text, "comma-separated ranks or ranges, e.g. 0,1,8-15") from None
        if not 0 <= first <= last < world:  # checked before a range is expanded
            raise SpecError("--ranks", text, f"ranks in [0, {world}), each range low-high")
        out.extend(range(first, last + 1))
    if not out:
        raise SpecError("--ranks", text, f"ranks in [0, {world})")
    return tuple(dict.fromkeys(out))


def export_chakra(graph: StepGraph, out: str | Path, ranks: Iterable[int] | None = None,
                  meta_attrs: dict[str, Any] | None = None) -> list[Path]:
    """Write ``OUT.<rank>.et`` for each rank and ``OUT.comm_groups.json``; returns the paths written."""
    plan = graph.plan
    base = Path(out)
    if base.name in ("", ".", ".."):
        raise SpecError("-o", str(out), "DIR/NAME: a folder and a file-name prefix")
    meta = dict(meta_attrs or {}, producer="echo-plan", simulated_step_s=float(graph.simulated_step_s),
                plan=json.dumps(plan.model_dump(mode="json"), sort_keys=True))
    written = []
    for rank in (ranks if ranks is not None else range(plan.world_size)):
        path = base.parent / f"{base.name}.{rank}.et"
        head, *nodes = rank_messages(graph, rank, meta)
        written.append(cio.write_et(path, head, nodes))

    written.append(write_atomic(base.parent / f"{base.name}.comm_groups.json",
                                json.dumps(all_groups(plan, graph), indent=1) + "\n"))
    return written
