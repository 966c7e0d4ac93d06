"""What level 2 replays for a plan: per pipeline rank, the cost of each model chunk's forward and
backward (from the level-1 timings), its data-parallel buckets and its optimizer step, with the
schedule's action lists (``step_costs``; used by ``simulate`` and the Chakra export)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from echo_plan.layout.plan_layout import PlanLayout
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.cost.offload import fsdp_unit_copies_s, host_step
from echo_plan.replay.dp import chunk_buckets, fsdp_copy_op, fsdp_units, optimizer_op, optimizer_shard_params
from echo_plan.replay.fsdp import FsdpSteps
from echo_plan.layout.layer_mix import layer_params_per_rank
from echo_plan.replay.pipeline import PhaseCost, StageCosts, StepCosts
from echo_plan.layout.schedules import build_schedule
from echo_plan.replay.split import pair_saving_of, zb_v_times
from echo_plan.replay.transfers import _p2p_gather_time, _p2p_time, _params, _tied_time
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import DENSE
from echo_plan.specs.plan import PlanSpec, Schedule
from echo_plan.specs.software import Fp8Recipe, GradientBuffers, OptimizerOffload, SoftwareSpec
from echo_plan.cost.weight_copies import layer_gather_bytes
from echo_plan.trace.records import CommGroup
from echo_plan.specs.presets import load_stack
from echo_plan.trace.records import GroupKind

if TYPE_CHECKING:
    from echo_plan.cost.base import ComputeModel


def _phase(parts: list[tuple[Any, float]]) -> PhaseCost:
    """Sum of level-1 phase timings, each taken ``count`` times, as one aggregated chunk cost."""
    work = compute = tp = ep = inter = host = 0.0
    mix: dict = {}
    for ph, count in parts:
        work += ph.duration_s * count
        compute += ph.compute_s * count
        tp += ph.tp_comm_exposed_s * count
        ep += ph.ep_comm_exposed_s * count
        host += ph.host_exposed_s * count
        inter += ph.interference_s * count
        for kind, sec in ph.work_by_kind:
            if kind.is_compute:
                mix[kind] = mix.get(kind, 0.0) + sec * count
    mix_t = tuple(sorted(((k, v) for k, v in mix.items() if v > 0), key=lambda kv: kv[0].value)) or None
    return PhaseCost(work, compute, tp, inter, mix_t, ep, host)


def gather_bytes(plan: PlanSpec, stack: SoftwareSpec, params: int, layer_params: int) -> tuple[float, float]:
    """Mean bytes per parameter of a chunk's DP parameter all-gather (dense, experts): 2 (bf16), or with
    quantised parameters (``fp8_param_gather``, ``fp4_param_gather``) what the recipe gathers for the
    transformer layers' weights (``cost/weight_copies.py``: 1 for FP8, 2 for MXFP8, 1/2 for NVFP4; norms and
    biases, a sliver, are counted with them) and 2 for the embeddings."""
    layer = layer_gather_bytes(plan.dtype, stack)
    if layer == 2.0 or params <= 0:
        return 2.0, 2.0
    return (layer_params * layer + 2.0 * (params - layer_params)) / params, layer


def stack_notes(plan: PlanSpec, stack: SoftwareSpec, mla: bool = False) -> list[str]:
    """What the stack changed about the plan, in words (``mla``: the model's attention is multi-head latent)."""
    out = []
    if plan.overlap_grad_reduce and plan.grad_dp > 1 and not stack.overlap_grad_reduce:
        out.append(f"stack {stack.name} reduces gradients after the backward pass (no overlap)")
    if plan.overlap_param_gather and DataParallelSharding.of(plan, stack).sharded and not stack.overlap_param_gather:
        out.append(f"stack {stack.name} gathers parameters after the optimizer step (no overlap)")
    if stack.tp_comm_overlap and plan.tp > 1 and not plan.sequence_parallel:
        out.append(f"stack {stack.name}: TP communication overlap needs sequence parallelism; not used")
    if plan.tp > 1 and plan.sequence_parallel and stack.copies_tp_layout(plan.micro_batch_size):
        out.append(f"stack {stack.name}: DTensor keeps activations batch-first, so each sequence-parallel "
                   + ("reduce-scatter's input is copied into rank order (async TP's fused all-gathers take the shards "
                      "as they are)" if stack.tp_comm_overlap else
                      "all-gather's output and reduce-scatter's input is copied into order")
                   + "; with one sequence a micro-batch they are views (docs/fsdp.md)")
    if stack.moe_a2a_overlap and plan.ep > 1:
        if plan.pp == 1 or (plan.schedule is Schedule.INTERLEAVED and plan.virtual_stages > 1):
            out.append(f"stack {stack.name} pairs each steady-state forward with the next backward: one "
                       "micro-batch's MoE all-to-all runs under the other's compute")
        else:
            out.append(f"stack {stack.name}: the MoE all-to-all overlap needs interleaved 1F1B (vpp > 1) when "
                       f"pp > 1 (Megatron-Core's rule); not used with {plan.schedule.value}, vpp {plan.virtual_stages}")
    sharding = DataParallelSharding.of(plan, stack)
    if sharding.bf16_buffers:
        out.append(f"stack {stack.name} runs DeepSpeed's BF16_Optimizer: bf16 gradients kept beside the fp32 buffer, "
                   "added through an fp32 copy each micro-batch, the buffer all-reduced whole"
                   + (" before each rank steps its shard" if sharding.reduce_all else "")
                   + ("; DeepSpeed runs fp16 with its FP16/ZeRO optimizer instead, not modelled apart: its buffers are "
                      "costed as bf16's" if plan.dtype is DType.FP16 else ""))
    elif stack.gradient_buffers is GradientBuffers.DEEPSPEED_BF16:
        out.append(f"stack {stack.name}: sharding the {sharding.level.value} runs DeepSpeed's ZeRO stage optimizer, not "
                   "the BF16_Optimizer: its gradients are held and reduced as Megatron's are")
    if sharding.sharded and plan.sharding is None:
        out.append(f"stack {stack.name}'s sharded data parallelism shards the {sharding.level.value} "
                   f"(--sharding names the level)")
    if sharding.parameters:
        keep = "gathered again for backward" if plan.reshards_after_forward else "kept gathered from forward to backward"
        out.append(f"sharding parameters (FSDP): each block all-gathered over {sharding.degree} ranks before use, one "
                   f"block ahead, {keep}; gradients reduce-scattered after each block's backward"
                   + (f", then all-reduced across {sharding.replicas} replicas (HSDP)" if sharding.replicas > 1 else "")
                   + ("; with a pipeline the stage stays gathered and its gradients are reduced after the last "
                      "micro-batch" if plan.pp > 1 else "")
                   + (f"; FSDP2 (stack {stack.name}) copies each gathered block out into its parameters and each "
                      "block's gradients into the reduce-scatter buffer on the compute stream (counted as compute)"
                      if stack.fsdp_copy_kernels and sharding.degree > 1 else ""))
    if plan.dtype is DType.FP8:
        gather = "; weights kept and all-gathered in FP8" if stack.fp8_param_gather else ""
        if stack.fp8_param_gather and stack.fp8_recipe is Fp8Recipe.MXFP8:
            gather = "; weights kept in MXFP8, all-gathered in bf16 through the gradient buffer and quantised after"
        layouts = "" if stack.fp8_transposes is not False or not stack.fp8_recipe.per_tensor else \
            "; no FP8 transposes (the GPU's FP8 GEMMs take any layout)"
        out.append(f"fp8: the layers' GEMMs in FP8 ({stack.fp8_recipe.value} scaling{gather}{layouts}), bf16 "
                   "elsewhere; the once-per-step weight casts are counted with the optimizer step (docs/fp8.md)")
        if stack.deepseek_fp8_kernels:
            out.append(f"fp8: DeepSeek's own kernels around the GEMMs (stack {stack.name}: fp8_kernels deepseek): "
                       "the activations' scales laid out column-major before each dense GEMM, one FP8 copy of each "
                       "weight, transposed in every backward, and per-token and per-channel casts apart"
                       + ("; the attention output kept for backward only in E5M6 (12 bits)"
                          if stack.fp8_attention_output_e5m6 and mla else ""))
    if plan.dtype is DType.FP4:
        gather = "; weights kept and all-gathered in NVFP4" if stack.fp4_param_gather else ""
        out.append(f"fp4: the layers' GEMMs in NVFP4 (E2M1 in 16-value blocks with E4M3 scales, 16 x 16 weight "
                   f"blocks, Hadamard-transformed weight-gradient operands{gather}), bf16 elsewhere (docs/fp8.md)")
    return out


def ep_overlap_pairs(model: ModelSpec, plan: PlanSpec, stack: SoftwareSpec) -> bool:
    """Whether the step runs forward/backward pairs that hide the MoE all-to-all: the stack's
    ``moe_a2a_overlap`` on an MoE model with expert parallelism, without a pipeline (1F1B of one
    stage) or with interleaved 1F1B. Megatron-Core's EP overlap needs virtual pipeline stages when
    pp > 1: a plain 1F1B stage would have to hold a forward until the next backward's gradient
    arrives, which costs more than it hides."""
    if not (stack.moe_a2a_overlap and model.is_moe and plan.ep > 1):
        return False
    if plan.pp == 1:
        return plan.schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)
    return plan.schedule is Schedule.INTERLEAVED and plan.virtual_stages > 1


