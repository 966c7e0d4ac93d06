"""The simulated training step as a per-pipeline-stage graph of Chakra-like nodes (rank independent).

This mirrors what ``echo_plan.simulate`` replays, at the granularity Chakra consumers expect:

* Each traced stage (a transformer layer, the embedding, the output) and phase (forward; backward
  with its recompute) becomes a *template*: its compute ops cut into segments at every
  tensor-parallel collective, so a segment ends where a collective's input is produced and a new
  one starts where a collective's result is read (exactly the level-1 replay's dependency
  structure, coarsened). A COMP segment's duration is its ops' isolated kernel time; interference
  is left to the replayer. Collectives that level 1 found hidden beside compute stay beside it.
* A model chunk's forward/backward for one micro-batch is its layers' templates in sequence (each
  layer waits for the previous one's last nodes), with the embedding and output stages on the
  first and last virtual stage, as the level-2 replay aggregates them.
* The pipeline schedule's actions, as ``echo_plan.replay.pipeline.build_tasks`` orders them:
  RECV before a chunk that needs the previous stage, SEND after it (Megatron-LM's scatter/gather
  all-gather over TP on the receiver without sequence parallelism), DP gradient buckets beside the
  last backward of each chunk (a bucket waits for the layer where its gradients are complete),
  the distributed optimizer's parameter all-gathers, the tied-embedding all-reduce, the optimizer.

Groups are symbolic (TP, DP, PP peer, tied first/last stage) so that ``chakra_export`` can give
every rank its own. Uses simulate's own ``step_costs`` so the costs are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from echo_plan.cost.base import with_stack_kernels
from echo_plan.replay.engine import replay
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.layer import phase_tasks
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.layout.schedules import Pass
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec
from echo_plan.trace.records import CollectiveKind, GroupKind, LayerTrace, Phase
from echo_plan.replay.dp import PARAM_BYTES
from echo_plan.replay.pipeline import build_tasks
from echo_plan.simulate import SimulationMemo, step_costs
from echo_plan.specs.plan_checks import validate_plan
from echo_plan.specs.software_checks import check_plan_supported
from echo_plan.errors import SpecError


class NodeKind(str, Enum):
    COMP = "comp"
    COLL = "coll"
    SEND = "send"
    RECV = "recv"


class GroupRef(str, Enum):
    TP = "tp"
    DP = "dp"
    TIED = "tied"  # first and last pipeline stage (tied word embedding)
    EP = "ep"  # expert parallel (MoE dispatch and combine)
    ETP = "etp"  # expert tensor parallel
    EDP = "edp"  # expert data parallel (the experts' gradient buckets)
    CP = "cp"  # context parallel (ring attention's K/V exchanges, or its all-gather)


@dataclass(frozen=True, slots=True)
class GNode:
    id: int
    kind: NodeKind
    name: str
    stream: str
    deps: tuple[int, ...] = ()
    duration_s: float = 0.0  # COMP
    flops: float = 0.0
    tensor_bytes: int = 0
    mix: tuple[tuple[TaskKind, float], ...] = ()  # COMP: isolated seconds by kernel kind
    coll: CollectiveKind | None = None  # COLL
    group: GroupRef | None = None
    nbytes: int = 0  # COLL, SEND, RECV
    peer_stage: int = -1  # SEND / RECV: the other pipeline stage
    tag: int = 0
    ring: int = 0  # SEND / RECV inside the TP group: +1 to the next TP rank, -1 from the previous one


@dataclass(frozen=True, slots=True)
class _TNode:  # a template node; deps are template indices
    kind: NodeKind
    name: str
    stream: str
    deps: tuple[int, ...]
    duration_s: float = 0.0
    flops: float = 0.0
    tensor_bytes: int = 0
    mix: tuple[tuple[TaskKind, float], ...] = ()
    coll: CollectiveKind | None = None
    group: GroupRef | None = None
    nbytes: int = 0
    ring: int = 0  # a TP ring exchange's SEND (+1) or RECV (-1); their tags pair them


RING_TAG_BASE = 1 << 30  # tags of TP ring exchanges: base + the SEND node's id (PP tags stay far below)


@dataclass(frozen=True, slots=True)
class StepGraph:
    stages: tuple[tuple[GNode, ...], ...]  # per pipeline stage
    simulated_step_s: float
    plan: PlanSpec


def _bucket_group(bucket) -> "GroupRef":
    """Dense buckets reduce over the data-parallel group, routed-expert ones over the expert one."""
    return GroupRef.EDP if getattr(bucket, "expert", False) else GroupRef.DP


_GROUP_OF = {GroupKind.TP: GroupRef.TP, GroupKind.DP: GroupRef.DP, GroupKind.EP: GroupRef.EP,
             GroupKind.ETP: GroupRef.ETP, GroupKind.EDP: GroupRef.EDP, GroupKind.CP: GroupRef.CP}


def phase_template(trace: LayerTrace, phase_forward: bool, compute: Any, comm: Any, cluster: ClusterSpec,
                   plan: PlanSpec, label: str) -> tuple[_TNode, ...]:
    ops = [op for op in trace.ops if op.phase is not Phase.STEP and (op.phase is Phase.FORWARD) == phase_forward]
    by_index = {op.index: op for op in ops}
    tasks = phase_tasks(ops, compute, comm, cluster, plan.dtype)
    is_comm = {t.id: t.kind.is_comm for t in tasks}
    position = {t.id: i for i, t in enumerate(tasks)}
    cut_after: set[int] = set()
    for t in tasks:
        if is_comm[t.id]:
            producers = [d for d in t.deps if not is_comm.get(d, True)]
            if producers:
                cut_after.add(max(producers, key=position.__getitem__))
    nodes: list[_TNode] = []
    node_of: dict[int, int] = {}  # task id -> template node
    seg: list[Any] = []
    seg_deps: set[int] = set()
    last_seg: int | None = None

    def close() -> None:
        nonlocal seg, seg_deps, last_seg
        if not seg:
            return
        mix: dict[TaskKind, float] = {}
        for t in seg:
            mix[t.kind] = mix.get(t.kind, 0.0) + t.work_s
        deps = set(seg_deps) | ({last_seg} if last_seg is not None else set())
        nodes.append(_TNode(
            NodeKind.COMP, f"{label} ops {seg[0].id}-{seg[-1].id}", "compute", tuple(sorted(deps)),
            duration_s=sum(t.work_s for t in seg), flops=sum(by_index[t.id].flops for t in seg),
            tensor_bytes=sum(by_index[t.id].bytes_read + by_index[t.id].bytes_written for t in seg),
            mix=tuple(sorted(mix.items(), key=lambda kv: kv[0].value)),
        ))
        last_seg = len(nodes) - 1
        for t in seg:
            node_of[t.id] = last_seg
        seg, seg_deps = [], set()

    for t in tasks:
        if is_comm[t.id]:
            info = by_index[t.id].collective
            deps = {node_of[d] for d in t.deps if d in node_of}
            if any(d not in node_of for d in t.deps):  # its producer is still in the open segment
                close()
                deps = {node_of[d] for d in t.deps}
            group = _GROUP_OF.get(info.group.kind, GroupRef.TP)
            if info.kind is CollectiveKind.SEND_RECV:  # userbuffers' ring exchange: send next, receive previous
                nodes.append(_TNode(NodeKind.SEND, f"{label} ring send ({by_index[t.id].name})", t.stream,
                                    tuple(sorted(deps)), nbytes=info.nbytes, ring=1,
                                    group=group if group is GroupRef.CP else None))
                nodes.append(_TNode(NodeKind.RECV, f"{label} ring recv ({by_index[t.id].name})", t.stream,
                                    tuple(sorted(deps)), nbytes=info.nbytes, ring=-1,
                                    group=group if group is GroupRef.CP else None))
            else:
                nodes.append(_TNode(NodeKind.COLL, f"{label} {info.kind.value} ({by_index[t.id].name})", t.stream,
                                    tuple(sorted(deps)), coll=info.kind, group=group, nbytes=info.nbytes))
            node_of[t.id] = len(nodes) - 1
            continue
        comm_deps = {node_of[d] for d in t.deps if is_comm.get(d, False)}
        if comm_deps:
            close()
            seg_deps |= comm_deps
        seg.append(t)
        if t.id in cut_after:
            close()
    close()
    return tuple(nodes)


def _sinks(template: tuple[_TNode, ...]) -> tuple[int, ...]:
    used = {d for n in template for d in n.deps}
    return tuple(i for i in range(len(template)) if i not in used)


def _template_time(template: tuple[_TNode, ...], coll_time) -> float:
    end: list[float] = []
    for n in template:
        start = max((end[d] for d in n.deps), default=0.0)
        end.append(start + (n.duration_s if n.kind is NodeKind.COMP else coll_time(n)))
    return max(end, default=0.0)


class _Builder:
    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.nodes: list[GNode] = []

    def add(self, **kw: Any) -> int:
        nid = len(self.nodes)
        self.nodes.append(GNode(id=nid, **kw))
        return nid

    def instance(self, template: tuple[_TNode, ...], deps: tuple[int, ...], prefix: str) -> tuple[int, ...]:
        """Append one copy of ``template``; its roots wait for ``deps``; returns its sink node ids."""
        base = len(self.nodes)
        for i, n in enumerate(template):
            own = tuple(base + d for d in n.deps)
            # a ring RECV follows its SEND in the template: both carry the SEND's node id as their tag
            tag = RING_TAG_BASE + base + i - (1 if n.ring < 0 else 0) if n.ring else 0
            self.add(kind=n.kind, name=f"{prefix} {n.name}", stream=n.stream, deps=own if own else deps,
                     duration_s=n.duration_s, flops=n.flops, tensor_bytes=n.tensor_bytes, mix=n.mix, coll=n.coll,
                     group=n.group, nbytes=n.nbytes, ring=n.ring, tag=tag)
        return tuple(base + s for s in _sinks(template))


def build_step_graph(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, *, cache: Any = None,
                     comm: Any = None, interference: Any = None, stack: Any = None) -> StepGraph:
    """Per-stage graphs of one simulated step, and simulate()'s own step time for the same plan."""
    validate_plan(plan, model, cluster)
    if plan.schedule.split_backward:
        raise SpecError("schedule", plan.schedule.value, "the Chakra export writes whole backward passes: "
                        "export a plan with gpipe, 1f1b or interleaved (zero-bubble and DualPipe graphs are not "
                        "written yet)")
    if plan.recompute_layers:
        raise SpecError("recompute_layers", plan.recompute_layers, "the Chakra export writes one layer template per "
                        "kind under the plan's recompute mode: export with recompute_layers 0 (none, selective or full)")
    memo = SimulationMemo()
    stack = (stack if stack is not None else memo.default_stack()).as_run(plan, cluster.gpu.sm_arch)
    if DataParallelSharding.of(plan, stack).parameters:
        raise SpecError("sharding", "parameters", "the Chakra export writes Megatron-style gradient buckets, not "
                        "FSDP's per-block all-gathers yet: export a plan with sharding none or optimizer")
    check_plan_supported(stack, plan)
    sharding = DataParallelSharding.of(plan, stack)
    ckey = cluster.model_dump_json()
    compute = with_stack_kernels(memo.default_compute(cluster, ckey, stack.kernels), stack)
    comm = comm if comm is not None else memo.default_comm(cluster, ckey)
    interference = interference if interference is not None else memo.default_interference()
    traces = memo.traces(model, plan, cache, stack)
    timing = memo.timings(traces, compute, comm, cluster, ckey, plan, interference)

    comm_time = memo.comm_times(comm, ckey, cluster)

    costs = step_costs(model, cluster, plan, timing, compute, comm_time, stack=stack)
    simulated = replay(build_tasks(costs).tasks, interference).makespan_s

    templates = {(n, fwd): phase_template(getattr(traces, n), fwd, compute, comm, cluster, plan, f"{n} {'F' if fwd else 'B'}")
                 for n in ("block", "embedding", "output") for fwd in (True, False)}
    for kind, t in traces.blocks:  # one template per layer kind (dense/MoE, full/windowed attention)
        for fwd in (True, False):
            templates[(kind, fwd)] = phase_template(t, fwd, compute, comm, cluster, plan,
                                                    f"block {kind.label()} {'F' if fwd else 'B'}")
    kinds = model.layer_kinds()
    sched = costs.schedule
    pp, nvs = sched.pp, sched.num_virtual_stages
    layers_of = list(plan.virtual_layers(model.num_layers))
    gb = stack.grad_bytes(plan.param_dtype)
    full = plan.micro_batch_size * (model.seq_length // plan.cp) * model.hidden_size * plan.param_dtype.nbytes
    p2p_bytes = -(-full // plan.tp)
    gather_on_recv = plan.tp > 1 and not plan.sequence_parallel
    tied = costs.tied_allreduce_s > 0 and pp > 1
    tied_bytes = -(-model.vocab_size * model.hidden_size // plan.tp) * gb

    def tag(mb: int, src_vs: int, fwd: bool) -> int:
        return (mb * nvs + src_vs) * 2 + (0 if fwd else 1)

    def chunk_templates(vs: int, fwd: bool) -> list[tuple[str, tuple[_TNode, ...]]]:
        first = sum(layers_of[:vs])
        seq = [("layer", templates.get((kinds[i], fwd), templates[("block", fwd)]))
               for i in range(first, first + layers_of[vs])]
        seq = seq if fwd else seq[::-1]
        if vs == 0:
            seq = [("embedding", templates[("embedding", True)])] + seq if fwd else \
                seq + [("embedding", templates[("embedding", False)])]
        if vs == nvs - 1:
            seq = seq + [("output", templates[("output", True)])] if fwd else \
                [("output", templates[("output", False)])] + seq
        return seq

    stages = []
    for r in range(pp):
        b = _Builder(r)
        st = costs.stages[r]
        acts = sched.actions[r]
        dp_nodes: list[int] = []
        gathers: dict[tuple[int, int], int] = {}
        last_b = {a.chunk: a.microbatch for a in acts if a.kind is Pass.BACKWARD}
        first_f: dict[int, int] = {}
        for a in acts:
            if a.kind is Pass.FORWARD:
                first_f.setdefault(a.chunk, a.microbatch)
        overlapped_gather = costs.overlap_param_gather and sharding.sharded and plan.grad_dp > 1
        # the gradients' collective: reduce-scattered to their shard's owner, or all-reduced (unsharded, or DeepSpeed's
        # BF16_Optimizer, which all-reduces the whole buffer before each rank steps its shard)
        scatter = sharding.sharded and not sharding.reduce_all
        reduce_kind = CollectiveKind.REDUCE_SCATTER if scatter else CollectiveKind.ALL_REDUCE
        reduce_name = "reduce-scatter" if scatter else "all-reduce"
        if overlapped_gather:
            for c in sorted(first_f, key=lambda c: acts.index(next(x for x in acts if x.kind is Pass.FORWARD and x.chunk == c))):
                for k in reversed(range(len(st.buckets[c]))):
                    gathers[(c, k)] = b.add(kind=NodeKind.COLL, name=f"DP param all-gather chunk{c} bucket {k}",
                                            stream="dp_comm", coll=CollectiveKind.ALL_GATHER,
                                            group=_bucket_group(st.buckets[c][k]),
                                            nbytes=st.buckets[c][k].params * PARAM_BYTES)
        prev_sends: tuple[int, ...] = ()
        last_compute: tuple[int, ...] = ()
        for a in acts:
            fwd = a.kind is Pass.FORWARD
            vs = sched.virtual_stage(r, a.chunk)
            deps = list(prev_sends)
            src_vs = vs - 1 if fwd else vs + 1
            if 0 <= src_vs < nvs:
                peer = sched.rank_chunk(src_vs)[0]
                rid = b.add(kind=NodeKind.RECV, name=f"recv {'act' if fwd else 'grad'} mb{a.microbatch} <- stage {peer}",
                            stream="pp_recv_fwd" if fwd else "pp_recv_bwd", nbytes=p2p_bytes, peer_stage=peer,
                            tag=tag(a.microbatch, src_vs, fwd), deps=())
                deps.append(rid)
                if gather_on_recv:
                    deps[-1] = b.add(kind=NodeKind.COLL, name=f"TP all-gather of received {'act' if fwd else 'grad'} mb{a.microbatch}",
                                     stream="pp_gather", coll=CollectiveKind.ALL_GATHER, group=GroupRef.TP,
                                     nbytes=full, deps=(rid,))
            seq = chunk_templates(vs, fwd)
            label = f"{'F' if fwd else 'B'} mb{a.microbatch} chunk{a.chunk}"
            # which DP bucket (reduce) / gather each layer position releases or needs
            buckets = st.buckets[a.chunk]
            releases: dict[int, list[int]] = {}
            needs: dict[int, list[int]] = {}
            if buckets:
                durations = [_template_time(t, lambda n: 0.0) for _, t in seq]
                total_t = sum(durations) or 1.0
                ends = [sum(durations[:i + 1]) / total_t for i in range(len(seq))]
                total_p = sum(x.params for x in buckets) or 1
                if not fwd and costs.overlap_grad_reduce and last_b[a.chunk] == a.microbatch and plan.grad_dp > 1:
                    cum = 0.0
                    for k, bk in enumerate(buckets):
                        cum += bk.params / total_p
                        pos = next((i for i, e in enumerate(ends) if e >= cum - 1e-9), len(seq) - 1)
                        releases.setdefault(pos, []).append(k)
                if fwd and overlapped_gather and first_f[a.chunk] == a.microbatch:
                    cum, starts = 0.0, [0.0] + ends[:-1]
                    order = list(reversed(range(len(buckets))))
                    bounds = []
                    for k in order:
                        cum += buckets[k].params / total_p
                        bounds.append((cum, k))
                    for i, s in enumerate(starts):
                        needs[i] = [k for c_end, k in bounds if c_end - buckets[k].params / total_p <= s + 1e-9]
            cur = tuple(deps)
            for i, (what, tmpl) in enumerate(seq):
                extra = tuple(gathers[(a.chunk, k)] for k in needs.get(i, ()))
                cur = b.instance(tmpl, cur + extra, f"{label} {what}{i}")
                for k in releases.get(i, ()):
                    dp_nodes.append(b.add(kind=NodeKind.COLL, stream="dp_comm", deps=cur, group=_bucket_group(buckets[k]),
                                          name=f"DP {reduce_name} chunk{a.chunk} bucket {k}", coll=reduce_kind,
                                          nbytes=buckets[k].params * gb))
            last_compute = cur
            dst_vs = vs + 1 if fwd else vs - 1
            sends = []
            if 0 <= dst_vs < nvs:
                peer = sched.rank_chunk(dst_vs)[0]
                sends.append(b.add(kind=NodeKind.SEND, name=f"send {'act' if fwd else 'grad'} mb{a.microbatch} -> stage {peer}",
                                   stream="pp_fwd" if fwd else "pp_bwd", nbytes=p2p_bytes, peer_stage=peer,
                                   tag=tag(a.microbatch, vs, fwd), deps=cur))
            prev_sends = tuple(sends)
        if plan.grad_dp > 1 and not costs.overlap_grad_reduce:
            order = sorted(last_b, key=lambda c: acts.index(next(x for x in acts if x.kind is Pass.BACKWARD and x.chunk == c and x.microbatch == last_b[c])))
            for c in order:
                for k, bk in enumerate(st.buckets[c]):
                    dp_nodes.append(b.add(kind=NodeKind.COLL, stream="dp_comm", deps=last_compute, group=_bucket_group(bk),
                                          name=f"DP {reduce_name} chunk{c} bucket {k}", coll=reduce_kind,
                                          nbytes=bk.params * gb))
        opt_deps = last_compute + tuple(dp_nodes)
        if tied and r in (0, pp - 1):
            t_id = b.add(kind=NodeKind.COLL, name="tied embedding grad all-reduce (first <-> last stage)",
                         stream="dp_comm", coll=CollectiveKind.ALL_REDUCE, group=GroupRef.TIED, nbytes=tied_bytes,
                         deps=last_compute + tuple(dp_nodes))
            opt_deps += (t_id,)
        opt = b.add(kind=NodeKind.COMP, name="optimizer", stream="compute", deps=opt_deps,
                    duration_s=st.optimizer_s, mix=((TaskKind.MEMORY, st.optimizer_s),))
        if sharding.sharded and plan.grad_dp > 1 and not overlapped_gather:
            for c, bs in enumerate(st.buckets):
                for k, bk in enumerate(bs):
                    b.add(kind=NodeKind.COLL, name=f"DP param all-gather chunk{c} bucket {k}", stream="dp_comm",
                          coll=CollectiveKind.ALL_GATHER, group=_bucket_group(bk), nbytes=bk.params * PARAM_BYTES,
                          deps=(opt,))
        stages.append(tuple(b.nodes))
    return StepGraph(tuple(stages), simulated, plan)
