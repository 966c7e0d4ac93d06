"""Which kinds of layer each pipeline chunk holds, and what one rank holds of each kind.

A dense model has one layer kind; an MoE model has dense and MoE layers (DeepSeek-V3's first three
are dense), and a model with sliding-window attention alternates windowed and full layers
(``specs/moe.py``). Per rank, a layer's attention, shared experts and norms follow the dense
sharding (linears over tp, norms and the router replicated); its routed experts are split over
ep x etp (Megatron-Core), and their gradients reduce over the expert data-parallel group.
"""

from __future__ import annotations

import math
from collections import Counter

from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import DENSE, LayerKind
from echo_plan.specs.plan import PlanSpec, Schedule
from echo_plan.trace.records import CollectiveKind, GroupKind

EXPERT_EXCHANGE_GROUPS = (GroupKind.EP, GroupKind.ETP)  # what the breakdown's exposed expert exchange holds


def kind_counts(model: ModelSpec, first: int, n: int, recomputed: int = 0) -> tuple[tuple[LayerKind, int], ...]:
    """(kind, layers) of layers ``first`` .. ``first + n - 1``, in order of first appearance; the first
    ``recomputed`` of them (the plan's recompute_layers, per model chunk) as their recomputed kinds."""
    if model.moe is None and model.sliding_window is None and not recomputed:  # every layer dense
        n = min(first + n, model.num_layers) - max(first, 0) if first < model.num_layers else 0
        return ((DENSE, n),) if n > 0 else ()
    kinds = list(model.layer_kinds()[first:first + n])
    for i in range(min(recomputed, len(kinds))):
        kinds[i] = kinds[i]._replace(recomputed=True)
    return tuple(Counter(kinds).items())


def plan_kinds(model: ModelSpec, plan: PlanSpec) -> tuple[LayerKind, ...]:
    """The layer kinds a plan runs: the model's, and with recompute_layers each also recomputed."""
    kinds = model.distinct_kinds()
    if plan.recompute_layers:
        kinds += tuple(k._replace(recomputed=True) for k in kinds)
    return kinds


def stage_kind_counts(model: ModelSpec, plan: PlanSpec, stage: int) -> dict[LayerKind, int]:
    """Layers of each kind on pipeline rank ``stage`` (all its virtual chunks together)."""
    return all_stage_kind_counts(model, plan)[stage]


def rank_virtual_stages(plan: PlanSpec, rank: int) -> tuple[int, ...]:
    """The model's virtual stages (in model order) that pipeline rank ``rank`` holds, one per chunk: chunk c of
    rank r is virtual stage c x pp + r, except in ZB-V's V, where r holds r and 2 pp - 1 - r (so rank 0 holds both
    ends of the model; ``layout/actions.py``). DualPipe's reverse copy (stage pp - 1 - r) is the memory model's."""
    pp = plan.pp
    if plan.schedule is Schedule.ZB_V:
        return (rank, 2 * pp - 1 - rank)
    return tuple(c * pp + rank for c in range(plan.virtual_stages))


def output_rank(plan: PlanSpec) -> int:
    """The pipeline rank holding the model's last virtual stage (the output layer and the loss): as
    :func:`rank_virtual_stages` places it, rank 0 in ZB-V's V, the last rank otherwise. Per stage of every candidate
    the memory estimate asks: a constant-time answer."""
    return 0 if plan.schedule is Schedule.ZB_V else plan.pp - 1


def all_stage_kind_counts(model: ModelSpec, plan: PlanSpec) -> tuple[dict[LayerKind, int], ...]:
    """:func:`stage_kind_counts` of every pipeline rank, in one pass over the layers (the memory
    estimate of every candidate plan of a search asks for all of them)."""
    per_chunk = plan.virtual_layers(model.num_layers)
    kinds = model.layer_kinds()
    single = len(set(kinds)) == 1
    k = plan.recompute_layers
    by_vs: list[Counter] = []
    first = 0
    for n in per_chunk:
        counts: Counter = Counter()
        if single:
            if n:
                r = min(k, n)
                if r:
                    counts[kinds[0]._replace(recomputed=True)] += r
                if n - r:
                    counts[kinds[0]] += n - r
        else:
            for j, kind in enumerate(kinds[first:first + n]):
                counts[kind._replace(recomputed=True) if j < k else kind] += 1
        by_vs.append(counts)
        first += n
    out = []
    for rank in range(plan.pp):
        total: Counter = Counter()
        for vs in rank_virtual_stages(plan, rank):
            total.update(by_vs[vs])
        out.append(dict(total))
    return tuple(out)