def step_costs(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec, timing: dict, compute: "ComputeModel",
               comm_time, work_scale: tuple[float, ...] | None = None, schedules=build_schedule,
               stack: SoftwareSpec | None = None, stage_timing=None, stage_comm=None,
               layout: PlanLayout | None = None) -> StepCosts:
    """What level 2 replays for ``plan`` run with ``stack``: the schedule's action lists and, per
    pipeline rank, the cost of each chunk's forward and backward (from the level-1 ``timing`` of
    block, embedding and output), its DP buckets and its optimizer; ``comm_time(kind, nbytes,
    group)`` times a collective. The DP gradient dtype and which overlaps happen come from the
    stack (an overlap happens when the plan asks for it and the stack has it). ``stage_timing`` and
    ``stage_comm``: per pipeline stage, the level-1 timings and collective times of that stage's own
    view of the cluster (a fault slows it), in place of ``timing`` and ``comm_time``. ``layout``: the
    plan's layout (layout/plan_layout.py), derived here when not given."""
    if stack is None:
        stack = load_stack()
    pp, v = plan.pp, plan.virtual_stages
    lay = layout if layout is not None else PlanLayout.of(model, plan, stack)
    sharding = lay.sharding  # how the data-parallel group shards gradients and states
    overlap_grad = plan.overlap_grad_reduce and stack.overlap_grad_reduce and not plan.dp_comm.sparse

    def op_time(op):  # sparse exchanges' selection and feedback kernels
        return compute.op_time(op, cluster.gpu, plan.param_dtype)

    def copy_time(read: float, written: float) -> float:  # FSDP2's copy-out and copy-in kernels
        return op_time(fsdp_copy_op(read, written))
    fsdp2_offload = plan.offload_optimizer and stack.optimizer_offload is OptimizerOffload.FSDP2
    # FSDP2 under CPUOffloadPolicy: each unit's shard to and from the host beside its collectives
    host_copies = (lambda params, gb: fsdp_unit_copies_s(params, gb, cluster)) if fsdp2_offload else None
    gbytes = stack.grad_bytes(plan.param_dtype)
    schedule = lay.schedule
    split = timing.get("split") if schedule.split_backward else None
    ep_pairs = ep_overlap_pairs(model, plan, stack) and "split" in timing  # (the Chakra export writes no pairs)
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

        dual_group = CommGroup(GroupKind.DP, size=2 * plan.dp, stride=plan.tp)
    layers_of, first_layer = lay.layers_per_virtual_stage, lay.first_layer
    _, emb_params, out_params = _params(model, plan)
    edp = lay.edp_group

    stages = []
    for r in range(pp):  # a fault (resilience/) may give a stage its own level-1 timings and collectives
        t_r = stage_timing[r] if stage_timing is not None else timing
        ct = stage_comm[r] if stage_comm is not None else comm_time
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
            kinds = lay.kinds_per_virtual_stage[vs]
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
            if sharding.parameters:
                buckets.append(_fsdp_chunk(kinds, by_kind, blk, emb if vs == 0 else None,
                                           out if vs == nvs - 1 else None, emb_params if vs == 0 else 0,
                                           params - layer_params - (emb_params if vs == 0 else 0),
                                           model, plan, ct, gbytes, epb, lay, sharding,
                                           copy_time if stack.fsdp_copy_kernels else None, host_copies))
            else:
                buckets.append(chunk_buckets(params, plan, ct, gbytes, overlap_grad, sharding, group=dual_group,
                                         op_time=op_time, param_bytes=pb)
                               + chunk_buckets(experts, plan, ct, gbytes, overlap_grad, sharding, group=edp,
                                               op_time=op_time, param_bytes=epb))
            rank_params += params
            rank_experts += experts
        host = None
        opt = compute.op_time(optimizer_op(rank_params, sharding, rank_experts), cluster.gpu, plan.param_dtype)
        if plan.offload_optimizer:  # the step runs on the CPU; the GPU waits for what the copies do not hide
            f = plan.offload_fraction  # the GPU steps the share it keeps meanwhile (memory-bound: its share of opt)
            host = host_step(round(f * optimizer_shard_params(rank_params, sharding, rank_experts)), cluster,
                             stack.optimizer_offload, gpu_s=(1.0 - f) * opt)
            opt = host.wait_s()
        opt += once_per_step  # counted with the optimizer step: the other per-step compute of the rank
        pair = None
        if schedule is Schedule.DUALPIPE:
            pair = tuple(tuple(pair_saving_of(kinds_of[cf], kinds_of[cb], split) for cb in range(chunks))
                         for cf in range(chunks))
        elif ep_pairs:
            pair = tuple(tuple(pair_saving_of(kinds_of[cf], kinds_of[cb], timing["split"]) for cb in range(chunks))
                         for cf in range(chunks))
        stages.append(StageCosts(tuple(fwd), tuple(bwd), tuple(labels), tuple(buckets), opt,
                                 tuple(bin_) if split is not None else None,
                                 tuple(wgt) if split is not None else None, pair, host))

    p2p_by_stage = None
    if stage_comm is not None and nvs > 1:  # a transfer is as slow as the slower end's link
        own = [_p2p_time(model, plan, stage_comm[r]) for r in range(pp)]
        p2p_by_stage = tuple(max(own[max(0, r - 1):r + 2]) for r in range(pp))
    return StepCosts(
        p2p_by_stage=p2p_by_stage,
        schedule=sched, stages=tuple(stages), p2p_s=_p2p_time(model, plan, comm_time) if nvs > 1 else 0.0,
        p2p_recv_s=_p2p_gather_time(model, plan, comm_time) if nvs > 1 else 0.0,
        tied_allreduce_s=_tied_time(model, plan, comm_time, gbytes), overlap_grad_reduce=overlap_grad,
        overlap_param_gather=plan.overlap_param_gather and stack.overlap_param_gather, work_scale=work_scale,
        sync_p2p=not (stack.overlap_p2p and v > 1),  # Megatron-Core overlaps p2p only with interleaving
        fsdp=FsdpSteps.of(pp, plan.reshards_after_forward) if sharding.parameters else None,
    )


