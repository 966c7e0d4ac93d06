"""The host that issues an MoE layer's kernels, where the dispatcher's synchronisation makes it matter.

Megatron-Core's dropless MoE dispatchers (alltoall, allgather, flex) copy the tokens each expert
receives to the host when they are counted, before the token permutation, and the host waits for
that copy before the all-to-all (Transformer Engine's grouped GEMM takes its splits as a host list;
the all-to-all its split sizes: ``token_dispatcher.py`` ``cuda_sync_point``), i.e. until the GPU has
run everything queued before the permutation (stack ``moe_host_sync``). From that point the GPU runs only what the
host has issued since, so until the next MoE layer's synchronisation each kernel is released one
host issue time after the one before (the cluster's ``calibration.host``: seconds per traced
kernel, fitted on named runs; a kernel the trace records stands for the several small ops eager
PyTorch launches around it). A part of the layer captured in a CUDA graph (stack
``cuda_graph_scope``) is released as one launch, and a run of plain PyTorch elementwise or copy kernels that
one module issues back to back (Megatron-Core's unfused RoPE under a YaRN factor, its per-expert bias loop, MLA's
copies) as one issue: such ops cost the host a few microseconds each, where the figure, fitted per traced kernel,
stands for a library kernel's call and the small ops around it (a JUDGEMENT between one issue per op, which would
charge a 32-op loop 8 ms on B200's figure, and none). Where a layer's kernels are short (small experts, few tokens
per micro-batch) the GPU waits for the host; where they are long it does not.

``host_exposed_s`` replays one MoE layer's forward in steady state: the cycle from its
synchronisation to the next layer's (the layer's ops from the first token permutation on, then the
ops before it, which the next layer repeats), gated by a host stream, against the same cycle with
the host always ahead; the difference is what the host adds to the layer's forward. The backward
is issued by autograd's engine without a synchronisation and runs ahead. Not gated here: recomputed
forwards and the Chakra export's level-1 timings. The paired passes of an EP overlap (``replay/split.py``) are
replayed without a host; their saving is measured against the passes apart, the forward's wait included, and
hides what the pair exposed (exchange, then TP, then interference), so there the other pass's kernels may cover
part of the wait, as they can in Megatron-Core's combined schedule (not checked against a profile).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from echo_plan.replay.engine import Task, replay
from echo_plan.replay.interference import InterferenceModel
from echo_plan.replay.kinds import TaskKind
from echo_plan.specs.software import CudaGraphScope
from echo_plan.trace.records import OpKind

__all__ = ["HostIssue", "host_exposed_s", "sync_position", "host_issue_for"]

SYNC_OP = "moe_permute"  # the first token permutation of the layer: the dispatcher synchronises just before it
HOST_DEVICE = -1  # host tasks on a device of their own: they neither suffer nor cause interference


@dataclass(frozen=True, slots=True)
class HostIssue:
    """The host's pace after an MoE dispatcher's synchronisation: seconds per traced kernel, and the parts of
    the layer its CUDA graphs launch at once."""

    op_s: float
    graphs: tuple[CudaGraphScope, ...] = ()


def host_issue_for(stack: Any, cluster: Any, is_moe: bool) -> HostIssue | None:
    """The host model of ``stack`` on ``cluster``: None unless the stack's dispatcher synchronises, the model has
    experts and the cluster's calibration has a host issue time (``calibration.host.op_us``)."""
    if not (is_moe and getattr(stack, "moe_host_sync", False)):
        return None
    host = (getattr(cluster, "calibration", None) or {}).get("host") or {}
    op_us = host.get("op_us")
    if not op_us or float(op_us) <= 0.0:
        return None
    return HostIssue(float(op_us) * 1e-6, tuple(stack.cuda_graph_scope))


def sync_position(tasks: Sequence[Task]) -> int | None:
    """Position in ``tasks`` (a forward phase, trace order) of the first token permutation, or None."""
    return next((i for i, t in enumerate(tasks) if SYNC_OP in t.name), None)


def _captured(by_index: Mapping[int, Any], tasks: Sequence[Task], at: int,
              graphs: tuple[CudaGraphScope, ...]) -> set[int]:
    """Ids of the tasks a CUDA graph of ``graphs`` launches: before the pre-MLP norm (the input norm, the
    attention, its residual add) for ``attn``; from the pre-MLP norm to the synchronisation (the norm, the
    router, the dispatcher's counting) for ``moe_router`` / ``moe_preprocess``."""
    if not graphs:
        return set()
    ids = [t.id for t in tasks]
    norm = next((i for i, tid in enumerate(ids) if tid in by_index and by_index[tid].module == "mlp_norm"), at)
    out: set[int] = set()
    if CudaGraphScope.ATTN in graphs:
        out.update(ids[:norm])
    if CudaGraphScope.MOE_ROUTER in graphs or CudaGraphScope.MOE_PREPROCESS in graphs:
        out.update(ids[norm:at])
    return out


def _chain_module(op: Any) -> str | None:
    """The module of a plain PyTorch elementwise or copy kernel (an aten op a module issues itself, not a fused
    or library kernel), else None."""
    if op is None or not op.module or op.kind not in (OpKind.ELEMENTWISE, OpKind.COPY):
        return None
    return op.module if op.name.startswith("aten.") else None


def host_exposed_s(ops: Sequence[Any], tasks: list[Task], host: HostIssue) -> float:
    """Seconds the host adds to one MoE layer's forward in steady state (module docstring); 0 without a token
    permutation in ``tasks``."""
    at = sync_position(tasks)
    if at is None or host.op_s <= 0.0:
        return 0.0
    by_index = {op.index: op for op in ops}
    captured = _captured(by_index, tasks, at, host.graphs)
    cycle = tasks[at:] + tasks[:at]  # from this layer's synchronisation to the next layer's
    # deps inside the cycle only: the inputs of the ops after the synchronisation that come before it are done
    # (the host waited for them), and the next layer's ops before its synchronisation follow on the same streams
    after = {t.id for t in tasks[at:]}
    kept = [replace(t, deps=tuple(d for d in t.deps if (d in after) == (t.id in after))) for t in cycle]
    free = replay(kept, InterferenceModel.none()).makespan_s
    base = max(t.id for t in tasks) + 1
    gated: list[Task] = []
    previous_captured, previous_chain = False, None
    for k, t in enumerate(kept):
        graphed = t.id in captured
        chain = _chain_module(by_index.get(t.id))
        # the permutation itself was issued before the host blocked (Megatron-Core copies the counts to the host
        # before it and waits for them before the all-to-all); a graph is one launch, a module's run of aten ops one issue
        repeat = (graphed and previous_captured) or (chain is not None and chain == previous_chain)
        cost = 0.0 if k == 0 or repeat else host.op_s
        previous_captured, previous_chain = graphed, chain
        gated.append(Task(base + k, HOST_DEVICE, "host", cost, TaskKind.DELAY, name="host issue"))
        gated.append(replace(t, deps=t.deps + (base + k,)))
    return max(0.0, replay(gated, InterferenceModel.none()).makespan_s - free)
