"""``simulate``: one plan of one model on one cluster -> the predicted training step.

trace (cached) -> level 1 (one layer on its streams, per trace) -> level 2 (the pipeline schedule
with p2p, DP buckets and the optimizer, one rank per pipeline stage) -> breakdown, throughput,
memory. This is the function the search calls for every candidate: per-plan work is proportional
to the number of level-2 tasks, and everything that only depends on a trace or a message size is
kept in a :class:`SimulationMemo` that the caller may keep across calls (the search does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from echo_plan.replay.dp import dp_exchange_summary
from echo_plan.layout.layer_mix import all_to_all_note, exchange_hidden_note, expert_exchange_per_step
from echo_plan.replay.metrics import throughput
from echo_plan.cost.collectives import CollectiveTimes
from echo_plan.cost.expert_exchange import (DeepEPCollectives, deepep_collectives, deepep_note,
                                           load_exchange_efficiency)
from echo_plan.layout.plan_layout import PlanLayout
from echo_plan.replay.results import StepResult
from echo_plan.replay.compiled.switch import CompiledSwitch
from echo_plan.replay.step_replay import ScheduleCache, StepReplayer
from echo_plan.layout.schedules import schedule_shape
from echo_plan.replay.step_costs import ep_overlap_pairs, stack_notes, step_costs
from echo_plan.specs.calibration import calibration_status, kernels_status
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.faults import Fault, check_faults, slowed_cluster, stage_effects
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec, Schedule
from echo_plan.specs.plan_checks import validate_plan
from echo_plan.specs.software import MoEDispatcher, SoftwareSpec
from echo_plan.specs.software_checks import check_precision, check_plan_supported
from echo_plan.trace.records import CollectiveKind, CommGroup, Phase
from echo_plan.cost.base import with_stack_kernels
from echo_plan.cost.memory import stage_memory
from echo_plan.cost.fit_hints import fit_changes, fit_note
from echo_plan.cost.memory_notes import allocator_note, loss_note, pipeline_note
from echo_plan.cost.offload import offload_notes
from echo_plan.errors import SpecError
from echo_plan.replay.no_gc import paused_gc
from echo_plan.replay.steady import steady_state_step
from echo_plan.replay.timeline import timeline_events
from echo_plan.replay.faults import fault_summary
from echo_plan.specs.presets import load_stack
from echo_plan.replay.interference import load_interference
from echo_plan.replay.kinds import TaskKind
from echo_plan.cost.kernel_db import compute_model_for, database_note
from echo_plan.cost.compute import load_compute_constants
from echo_plan.cost.ranges import prediction_range
from echo_plan.cost.collectives import collective_model_for
from echo_plan.trace.tracer import trace_model
from echo_plan.replay.host import host_issue_for
from echo_plan.replay.layer import replay_layer
from echo_plan.replay.split import split_timings

if TYPE_CHECKING:
    from echo_plan.cost.base import CollectiveModel, ComputeModel
    from echo_plan.cost.expert_exchange import ExchangeEfficiency
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
        self.compiled = CompiledSwitch.from_environment()  # compiled vs Python replay, for every plan of the memo
        self.schedules = ScheduleCache(self.compiled)  # action lists and their arrays, shared by plans with them
        self._defaults: dict[str, Any] = {}
        self.layer_hits = 0
        self.layer_misses = 0

    def default_stack(self) -> SoftwareSpec:
        if "stack" not in self._defaults:
            self._defaults["stack"] = load_stack()
        return self._defaults["stack"]

    def default_interference(self) -> "InterferenceModel":
        if "interference" not in self._defaults:
            self._defaults["interference"] = load_interference(None)
        return self._defaults["interference"]

    def sm_share(self, interference: "InterferenceModel", total_sms: int, comm_sms: int,
                 gemms_sized: bool = False) -> "InterferenceModel":
        """``interference`` with the expert exchange holding ``comm_sms`` SMs, one object per model and share
        (the layer timings are memoised by the interference model's identity). ``gemms_sized``: the stack's
        GEMMs already run on the rest (``fp8_gemms_leave_comm_sms``), so only attention loses SMs beside it."""
        key = ("sm_share", interference, total_sms, comm_sms, gemms_sized)
        if key not in self._defaults:
            kinds = (TaskKind.ATTENTION,) if gemms_sized else (TaskKind.GEMM, TaskKind.ATTENTION)
            self._defaults[key] = interference.with_sm_share(TaskKind.ALL_TO_ALL, total_sms, comm_sms, kinds)
        return self._defaults[key]

    def exchange_efficiency(self, release) -> "ExchangeEfficiency":  # noqa: ANN001
        """What ``release``'s DeepEP kernels reach of NVLink and the network (the shipped file, read once)."""
        key = ("exchange", release)
        if key not in self._defaults:
            self._defaults[key] = load_exchange_efficiency(release=release)
        return self._defaults[key]

    def default_compute(self, cluster: ClusterSpec, cluster_key: str | None = None, kernels=None) -> "ComputeModel":
        """``cluster_key``: the cluster's ``model_dump_json()`` where the caller has it already; ``kernels``: the
        stack's kernel family, whose compute calibration the cluster may carry (None: its ``compute`` block)."""
        key = ("compute", cluster_key or cluster.model_dump_json(), kernels)  # the GPU and the compute calibration
        if key not in self._defaults:
            self._defaults[key] = compute_model_for(cluster, kernels=kernels)
        return self._defaults[key]

    def prediction_range(self, cluster: ClusterSpec, cluster_key: str, stack: SoftwareSpec, moe: bool = False):
        """How sure a step-time prediction is on this cluster with this stack, for a dense or a
        mixture-of-experts model (cost/ranges.py)."""
        key = ("range", cluster_key, stack.name, stack.base, moe)
        if key not in self._defaults:
            self._defaults[key] = prediction_range(cluster, stack, moe)
        return self._defaults[key]

    def default_comm(self, cluster: ClusterSpec, cluster_key: str | None = None) -> "CollectiveModel":
        key = ("comm", cluster_key or cluster.model_dump_json())
        if key not in self._defaults:
            self._defaults[key] = collective_model_for(cluster)
        return self._defaults[key]

    def traces(self, model: ModelSpec, plan: PlanSpec, cache: "TraceCache | None", stack: SoftwareSpec | None = None):
        stack = stack if stack is not None else self.default_stack()
        key = (model.model_dump_json(), plan.tp, plan.sequence_parallel, plan.micro_batch_size,
               plan.dtype, plan.recompute, plan.recompute_layers, stack.trace_signature(), stack.precision_signature(plan.dtype),
               None if cache is None else str(cache.root),
               plan.ep, plan.expert_tp, plan.expert_imbalance, plan.cp)
        hit = self._traces.get(key)
        if hit is None:
            hit = self._traces[key] = trace_model(model, plan, cache, stack)
        return hit

    def layer(self, trace, compute, comm, cluster: ClusterSpec, cluster_key: str, plan: PlanSpec, interference,
              host=None):
        key = (trace.key.digest(), compute, comm, cluster_key, plan.dtype, interference, host)
        hit = self._layers.get(key)
        if hit is None:
            self.layer_misses += 1
            hit = self._layers[key] = replay_layer(trace, compute, comm, cluster, plan.dtype, interference, host)
        else:
            self.layer_hits += 1
        return hit

    def timings(self, traces, compute, comm, cluster: ClusterSpec, cluster_key: str, plan: PlanSpec,
                interference, host=None) -> dict:
        """Level-1 timing of every traced stage of ``traces``: block, embedding, output, and each
        layer kind (``blocks``), on ``cluster`` (a fault may hand a stage a slowed copy of it); ``host``: the
        host's pace after an MoE dispatcher's synchronisation (replay/host.py), or None."""
        out = {name: self.layer(getattr(traces, name), compute, comm, cluster, cluster_key, plan, interference, host)
               for name in ("block", "embedding", "output")}
        out["blocks"] = {kind: self.layer(t, compute, comm, cluster, cluster_key, plan, interference, host)
                         for kind, t in traces.blocks}
        return out

    def timed_collectives(self, cluster_key: str) -> list[tuple[CollectiveKind, int, CommGroup]]:
        """(kind, nbytes, group) of every collective timed through ``comm_time`` on that cluster."""
        return CollectiveTimes.timed(self._comm, cluster_key)

    def split_timings(self, traces, timing: dict, compute, comm, cluster: ClusterSpec, cluster_key: str,
                      plan: PlanSpec, interference, paired: bool = False) -> dict:
        """Level 1 of the schedules that split the backward (replay/split.py), per traced stage; with the pairs of
        two layer kinds where the schedule pairs a forward with a backward (DualPipe, the MoE overlap stacks)."""
        return split_timings(self._layers, traces, timing, compute, comm, cluster, cluster_key, plan.dtype,
                             interference, pairs=plan.schedule is Schedule.DUALPIPE or paired)

    def comm_times(self, comm, cluster_key: str, cluster: ClusterSpec) -> CollectiveTimes:
        """The collective times of ``comm`` on ``cluster``, remembered with every other model's and cluster's."""
        return CollectiveTimes(comm, cluster, cluster_key, self._comm)


def fault_hooks(faults: tuple[Fault, ...], cluster: ClusterSpec, cluster_key: str, plan: PlanSpec, traces,
                timing: dict, work_scale, memo: SimulationMemo, compute, comm, interference, host=None):
    """(effects, work_scale, stage_timing, stage_comm) for ``step_costs``: per pipeline stage, its level-1
    timings and collective times on the cluster as that stage sees it (the healthy ones where it is)."""
    check_faults(faults, plan, cluster)
    effects = stage_effects(faults, plan, cluster)
    scale = tuple((work_scale[i] if work_scale else 1.0) * e.compute_scale for i, e in enumerate(effects))
    clusters = [slowed_cluster(cluster, e) for e in effects]
    keys = [c.model_dump_json() if c is not cluster else cluster_key for c in clusters]
    stage_timing = tuple(timing if c is cluster else memo.timings(traces, compute, comm, c, k, plan, interference,
                                                                  host)
                         for c, k in zip(clusters, keys))
    stage_comm = tuple(memo.comm_times(comm, k, c) for c, k in zip(clusters, keys))
    return effects, (scale if any(x != 1.0 for x in scale) else work_scale), stage_timing, stage_comm


def stack_models(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, stack: SoftwareSpec, memo: SimulationMemo,
                 cluster_key: str | None = None, compute=None, comm=None, interference=None):
    """(compute, collective, interference) models as ``stack`` (as run: ``SoftwareSpec.as_run``) runs ``plan``:
    its kernels (and the SMs its FP8 GEMMs leave to the exchange), DeepEP's exchange for the expert all-to-alls
    and the SMs it holds. ``compute``, ``comm``, ``interference``: the caller's, or None for the defaults."""
    cluster_key = cluster_key or cluster.model_dump_json()
    held = stack.fp8_gemm_sms_held(model.is_moe, plan.ep, plan.dtype)
    compute = with_stack_kernels(compute if compute is not None else memo.default_compute(cluster, cluster_key,
                                                                                         stack.kernels), stack, held)
    comm = comm if comm is not None else memo.default_comm(cluster, cluster_key)
    if interference is None:
        interference = memo.default_interference()
    if model.is_moe and stack.moe_dispatcher is MoEDispatcher.DEEPEP:
        # the expert-parallel all-to-alls as DeepEP's exchange, at what the stack's release reaches
        comm = deepep_collectives(comm, model, memo.exchange_efficiency(stack.deepep_release))
        if stack.moe_comm_sms and plan.ep > 1:  # the SMs its kernels hold, lost to what runs beside them
            if stack.moe_comm_sms >= cluster.gpu.sm_count:
                raise SpecError("moe_comm_sms", stack.moe_comm_sms, f"stack {stack.name}: the exchange can hold at "
                                f"most {cluster.gpu.sm_count - 1} of the {cluster.gpu.name}'s {cluster.gpu.sm_count} SMs")
            interference = memo.sm_share(interference, cluster.gpu.sm_count, stack.moe_comm_sms,
                                         gemms_sized=held > 0)
    return compute, comm, interference


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
    GPUs for a what-if; ``faults`` (specs/faults.py) slow the stages that hold the GPUs and links
    they hit, and the result carries the healthy step beside it. ``traffic`` adds, under a cluster
    routing other than none, each collective group's ECMP and planned slowdowns (docs/traffic.md).
    Raises SpecError for a bad plan, or one the stack cannot run."""
    validate_plan(plan, model, cluster)
    if work_scale is not None and (len(work_scale) != plan.pp or min(work_scale) <= 0):
        raise SpecError("work_scale", work_scale, f"one positive factor per pipeline stage ({plan.pp})")
    memo = memo if memo is not None else SimulationMemo()
    stack = stack if stack is not None else memo.default_stack()
    asked = stack
    stack = stack.as_run(plan, cluster.gpu.sm_arch)
    check_plan_supported(stack, plan)
    check_precision(stack, plan.dtype, cluster.gpu, model.is_moe)
    layout = PlanLayout.of(model, plan, stack)  # what follows from the plan alone, once: read by costs and memory
    cluster_key = cluster.model_dump_json()  # once: it keys the compute and comm models and every memo below
    held = stack.fp8_gemm_sms_held(model.is_moe, plan.ep, plan.dtype)  # SMs its FP8 GEMMs leave to the exchange
    compute, comm, interference = stack_models(model, cluster, plan, stack, memo, cluster_key, compute, comm,
                                               interference)

    traces = memo.traces(model, plan, cache, stack)
    host = host_issue_for(stack, cluster, model.is_moe)  # the host's pace after an MoE dispatcher's synchronisation
    timing = memo.timings(traces, compute, comm, cluster, cluster_key, plan, interference, host)
    paired = ep_overlap_pairs(model, plan, stack)  # the stack's MoE all-to-all overlap: F/B pairs
    if plan.schedule.split_backward or paired:  # (the pairs' savings come with the split timings)
        timing = dict(timing, split=memo.split_timings(traces, timing, compute, comm, cluster, cluster_key, plan,
                                                       interference, paired))

    comm_time = memo.comm_times(comm, cluster_key, cluster)
    stage_timing = stage_comm = effects = None
    if faults:
        effects, work_scale, stage_timing, stage_comm = fault_hooks(
            faults, cluster, cluster_key, plan, traces, timing, work_scale, memo, compute, comm, interference, host)
    # the stage costs need the schedule's layout only; its action lists are built (and kept in the
    # memo) for the micro-batch counts replayed, which the steady state keeps short
    base = step_costs(model, cluster, plan, timing, compute, comm_time, work_scale, schedule_shape, stack,
                      stage_timing, stage_comm, layout)

    replay_at = StepReplayer(base, interference, memo.schedules, plan.pp, plan.virtual_stages, paired, timeline)

    with paused_gc():  # level 2 allocates many long-lived small objects and no cycles
        step = steady_state_step(plan.pp, plan.virtual_stages, plan.num_microbatches, replay_at, exact=timeline,
                                 period=2 * plan.pp if plan.schedule is Schedule.ZB_V else None)
    rank, breakdown, step_s = step.rank, step.breakdown, step.step_s
    thr = throughput(model, plan, cluster.num_gpus, cluster.gpu.peak_tflops(plan.dtype), step_s)
    memory = stage_memory(model, plan, cluster, traces, stack, memory_headroom_bytes, layout)
    events: tuple = ()
    if timeline and step.full is not None:
        events = timeline_events(step.full.steps, step.full.result)
    notes = [f"critical pipeline stage: {rank}", f"micro-batches per step: {plan.num_microbatches}",
             f"level-2 tasks: {step.tasks_replayed}", f"software stack: {stack.name}"]
    notes += stack_notes(plan, stack, mla=model.mla is not None)
    if stack.rope_scale_per_call(model.rope_attention_factor) is not None:
        notes.append(f"stack {stack.name}: its fused RoPE kernel takes no attention factor, so {model.name}'s RoPE "
                     f"(YaRN, x{model.rope_attention_factor:g}) runs as unfused PyTorch ops, cos and sin scaled on "
                     "every call (Megatron-Core's fallback)")
    notes.append(allocator_note(stack))
    notes += [n for n in (loss_note(model, plan, stack), pipeline_note(model, plan, stack)) if n]
    measured = database_note(compute, traces, cluster, plan.dtype)
    if measured:
        notes.append(measured)
    if plan.dtype is DType.FP8 and asked.fp8_param_gather and not stack.fp8_param_gather:
        notes.append(f"stack {stack.name}: FP8 parameters (fp8_param_gather) need the distributed optimizer "
                     "(Megatron's rule); bf16 weights kept here")
    status = calibration_status(cluster)
    if not status.startswith("calibrated"):  # inherited from a preset, or none for this GPU: said plainly
        notes.append(status)
    family = kernels_status(cluster, stack.kernels)  # figures of the stack's kernel family, where there are some
    if family:
        notes.append(family)
    arch = load_compute_constants().arch_note(cluster.gpu.name, cluster.gpu.sm_arch)
    if arch:
        notes.append(arch)
    a2a = None
    if model.is_moe:
        def tiers(group):  # the bandwidths the NCCL model gives each tier of this group's all-to-all
            topo, _ = comm.lines(CollectiveKind.ALL_TO_ALL, group, cluster)
            p = comm.params
            return (topo.nvl_GBps * p.all_to_all_nvlink_efficiency,
                    topo.net_rank_GBps * p.all_to_all_net_efficiency)
        a2a = all_to_all_note(model, plan, traces, comm_time, cluster.domain_gpus,
                              tiers if hasattr(comm, "lines") and hasattr(comm, "params") else None)
    if a2a:
        notes.append(a2a)
    if model.is_moe:
        hidden = exchange_hidden_note(expert_exchange_per_step(model, plan, traces, comm_time, rank),
                                      breakdown.ep_comm_exposed_s, rank)
        if hidden:
            notes.append(hidden)
    if isinstance(comm, DeepEPCollectives):
        fwd = next(([op.collective for op in t.collectives if op.collective.kind is CollectiveKind.ALL_TO_ALL
                     and op.phase is Phase.FORWARD] for k, t in getattr(traces, "blocks", ()) if k.moe), [])
        if fwd:  # the traced forward's dispatch (first) and combine (last): a row of each, as the trace sends them
            row = model.hidden_size * plan.param_dtype.nbytes
            sent = row * fwd[0].nbytes / fwd[-1].nbytes
            token_bytes = (sent, row, "FP8" if sent < row else plan.param_dtype.value)
            notes.append(deepep_note(model, fwd[0].group, cluster.domain_gpus, comm.eff.release, token_bytes))
    if host is not None:
        graphs = ", ".join(g.value for g in host.graphs) or "none"
        notes.append(f"stack {stack.name}: the MoE dispatcher waits for the GPU before each token permutation; the "
                     f"host then issues the layer's kernels at {host.op_s * 1e6:.0f} us each (the {cluster.name} "
                     f"calibration's host issue time; CUDA-graphed parts: {graphs})")
    if held:
        notes.append(f"stack {stack.name}: its FP8 GEMMs run on {cluster.gpu.sm_count - held} of the "
                     f"{cluster.gpu.name}'s {cluster.gpu.sm_count} SMs for the whole step, leaving {held} to the "
                     "expert exchange (fp8_gemms_leave_comm_sms)")
    if step.extrapolated:
        notes.append("steady state verified periodic at {} micro-batches and extrapolated exactly".format(
            ", ".join(map(str, step.sampled[-3:]))))
    over = [m for m in memory if m.overflow_bytes]  # the GPU's; the host's is offload_notes' line
    if over:
        worst = max(over, key=lambda m: m.overflow_bytes)
        notes.append(f"does not fit: stage {worst.stage} needs {worst.total_bytes / 2**30:.1f} GiB of "
                     f"{worst.usable_bytes / 2**30:.1f} GiB usable ({worst.capacity_bytes / 2**30:.0f} GiB less "
                     f"{worst.headroom_bytes / 2**30:.1f} GiB headroom; over by {worst.overflow_bytes / 2**30:.1f} GiB)")
        notes.append(fit_note(fit_changes(model, plan, cluster, traces, asked, memory_headroom_bytes)))
    if plan.offload_optimizer:
        notes += offload_notes([st.host_step for st in base.stages], memory, cluster, stack, plan.offload_fraction)
    rng = memo.prediction_range(cluster, cluster_key, stack, model.is_moe)
    exchange = dp_exchange_summary(plan, base)
    fault_report = None
    if effects is not None:
        healthy = simulate(model, cluster, plan, stack=stack, cache=cache, compute=compute, comm=comm,
                           interference=interference, memo=memo, memory_headroom_bytes=memory_headroom_bytes)
        fault_report = fault_summary(faults, effects, base, step_s, healthy, plan)
        notes.append(f"faults: step {step_s:.3f} s against {healthy.step_time_s:.3f} s healthy "
                     f"(+{step_s / healthy.step_time_s - 1:.1%})")
    traffic_json = None
    if traffic and cluster.network.routing.value != "none":
        from echo_plan.cost.traffic import step_traffic  # deferred: loads numpy

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
