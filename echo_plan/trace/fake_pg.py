"""A fake ``torch.distributed`` process group for tracing, scoped to a ``with`` block.

torch ships a "fake" backend (``torch.testing._internal.distributed.fake_pg``): every collective
returns at once without moving data, but it goes through the real c10d dispatch, so a dispatch
mode sees each collective with its real input, output and group. The group is created for one
trace and destroyed when the block exits, so no process-group state outlives a trace.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from echo_plan.errors import EchoPlanError
from echo_plan.trace.records import CommGroup, GroupKind


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group this rank (rank 0) traces in: ``size`` ranks, c10d name ``name``."""

    size: int
    name: str
    handle: Any  # the torch ProcessGroup
    # DTensor's batch-first layout with more than one sequence a micro-batch (stack tp_runtime torch): each all-gather's
    # output and each reduce-scatter's input is rearranged by a copy (trace/parallel.py)
    rearranges: bool = False


@dataclass(frozen=True)
class TraceGroups:
    """The groups one traced rank (rank 0 of each) communicates in. ``comm`` maps each c10d group
    name to the CommGroup (kind, size, stride) that places it on the cluster."""

    tp: TPGroup | None
    ep: TPGroup | None = None
    etp: TPGroup | None = None
    comm: dict[str, Any] = field(default_factory=dict)
    cp: TPGroup | None = None  # the context-parallel ring (stride tp)


@contextmanager
def fake_groups(tp: int, ep: int = 1, etp: int = 1, cp: int = 1) -> Iterator[TraceGroups]:
    """Fake TP, expert-parallel, expert-TP and context-parallel groups (each of ranks 0..n-1; this
    process is rank 0).

    Strides follow Megatron-Core's rank order: tp fastest, then cp, for dense layers (a CP group
    has stride tp); for expert layers etp fastest, then ep (so an EP group has stride etp). A group
    of one is None (no collectives).
    """
    world = max(tp, ep, etp, cp)
    if world <= 1:
        yield TraceGroups(None)
        return
    with fake_tp_group(world):
        import torch.distributed as dist

        def group(n: int) -> TPGroup | None:  # one c10d group per role, so each name has one placement
            if n <= 1:
                return None
            handle = dist.new_group(list(range(n)))
            return TPGroup(size=n, name=handle.group_name, handle=handle)

        tp_g, ep_g, etp_g = group(tp), group(ep), group(etp)
        cp_g = group(cp) if cp > 1 else None  # created last: the other groups keep their c10d names
        comm: dict[str, Any] = {}
        for g, kind, stride in ((tp_g, GroupKind.TP, 1), (ep_g, GroupKind.EP, etp), (etp_g, GroupKind.ETP, 1),
                                (cp_g, GroupKind.CP, tp)):
            if g is not None:
                comm[g.name] = CommGroup(kind, size=g.size, stride=stride)
        yield TraceGroups(tp_g, ep_g, etp_g, comm, cp_g)


@contextmanager
def fake_tp_group(tp: int) -> Iterator[TPGroup | None]:
    """Yield a fake TP group of ``tp`` ranks (ranks 0..tp-1, this process is rank 0).

    With ``tp == 1`` there is nothing to communicate (Megatron-LM skips collectives on a group of
    one) and ``None`` is yielded. The default process group is torn down on exit.
    """
    if tp <= 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():  # pragma: no cover - every torch wheel we support ships c10d
        raise EchoPlanError("tracing needs torch.distributed, which this torch build lacks")
    if dist.is_initialized():
        raise EchoPlanError(
            "a torch.distributed process group is already initialised in this process; "
            "trace in a process of its own (the tracer creates and destroys a fake group per trace)"
        )
    hook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]: " and never unwraps it
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        group = dist.group.WORLD
        yield TPGroup(size=tp, name=group.group_name, handle=group)
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