def _fsdp_chunk(kinds, by_kind, blk, emb, out, emb_params: int, out_params: int, model: ModelSpec, plan: PlanSpec,
                comm_time, gbytes: int, layer_bytes: float, lay: PlanLayout, sharding, copy_time=None,
                host_copies=None) -> tuple:
    """A chunk's FSDP units as torchtitan wraps them (replay/dp.py ``fsdp_units``): the token embedding
    (first stage), one unit per block with its own level-1 forward and backward time, and the final norm
    with the output layer (last stage; never resharded after forward, as torchtitan sets it) with the
    last block (torchtitan's older releases did not reshard it either: counted as kept)."""
    units: list[tuple] = []
    if emb is not None:
        units.append((emb_params, 0, emb.forward.duration_s, emb.backward.duration_s, False, 2.0))
    for kind, count in kinds:
        t = by_kind.get(kind, blk)
        dense_p, expert_p = layer_params_per_rank(model, plan, kind)
        units += [(dense_p, expert_p, t.forward.duration_s, t.backward.duration_s, False, layer_bytes)] * count
    last = units[-1]
    units[-1] = last[:4] + (True,) + last[5:]
    if out is not None:
        n = 1 + model.mtp_layers
        units.append((out_params, 0, out.forward.duration_s * n, out.backward.duration_s * n, True, 2.0))
    return fsdp_units(units, gbytes, comm_time, lay.dp_group, lay.edp_group, sharding, copy_time, host_copies)