def layer_params_per_rank(model: ModelSpec, plan: PlanSpec, kind: LayerKind = DENSE) -> tuple[int, int]:
    """(dense parameters, routed-expert parameters) one rank holds of one layer of ``kind``.

    Dense: the block's parameters over tp, as Megatron-LM splits them (what the replay has always
    used). MoE: attention and shared experts over tp, router and norms replicated, experts over ep x etp.
    """
    tp = plan.tp
    if not kind.moe or model.moe is None:
        return -(-model.layer_params(DENSE) // tp), 0
    router = model.moe.num_experts * model.hidden_size
    norms = 2 * model.norm_params
    shared = model.mlp_params(model.moe.shared_ffn) if model.moe.num_shared_experts else 0
    dense = math.ceil((model.attention_params + shared) / tp) + router + norms
    expert = math.ceil(model.expert_params_per_layer / (plan.ep * plan.expert_tp))
    return dense, expert


def all_to_all_note(model: ModelSpec, plan: PlanSpec, traces, comm_time, gpus_per_node: int,
                    tiers=None) -> str | None:
    """Where the MoE token exchange runs and what it costs: per MoE layer (forward + backward) and per
    step on the pipeline rank with the most MoE layers, with how many peers are inside a server."""
    for kind, trace in getattr(traces, "blocks", ()):
        if not kind.moe:
            continue
        ops = [op for op in trace.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL]
        if not ops:
            return "MoE all-to-all: none (ep 1: every expert is local)"
        group = ops[0].collective.group
        per_node, nodes = group.placement(gpus_per_node)
        layer_s = sum(comm_time(op.collective.kind, op.collective.nbytes, op.collective.group) for op in ops)
        every = all_stage_kind_counts(model, plan)
        per_rank = [sum(n * m for counts, m in _held(plan, every, r) for k, n in counts.items() if k.moe)
                    for r in range(plan.pp)]  # MoE layer passes per step (every MoE kind, DualPipe's two copies)
        busiest = max(range(plan.pp), key=lambda r: per_rank[r])
        most = sum(n for counts, _ in _held(plan, every, busiest) for k, n in counts.items() if k.moe)
        step_s = layer_s * per_rank[busiest]
        mb = sum(op.collective.nbytes for op in ops) / 2**20
        where = ("inside one server over NVLink" if nodes == 1 else
                 f"across {nodes} servers ({per_node - 1} of {group.size - 1} peers over NVLink, "
                 f"{group.size - per_node} over the network)")
        if tiers is not None:  # (NVLink, network) GB/s one rank gets: each tier's share, run concurrently
            nvl, net = tiers(group)
            total = sum(op.collective.nbytes for op in ops)
            inside = total * (per_node - 1) / group.size / (nvl * 1e9) if per_node > 1 and nvl else 0.0
            across = total * (group.size - per_node) / group.size / (net * 1e9) if nodes > 1 and net else 0.0
            where += f"; per MoE layer {inside * 1e3:.2f} ms of transfer inside servers, {across * 1e3:.2f} ms across"
        return (f"MoE all-to-all: ep {group.size} group {where}; {len(ops)} exchanges of {mb:,.0f} MiB in all per "
                f"MoE layer and micro-batch, {layer_s * 1e3:.2f} ms; {step_s:.2f} s per step on the stage with "
                f"{most} MoE layers (before overlap)")
    return None


def _held(plan: PlanSpec, every, stage: int) -> tuple:
    """((layer counts, micro-batches per step), ...) of what pipeline rank ``stage`` runs: its chunks with every
    micro-batch, or DualPipe's two copies' stages (s and pp - 1 - s), each direction with half of them."""
    if plan.schedule is Schedule.DUALPIPE:
        half = plan.num_microbatches / 2
        return ((every[stage], half), (every[plan.pp - 1 - stage], half))
    return ((every[stage], plan.num_microbatches),)


def expert_exchange_per_step(model: ModelSpec, plan: PlanSpec, traces, comm_time, stage: int) -> float:
    """Seconds per step of pipeline rank ``stage``'s expert exchange (the dispatch and combine on the
    expert-parallel group and the expert-TP collectives of its MoE layers, each timed alone, before any
    overlap): what the breakdown's ``ep_comm_exposed`` is the exposed part of."""
    held = _held(plan, all_stage_kind_counts(model, plan), stage)
    total = 0.0
    for kind, trace in getattr(traces, "blocks", ()):
        if not kind.moe:
            continue
        layer_s = sum(comm_time(op.collective.kind, op.collective.nbytes, op.collective.group)
                      for op in trace.collectives if op.collective.group.kind in EXPERT_EXCHANGE_GROUPS)
        total += sum(layer_s * counts.get(kind, 0) * m for counts, m in held)
    return total


def exchange_hidden_note(total_s: float, exposed_s: float, stage: int) -> str | None:
    """How much of the critical stage's expert exchange the schedule hides (None without one)."""
    if total_s <= 0:
        return None
    hidden = min(1.0, max(0.0, 1.0 - exposed_s / total_s))
    return (f"expert exchange on the critical stage {stage}: {total_s:.2f} s per step, each exchange timed alone; "
            f"{exposed_s:.2f} s of it exposed (the breakdown's exposed expert exchange), so the schedule hides "
            f"{hidden:.0%} of it")
