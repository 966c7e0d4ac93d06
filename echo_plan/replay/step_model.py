"""What level 2 replays, as data: the isolated cost of a chunk's pass (``PhaseCost``), a data-parallel
bucket or FSDP unit (``DpBucket``), a pipeline rank's costs (``StageCosts``) and a step's (``StepCosts``),
and how two passes run as an overlapped pair cost (``overlapped``). ``pipeline.py`` turns them into tasks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from echo_plan.layout.schedules import PipelineSchedule
from echo_plan.replay.fsdp import FsdpSteps
from echo_plan.replay.interference import Mix
from echo_plan.replay.kinds import TaskKind


@dataclass(frozen=True, slots=True)
class PhaseCost:
    """Isolated cost of a chunk's forward or backward: ``work_s`` = compute + tp exposed + level-1 interference."""

    work_s: float
    compute_s: float
    tp_comm_exposed_s: float
    interference_s: float
    mix: Mix | None = None
    ep_comm_exposed_s: float = 0.0  # part of ``work_s``: waiting on the expert exchange
    host_exposed_s: float = 0.0  # part of ``work_s``: waiting on the host after the MoE dispatcher's synchronisation


@dataclass(frozen=True, slots=True)
class DpBucket:
    params: int  # parameters (of this rank) in the bucket
    reduce_s: float  # all-reduce, or reduce-scatter with the distributed optimizer
    reduce_kind: TaskKind
    gather_s: float = 0.0  # parameter all-gather (distributed optimizer), else 0
    expert: bool = False  # routed-expert parameters, reduced over the expert data-parallel group
    sparse: Any = None  # cost.dp_comm.Exchange of a sparse method (reduce_s is its total), else None
    fwd_share: float = 0.0  # FSDP units: the unit's share of the chunk's forward (and backward) compute
    bwd_share: float = 0.0
    kept: bool = False  # FSDP units not gathered again for backward (the root unit, the chunk's last block)
    copy_out_s: float = 0.0  # FSDP2: the all-gather's copy into the unsharded parameters (compute stream)
    copy_in_s: float = 0.0  # FSDP2: the gradients' copy into the reduce-scatter buffer (compute stream)


@dataclass(frozen=True, slots=True)
class StageCosts:
    """One pipeline rank: per chunk forward/backward, layer range and DP buckets; its optimizer."""

    forward: tuple[PhaseCost, ...]
    backward: tuple[PhaseCost, ...]
    chunk_labels: tuple[str, ...]  # e.g. "layers 12-23" (+ "+embedding" / "+output")
    buckets: tuple[tuple[DpBucket, ...], ...]  # per chunk, in the order gradients become ready
    optimizer_s: float
    input_grad: tuple[PhaseCost, ...] | None = None  # per chunk, schedules that split the backward
    weight_grad: tuple[PhaseCost, ...] | None = None
    pair_saving_s: tuple[tuple[float, ...], ...] | None = None  # DualPipe: [forward chunk][backward chunk]
    host_step: Any = None  # cost.offload.HostStep when the optimizer runs on the CPU (optimizer_s holds its wait)

    def optimizer_time(self, scale: float = 1.0) -> float:
        """The optimizer step on a GPU whose work runs ``scale`` times as long (a slow GPU): the host's part of an
        offloaded step does not scale with it."""
        if self.host_step is None:
            return self.optimizer_s * scale
        return (self.optimizer_s - self.host_step.wait_s()) * scale + self.host_step.wait_s(scale)


@dataclass(frozen=True, slots=True)
class StepCosts:
    schedule: PipelineSchedule
    stages: tuple[StageCosts, ...]
    p2p_s: float  # one activation or gradient message between adjacent virtual stages
    tied_allreduce_s: float = 0.0
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    sync_p2p: bool = True
    work_scale: tuple[float, ...] | None = None  # per pipeline rank compute multiplier (what-if)
    p2p_recv_s: float = 0.0  # on the receiving stage: the TP all-gather of what arrived (no SP), before use
    p2p_by_stage: tuple[float, ...] | None = None  # per sending rank, when faults make transfers differ
    fsdp: FsdpSteps | None = None  # parameters sharded: the buckets are FSDP units (replay/fsdp.py)


def overlapped(first: PhaseCost, second: PhaseCost, saved_s: float) -> tuple[PhaseCost, PhaseCost]:
    """Two passes run as one overlapped pair ``saved_s`` shorter than apart: the saving comes out of
    what each exposed (TP/EP communication, then interference), in proportion to it."""
    exp1 = first.ep_comm_exposed_s + first.tp_comm_exposed_s + first.interference_s
    exp2 = second.ep_comm_exposed_s + second.tp_comm_exposed_s + second.interference_s
    saved_s = min(max(0.0, saved_s), exp1 + exp2)
    if saved_s <= 0.0:
        return first, second
    return hide(first, saved_s * exp1 / (exp1 + exp2)), hide(second, saved_s * exp2 / (exp1 + exp2))


def hide(p: PhaseCost, s: float) -> PhaseCost:
    """``s`` seconds less exposed: the expert exchange first (what pairing overlaps), then TP, then interference."""
    ep = min(p.ep_comm_exposed_s, s)
    tp = min(p.tp_comm_exposed_s, s - ep)
    inter = min(p.interference_s, s - ep - tp)
    return PhaseCost(p.work_s - ep - tp - inter, p.compute_s, p.tp_comm_exposed_s - tp, p.interference_s - inter,
                     p.mix, p.ep_comm_exposed_s - ep, p.host_exposed_s)
