"""``simulate``: one plan of one model on one cluster -> the predicted training step.

trace (cached) -> level 1 (one layer on its streams, per trace) -> level 2 (the pipeline schedule
with p2p, DP buckets and the optimizer, one rank per pipeline stage) -> breakdown, throughput,
memory. This is the function the search calls for every candidate: per-plan work is proportional
to the number of level-2 tasks, and everything that only depends on a trace or a message size is
kept in a :class:`SimulationMemo` that the caller may keep across calls (the search does).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from echo_plan.replay.breakdown import critical_rank, step_breakdown
from echo_plan.replay.dp import chunk_buckets, dp_exchange_summary, edp_group, optimizer_op
from echo_plan.replay.layer_mix import all_to_all_note, kind_counts, layer_params_per_rank
from echo_plan.replay.transfers import _p2p_gather_time, _p2p_time, _params, _tied_time
from echo_plan.replay.metrics import throughput
from echo_plan.replay.pipeline import PhaseCost, StageCosts, StepCosts, build_tasks
from echo_plan.replay.results import StepResult
from echo_plan.replay.schedules import build_schedule
from echo_plan.replay.split import pair_saving_of, zb_v_times
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import DENSE
from echo_plan.specs.plan import PlanSpec, Recompute, Schedule, validate_plan
from echo_plan.specs.software import SoftwareSpec, check_stack_supports
from echo_plan.trace.records import CollectiveKind, CommGroup

if TYPE_CHECKING:
    from echo_plan.cost.base import CollectiveModel, ComputeModel
    from echo_plan.replay.interference import InterferenceModel
    from echo_plan.trace.cache import TraceCache

__all__ = ["simulate", "SimulationMemo", "step_costs"]


class SimulationMemo:
    """Results that depend only on a trace, a message or the models, reused across plans.

    Keys hold the model objects themselves (compute, collective and interference models and the
    cluster's JSON), so two calls with different models never share an entry. Not thread-safe;
    one per process (or per Ray worker).
    """

    def __init__(self) -> None:
        self._traces: dict[tuple, Any] = {}
        self._layers: dict[tuple, Any] = {}
        self._comm: dict[tuple, float] = {}
        self._schedules: dict[tuple, Any] = {}
        self._defaults: dict[str, Any] = {}
        self.layer_hits = 0
        self.layer_misses = 0

    def schedule(self, schedule: Schedule, pp: int, microbatches: int, virtual_stages: int, times=None):
        """The (pure, immutable) action lists, shared by every plan and steady-state sample with them."""
        key = (schedule, pp, microbatches, virtual_stages, times)
        sched = self._schedules.get(key)
        if sched is None:
            sched = self._schedules[key] = build_schedule(schedule, pp, microbatches, virtual_stages, times)
        return sched

    def default_stack(self) -> SoftwareSpec:
        if "stack" not in self._defaults:
            from echo_plan.specs.presets import load_stack

            self._defaults["stack"] = load_stack()
        return self._defaults["stack"]

    def default_interference(self) -> "InterferenceModel":
        if "interference" not in self._defaults:
            from echo_plan.replay.interference import load_interference

            self._defaults["interference"] = load_interference(None)
        return self._defaults["interference"]

    def default_compute(self, cluster: ClusterSpec) -> "ComputeModel":
        key = ("compute", cluster.gpu.model_dump_json())
        if key not in self._defaults:
            from echo_plan.cost.kernel_db import compute_model_for

            self._defaults[key] = compute_model_for(cluster)
        return self._defaults[key]

    def prediction_range(self, cluster: ClusterSpec, cluster_key: str, stack: SoftwareSpec):
        """How sure a step-time prediction is on this cluster with this stack (cost/ranges.py)."""
        key = ("range", cluster_key, stack.name, stack.base)
        if key not in self._defaults:
            from echo_plan.cost.ranges import prediction_range

            self._defaults[key] = prediction_range(cluster, stack)
        return self._defaults[key]

    def default_comm(self, cluster: ClusterSpec) -> "CollectiveModel":
        key = ("comm", cluster.model_dump_json())
        if key not in self._defaults:
            from echo_plan.cost.collectives import collective_model_for

            self._defaults[key] = collective_model_for(cluster)
        return self._defaults[key]

    def traces(self, model: ModelSpec, plan: PlanSpec, cache: "TraceCache | None", stack: SoftwareSpec | None = None):
        from echo_plan.trace.tracer import trace_model

        stack = stack if stack is not None else self.default_stack()
        key = (model.model_dump_json(), plan.tp, plan.sequence_parallel, plan.micro_batch_size,
               plan.dtype, plan.recompute, stack.trace_signature(), stack.fp8_signature(), None if cache is None else str(cache.root),
               plan.ep, plan.expert_tp, plan.expert_imbalance, plan.cp)
        hit = self._traces.get(key)
        if hit is None:
            hit = self._traces[key] = trace_model(model, plan, cache, stack)
        return hit

    def layer(self, trace, compute, comm, cluster: ClusterSpec, cluster_key: str, plan: PlanSpec, interference):
        from echo_plan.replay.layer import replay_layer

        key = (trace.key.digest(), compute, comm, cluster_key, plan.dtype, interference)
        hit = self._layers.get(key)
        if hit is None:
            self.layer_misses += 1
            hit = self._layers[key] = replay_layer(trace, compute, comm, cluster, plan.dtype, interference)
        else:
            self.layer_hits += 1
        return hit

    def timings(self, traces, compute, comm, cluster: ClusterSpec, cluster_key: str, plan: PlanSpec,
                interference) -> dict:
        """Level-1 timing of every traced stage of ``traces``: block, embedding, output, and each
        layer kind (``blocks``), on ``cluster`` (a fault may hand a stage a slowed copy of it)."""
        out = {name: self.layer(getattr(traces, name), compute, comm, cluster, cluster_key, plan, interference)
               for name in ("block", "embedding", "output")}
        out["blocks"] = {kind: self.layer(t, compute, comm, cluster, cluster_key, plan, interference)
                         for kind, t in traces.blocks}
        return out

    def timed_collectives(self, cluster_key: str) -> list[tuple[CollectiveKind, int, CommGroup]]:
        """(kind, nbytes, group) of every collective timed through ``comm_time`` on that cluster."""
        return [(k[2], k[3], k[4]) for k in self._comm if k[1] == cluster_key]

    def split_timings(self, traces, timing: dict, compute, comm, cluster: ClusterSpec, cluster_key: str,
                      plan: PlanSpec, interference) -> dict:
        """Level 1 of the schedules that split the backward (replay/split.py), per traced stage."""
        from echo_plan.replay.split import split_timings

        return split_timings(self._layers, traces, timing, compute, comm, cluster, cluster_key, plan.dtype,
                             interference)

    def comm_time(self, comm, cluster_key: str, cluster: ClusterSpec, kind: CollectiveKind, nbytes: int,
                  group: CommGroup) -> float:
        key = (comm, cluster_key, kind, nbytes, group)
        t = self._comm.get(key)
        if t is None:
            t = self._comm[key] = comm.time(kind, nbytes, group, cluster).time_s
        return t


def simulate(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, *, stack: SoftwareSpec | None = None,
             cache: "TraceCache | None" = None,
             compute: "ComputeModel | None" = None, comm: "CollectiveModel | None" = None,
             interference: "InterferenceModel | None" = None, timeline: bool = False,
             memo: SimulationMemo | None = None, work_scale: tuple[float, ...] | None = None,
             memory_headroom_bytes: int | None = None, faults: tuple = (), failure_model=None,
             traffic: bool = False) -> StepResult:
    """Predict one training step of ``plan`` run with ``stack`` (default: the megatron-core preset).
    A plan fits when every GPU keeps ``memory_headroom_bytes`` free (default: memory.yaml's share).
    ``interference=None`` uses the default factors (data file); pass ``InterferenceModel.none()`` to
    switch interference off. ``work_scale`` (one factor per pipeline stage, > 0) slows that stage's
    GPUs for a what-if; ``faults`` (resilience/faults.py) slow the stages that hold the GPUs and links
    they hit, and the result carries the healthy step beside it. ``traffic`` adds, under a cluster
    routing other than none, each collective group's ECMP and planned slowdowns (docs/traffic.md).
    Raises SpecError for a bad plan, or one the stack cannot run."""
    from echo_plan.cost.memory import stage_memory
    from echo_plan.errors import SpecError
    from echo_plan.replay.no_gc import paused_gc
    from echo_plan.replay.steady import StepReplay, steady_state_step

    validate_plan(plan, model, cluster)
    if work_scale is not None and (len(work_scale) != plan.pp or min(work_scale) <= 0):
        raise SpecError("work_scale", work_scale, f"one positive factor per pipeline stage ({plan.pp})")
    memo = memo if memo is not None else SimulationMemo()
    stack = stack if stack is not None else memo.default_stack()
    check_stack_supports(stack, sequence_parallel=plan.sequence_parallel,
                         distributed_optimizer=plan.distributed_optimizer,
                         selective_recompute=plan.recompute is Recompute.SELECTIVE, cp=plan.cp)
    compute = compute if compute is not None else memo.default_compute(cluster)
    comm = comm if comm is not None else memo.default_comm(cluster)
    if interference is None:
        interference = memo.default_interference()

    traces = memo.traces(model, plan, cache, stack)
    cluster_key = cluster.model_dump_json()
    timing = memo.timings(traces, compute, comm, cluster, cluster_key, plan, interference)
    if plan.schedule.split_backward:
        timing = dict(timing, split=memo.split_timings(traces, timing, compute, comm, cluster, cluster_key, plan,
                                                       interference))

    def comm_time(kind: CollectiveKind, nbytes: int, group: CommGroup) -> float:
        return memo.comm_time(comm, cluster_key, cluster, kind, nbytes, group)

    stage_timing = stage_comm = effects = None
    if faults:
        from echo_plan.resilience.apply import fault_hooks

        effects, work_scale, stage_timing, stage_comm = fault_hooks(
            faults, cluster, cluster_key, plan, traces, timing, work_scale, memo, compute, comm, interference)
    base = step_costs(model, cluster, plan, timing, compute, comm_time, work_scale, memo.schedule, stack,
                      stage_timing, stage_comm)

    def replay_at(m: int) -> StepReplay:  # the stage costs do not depend on the micro-batch count
        costs = base if m == plan.num_microbatches else replace(
            base, schedule=memo.schedule(base.schedule.schedule, plan.pp, m, plan.virtual_stages,
                                       base.schedule.times))
        steps = build_tasks(costs)
        result = steps.replay(interference)
        rank = critical_rank(result, plan.pp)
        return StepReplay(m, result.makespan_s, step_breakdown(steps, result, rank), rank, len(steps.work),
                          steps, result)

    with paused_gc():  # level 2 allocates many long-lived small objects and no cycles
        step = steady_state_step(plan.pp, plan.virtual_stages, plan.num_microbatches, replay_at, exact=timeline,
                                 period=2 * plan.pp if plan.schedule is Schedule.ZB_V else None)
    rank, breakdown, step_s = step.rank, step.breakdown, step.step_s
    thr = throughput(model, plan, cluster.num_gpus, cluster.gpu.peak_tflops(plan.dtype), step_s)
    memory = stage_memory(model, plan, cluster, traces, stack, memory_headroom_bytes)
    events: tuple = ()
    if timeline and step.full is not None:
        from echo_plan.replay.timeline import timeline_events

        events = timeline_events(step.full.steps, step.full.result)
    notes = [f"critical pipeline stage: {rank}", f"micro-batches per step: {plan.num_microbatches}",
             f"level-2 tasks: {step.tasks_replayed}", f"software stack: {stack.name}"]
    notes += stack_notes(plan, stack)
    a2a = None
    if model.is_moe:
        def tiers(group):  # the bandwidths the NCCL model gives each tier of this group
            topo, _ = comm.lines(CollectiveKind.ALL_TO_ALL, group, cluster)
            return topo.nvl_GBps, topo.net_rank_GBps
        a2a = all_to_all_note(model, plan, traces, comm_time, cluster.gpus_per_node,
                              tiers if hasattr(comm, "lines") else None)
    if a2a:
        notes.append(a2a)
    if step.extrapolated:
        notes.append("steady state verified periodic at {} micro-batches and extrapolated exactly".format(
            ", ".join(map(str, step.sampled[-3:]))))
    over = [m for m in memory if not m.fits]
    if over:
        worst = max(over, key=lambda m: m.overflow_bytes)
        notes.append(f"does not fit: stage {worst.stage} needs {worst.total_bytes / 2**30:.1f} GiB of "
                     f"{worst.usable_bytes / 2**30:.1f} GiB usable ({worst.capacity_bytes / 2**30:.0f} GiB less "
                     f"{worst.headroom_bytes / 2**30:.1f} GiB headroom; over by {worst.overflow_bytes / 2**30:.1f} GiB)")
    rng = memo.prediction_range(cluster, cluster_key, stack)
    exchange = dp_exchange_summary(plan, base)
    fault_report = None
    if effects is not None:
        from echo_plan.resilience.apply import fault_summary

        healthy = simulate(model, cluster, plan, stack=stack, cache=cache, compute=compute, comm=comm,
                           interference=interference, memo=memo, memory_headroom_bytes=memory_headroom_bytes)
        fault_report = fault_summary(faults, effects, base, step_s, healthy, plan)
        notes.append(f"faults: step {step_s:.3f} s against {healthy.step_time_s:.3f} s healthy "
                     f"(+{step_s / healthy.step_time_s - 1:.1%})")
    traffic_json = None
    if traffic and cluster.network.routing.value != "none":
        from echo_plan.resilience.traffic import step_traffic

        traffic_json, note = step_traffic(cluster, effects, traces, memo.timed_collectives(cluster_key))
        notes.append(note)
    if exchange is not None:
        notes.append(f"{plan.dp_comm.value} at density {plan.density:g}: the sparse exchange runs after the "
                     "backward pass (as the reference sparsifiers do); convergence per step is not modelled")
    return StepResult(
        model=model.name, cluster=cluster.name, num_gpus=cluster.num_gpus, plan=plan.model_dump(mode="json"),
        step_time_s=step_s, tokens_per_s=thr.tokens_per_s, model_tflops_per_gpu=thr.model_tflops_per_gpu,
        hardware_tflops_per_gpu=thr.hardware_tflops_per_gpu, mfu=thr.mfu, memory=tuple(memory),
        breakdown=breakdown, timeline=events, notes=tuple(notes), stack=stack.name,
        step_time_range_s=rng.apply(step_s), range_coverage=rng.coverage, range_basis=rng.basis,
        dp_exchange=exchange, faults=fault_report, traffic=traffic_json,
    ).with_goodput(plan, failure_model)



def _phase(parts: list[tuple[Any, float]]) -> PhaseCost:
    """Sum of level-1 phase timings, each taken ``count`` times, as one aggregated chunk cost."""
    work = compute = tp = inter = 0.0
    mix: dict = {}
    for ph, count in parts:
        work += ph.duration_s * count
        compute += ph.compute_s * count
        tp += ph.tp_comm_exposed_s * count
        inter += ph.interference_s * count
        for kind, sec in ph.work_by_kind:
            if kind.is_compute:
                mix[kind] = mix.get(kind, 0.0) + sec * count
    mix_t = tuple(sorted(((k, v) for k, v in mix.items() if v > 0), key=lambda kv: kv[0].value)) or None
    return PhaseCost(work, compute, tp, inter, mix_t)


def gather_bytes(plan: PlanSpec, stack: SoftwareSpec, params: int, layer_params: int) -> tuple[float, float]:
    """Mean bytes per parameter of a chunk's DP parameter all-gather (dense, experts): 2 (bf16), or with
    FP8 training and ``fp8_param_gather`` 1 for the transformer layers' weights (Megatron's
    --fp8-param-gather; norms and biases, a sliver, are counted with them) and 2 for the embeddings."""
    if plan.dtype is not DType.FP8 or not stack.fp8_param_gather or params <= 0:
        return 2.0, 2.0
    return (layer_params + 2.0 * (params - layer_params)) / params, 1.0


def stack_notes(plan: PlanSpec, stack: SoftwareSpec) -> list[str]:
    """What the stack changed about the plan, in words."""
    out = []
    if plan.overlap_grad_reduce and plan.grad_dp > 1 and not stack.overlap_grad_reduce:
        out.append(f"stack {stack.name} reduces gradients after the backward pass (no overlap)")
    if plan.overlap_param_gather and plan.distributed_optimizer and not stack.overlap_param_gather:
        out.append(f"stack {stack.name} gathers parameters after the optimizer step (no overlap)")
    if stack.tp_comm_overlap and plan.tp > 1 and not plan.sequence_parallel:
        out.append(f"stack {stack.name}: TP communication overlap needs sequence parallelism; not used")
    if plan.dtype is DType.FP8:
        gather = "; weights kept and all-gathered in FP8" if stack.fp8_param_gather else ""
        out.append(f"fp8: the layers' GEMMs in FP8 ({stack.fp8_recipe.value} scaling{gather}), bf16 elsewhere; the "
                   "once-per-step FP8 weight casts are counted with the optimizer step (docs/fp8.md)")
    return out


def step_costs(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, timing: dict, compute: "ComputeModel",
               comm_time, work_scale: tuple[float, ...] | None = None, schedules=build_schedule,
               stack: SoftwareSpec | None = None, stage_timing=None, stage_comm=None) -> StepCosts:
    """What level 2 replays for ``plan`` run with ``stack``: the schedule's action lists and, per
    pipeline rank, the cost of each chunk's forward and backward (from the level-1 ``timing`` of
    block, embedding and output), its DP buckets and its optimizer; ``comm_time(kind, nbytes,
    group)`` times a collective. The DP gradient dtype and which overlaps happen come from the
    stack (an overlap happens when the plan asks for it and the stack has it)."""
    if stack is None:
        from echo_plan.specs.presets import load_stack

        stack = load_stack()
    pp, v = plan.pp, plan.virtual_stages
    overlap_grad = plan.overlap_grad_reduce and stack.overlap_grad_reduce and not plan.dp_comm.sparse

    def op_time(op):  # sparse exchanges' selection and feedback kernels
        return compute.op_time(op, cluster.gpu, plan.param_dtype)
    gbytes = stack.grad_bytes(plan.param_dtype)
    schedule = plan.schedule if v > 1 else (Schedule.ONE_F_ONE_B if plan.schedule is Schedule.INTERLEAVED
                                           else plan.schedule)
    split = timing.get("split") if schedule.split_backward else None
    if schedule.split_backward and split is None:
        raise ValueError(f"the {schedule.value} schedule needs the level-1 split timings (timing['split'])")
    if schedule is Schedule.ZB_V:  # its order is list-scheduled with the layer's F : Bi : W times
        sp, lt = split["block"], timing["block"]
        times = zb_v_times(lt.forward.duration_s, sp.input_grad.duration_s, sp.weight_grad.duration_s)
        sched = schedules(schedule, pp, plan.num_microbatches, v, times)
    else:
        sched = schedules(schedule, pp, plan.num_microbatches, v)
    nvs, chunks = sched.num_virtual_stages, sched.virtual_stages
    dual_group = None
    if schedule is Schedule.DUALPIPE:  # the two copies of a stage reduce their gradients together
        from echo_plan.trace.records import GroupKind

        dual_group = CommGroup(GroupKind.DP, size=2 * plan.dp, stride=plan.tp)
    layers_of = list(plan.virtual_layers(model.num_layers))
    first_layer = [sum(layers_of[:vs]) for vs in range(nvs)]
    _, emb_params, out_params = _params(model, plan)
    edp = edp_group(plan)

    stages = []
    for r in range(pp):  # a fault (resilience/) may give a stage its own level-1 timings and collectives
        t_r = stage_timing(r) if stage_timing is not None else timing
        ct = stage_comm(r) if stage_comm is not None else comm_time
        blk, emb, out = t_r["block"], t_r["embedding"], t_r["output"]
        by_kind = t_r.get("blocks") or {DENSE: blk}
        fwd, bwd, labels, buckets, bin_, wgt, kinds_of = [], [], [], [], [], [], []
        rank_params = rank_experts = 0
        once_per_step = 0.0  # FP8 weight casts: once per step, before the first micro-batch's forward
        for c in range(chunks):
            vs = sched.virtual_stage(r, c)
            n = layers_of[vs]
            f_parts, b_parts, params, experts = [], [], 0, 0
            layer_params = 0  # of transformer layers (FP8-gathered with fp8_param_gather)
            i_parts, w_parts = [], []
            kinds = kind_counts(model, first_layer[vs], n)
            kinds_of.append(kinds)
            for kind, count in kinds:
                f_parts.append((by_kind.get(kind, blk).forward, count))
                b_parts.append((by_kind.get(kind, blk).backward, count))
                once_per_step += count * by_kind.get(kind, blk).per_step_s
                if split is not None:
                    sp = split["blocks"].get(kind, split["block"])
                    i_parts.append((sp.input_grad, count))
                    w_parts.append((sp.weight_grad, count))
                dense_p, expert_p = layer_params_per_rank(model, plan, kind)
                params += count * dense_p
                layer_params += count * dense_p
                experts += count * expert_p
            label = f"layers {first_layer[vs]}-{first_layer[vs] + n - 1}"
            if schedule is Schedule.DUALPIPE and c == 1:
                label = "reverse copy: " + label
            if vs == 0:
                f_parts.insert(0, (emb.forward, 1))
                b_parts.append((emb.backward, 1))
                if split is not None:
                    i_parts.append((split["embedding"].input_grad, 1))
                    w_parts.append((split["embedding"].weight_grad, 1))
                params += emb_params
                label += " +embedding"
            if vs == nvs - 1:
                f_parts.append((out.forward, 1))
                b_parts.insert(0, (out.backward, 1))
                if split is not None:
                    i_parts.insert(0, (split["output"].input_grad, 1))
                    w_parts.insert(0, (split["output"].weight_grad, 1))
                params += out_params
                label += " +output"
                if model.mtp_layers:  # multi-token prediction: a layer and a loss head per module
                    mtp = by_kind.get(model.mtp_kind, blk)
                    f_parts += [(mtp.forward, model.mtp_layers), (out.forward, model.mtp_layers)]
                    b_parts[:0] = [(out.backward, model.mtp_layers), (mtp.backward, model.mtp_layers)]
                    once_per_step += model.mtp_layers * mtp.per_step_s
                    if split is not None:
                        msp = split["blocks"].get(model.mtp_kind, split["block"])
                        i_parts[:0] = [(split["output"].input_grad, model.mtp_layers),
                                       (msp.input_grad, model.mtp_layers)]
                        w_parts[:0] = [(split["output"].weight_grad, model.mtp_layers),
                                       (msp.weight_grad, model.mtp_layers)]
                    dense_p, expert_p = layer_params_per_rank(model, plan, model.mtp_kind)
                    params += model.mtp_layers * (dense_p + -(-2 * model.hidden_size ** 2 // plan.tp))
                    experts += model.mtp_layers * expert_p
                    label += f" +{model.mtp_layers} mtp"
            fwd.append(_phase(f_parts))
            bwd.append(_phase(b_parts))
            if split is not None:
                bin_.append(_phase(i_parts))
                wgt.append(_phase(w_parts))
            labels.append(label)
            pb, epb = gather_bytes(plan, stack, params, layer_params)
            buckets.append(chunk_buckets(params, plan, ct, gbytes, overlap_grad, group=dual_group, op_time=op_time,
                                         param_bytes=pb)
                           + chunk_buckets(experts, plan, ct, gbytes, overlap_grad, group=edp, op_time=op_time,
                                           param_bytes=epb))
            rank_params += params
            rank_experts += experts
        opt = compute.op_time(optimizer_op(rank_params, plan, rank_experts), cluster.gpu, plan.param_dtype)
        opt += once_per_step  # counted with the optimizer step: the other per-step compute of the rank
        pair = None
        if schedule is Schedule.DUALPIPE:
            pair = tuple(tuple(pair_saving_of(kinds_of[cf], kinds_of[cb], split) for cb in range(chunks))
                         for cf in range(chunks))
        stages.append(StageCosts(tuple(fwd), tuple(bwd), tuple(labels), tuple(buckets), opt,
                                 tuple(bin_) if split is not None else None,
                                 tuple(wgt) if split is not None else None, pair))

    p2p_by_stage = None
    if stage_comm is not None and nvs > 1:  # a transfer is as slow as the slower end's link
        own = [_p2p_time(model, plan, stage_comm(r)) for r in range(pp)]
        p2p_by_stage = tuple(max(own[max(0, r - 1):r + 2]) for r in range(pp))
    return StepCosts(
        p2p_by_stage=p2p_by_stage,
        schedule=sched, stages=tuple(stages), p2p_s=_p2p_time(model, plan, comm_time) if nvs > 1 else 0.0,
        p2p_recv_s=_p2p_gather_time(model, plan, comm_time) if nvs > 1 else 0.0,
        tied_allreduce_s=_tied_time(model, plan, comm_time, gbytes), overlap_grad_reduce=overlap_grad,
        overlap_param_gather=plan.overlap_param_gather and stack.overlap_param_gather, work_scale=work_scale,
        sync_p2p=not (stack.overlap_p2p and v > 1),  # Megatron-Core overlaps p2p only with interleaving
    )

