"""What would make a plan that does not fit its GPUs fit: the same plan with more recomputation or more
data-parallel sharding, its memory taken from the traces already made (``simulate``'s hint).

Every trace of a transformer layer records the bytes it saves for backward under each recompute mode
(``LayerTrace.saved_bytes_by_mode``), and sharding changes model states and buffers, not what a layer
saves, so both kinds of change are priced without tracing or replaying again. The step time of a changed
plan is not predicted here: recomputation lengthens the step and sharding adds collectives (simulate the
changed plan, or let ``search`` rank the plans that fit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator

from echo_plan.cost.memory import stage_memory
from echo_plan.errors import SpecError
from echo_plan.layout.sharding import DataParallelSharding
from echo_plan.specs.plan import PlanSpec, Recompute, Sharding
from echo_plan.specs.software import SoftwareSpec
from echo_plan.specs.software_checks import check_plan_supported

GiB = 2**30
_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
_LEVELS = (Sharding.NONE, Sharding.OPTIMIZER, Sharding.GRADIENTS, Sharding.PARAMETERS)


@dataclass(frozen=True)
class FitChange:
    """One changed plan: the flags that make it, its recompute mode, its peak memory, and whether every stage fits."""

    flags: str
    recompute: Recompute
    peak_bytes: int
    fits: bool

    @property
    def single(self) -> bool:
        return self.flags.count("--") == 1


@dataclass(frozen=True)
class _TracesView:
    """``traces`` with each transformer layer's saved bytes under another recompute mode."""

    block: Any
    embedding: Any
    output: Any
    blocks: tuple = ()


def _with_recompute(traces: Any, mode: Recompute) -> _TracesView:
    def saved(kind, trace):
        if getattr(kind, "recomputed", False) or mode.value not in trace.saved_bytes_by_mode:
            return trace  # a layer recomputed whole (recompute_layers) keeps its full-recompute trace
        return replace(trace, saved_bytes=trace.saved_bytes_by_mode[mode.value])

    blocks = tuple((kind, saved(kind, t)) for kind, t in getattr(traces, "blocks", ()))
    block = next((t for k, t in blocks if t.key == traces.block.key), saved(None, traces.block))
    return _TracesView(block=block, embedding=traces.embedding, output=traces.output, blocks=blocks)


def _variants(plan: PlanSpec, stack: SoftwareSpec) -> Iterator[tuple[str, dict, Recompute]]:
    """(flags, plan fields, recompute mode) of each change worth pricing: stronger recomputation alone,
    more sharding alone, then the two together."""
    stronger = [m for m in _ORDER if _ORDER.index(m) > _ORDER.index(plan.recompute)]
    level = DataParallelSharding.of(plan, stack).level
    more = [lv for lv in _LEVELS if _LEVELS.index(lv) > _LEVELS.index(level)]

    def recompute(mode: Recompute) -> dict:  # full recomputes every layer: it replaces --recompute-layers
        return {"recompute": mode.value} | ({"recompute_layers": 0} if mode is Recompute.FULL else {})

    for mode in stronger:
        yield f"--recompute {mode.value}", recompute(mode), mode
    for lv in more:
        yield f"--sharding {lv.value}", {"sharding": lv.value, "distributed_optimizer": True}, plan.recompute
    for mode in stronger:
        for lv in more:
            yield (f"--recompute {mode.value} --sharding {lv.value}",
                   recompute(mode) | {"sharding": lv.value, "distributed_optimizer": True}, mode)


def fit_changes(model, plan: PlanSpec, cluster, traces, asked: SoftwareSpec,
                headroom_bytes: int | None = None) -> tuple[FitChange, ...]:
    """The changes of recomputation and sharding that ``asked`` (the stack as the user gave it) can run,
    each with its peak memory from ``traces`` (the plan's own). Changes the plan rules or the stack refuse
    are left out."""
    out = []
    for flags, fields, mode in _variants(plan, asked):
        try:
            changed = PlanSpec.model_validate({**plan.model_dump(), **fields})
            stack = asked.as_run(changed, cluster.gpu.sm_arch)
            check_plan_supported(stack, changed)
        except (SpecError, ValueError):
            continue
        memory = stage_memory(model, changed, cluster, _with_recompute(traces, mode), stack, headroom_bytes)
        out.append(FitChange(flags, mode, max(m.total_bytes for m in memory), all(m.fits for m in memory)))
    return tuple(out)


def fit_note(changes: tuple[FitChange, ...]) -> str:
    """One line for simulate: the least recomputation that fits alone, the least sharding that fits alone, and
    the first pair that needs less of both, or that nothing fits."""
    rest = ("more pipeline, tensor or context parallelism, or a smaller micro-batch (search ranks the plans that "
            "fit)")
    if not changes:
        return "it already has the most recomputation and sharding the plan and stack allow: " + rest
    if not any(c.fits for c in changes):
        tried = ", ".join(c.flags for c in changes if c.single)
        return f"no more recomputation or sharding makes it fit (tried {tried}, and each pair of them): " + rest
    rank = {c.flags: i for i, c in enumerate(changes)}  # _variants' order: lighter changes first
    alone = [c for c in changes if c.fits and c.single]
    recompute = next((c for c in alone if c.flags.startswith("--recompute")), None)
    sharding = next((c for c in alone if c.flags.startswith("--sharding")), None)

    def lighter(c: FitChange) -> bool:
        words = c.flags.split()
        return ((recompute is None or rank.get(f"--recompute {words[1]}", -1) < rank[recompute.flags])
                and (sharding is None or rank.get(f"--sharding {words[3]}", -1) < rank[sharding.flags]))
    pair = next((c for c in changes if c.fits and not c.single and lighter(c)), None)
    shown = [c for c in (recompute, sharding, pair) if c is not None]
    what = "; ".join(f"{c.flags} ({c.peak_bytes / GiB:.1f} GiB peak)" for c in shown)
    return (f"it fits with {what}: memory from this plan's traces; the step with that change is not simulated "
            "here (recomputation lengthens it, sharding adds collectives)")
