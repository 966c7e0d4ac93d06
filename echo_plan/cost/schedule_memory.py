"""Micro-batches held in flight by each schedule: the counts of 1F1B, GPipe and the interleaved schedule in closed
form, and the activation peaks of the schedules that split the backward (ZB-H1, ZB-V, DualPipe) from their
action lists (``echo_plan/cost/memory.py`` assembles them with the rest of a stage's memory).

A forward adds its chunk's saved bytes; a whole backward frees them; an input-gradient pass frees
them but keeps what the deferred weight-gradient pass reads (``retained``) until that W runs. The
peak of that walk is the rank's activations. Since only the counts of passes held change along a
list, the search walks each schedule shape once (:func:`held_profile`) and prices a candidate by
the largest of those counts dotted with its bytes.
"""

from __future__ import annotations

from functools import lru_cache

from echo_plan.layout.layer_mix import kind_counts
from echo_plan.layout.schedules import Pass, build_schedule
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec, Schedule


def inflight_chunk_passes(plan: PlanSpec, stage: int) -> int:
    """Forward passes (of one model chunk each) held on ``stage`` at its activation peak."""
    p, m, v = plan.pp, plan.num_microbatches, plan.virtual_stages
    if plan.schedule is Schedule.GPIPE:
        return m * v
    if plan.schedule is Schedule.INTERLEAVED and v > 1:
        return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return min(p - stage, m)


def inflight_on_chunk(plan: PlanSpec, stage: int, chunk: int) -> int:
    """Micro-batches whose forward on model chunk ``chunk`` of ``stage`` is held at the peak."""
    p, v = plan.pp, plan.virtual_stages
    n = inflight_chunk_passes(plan, stage)
    if v == 1:
        return n
    if plan.schedule is Schedule.GPIPE:
        return plan.num_microbatches
    # Megatron-LM's interleaved order: p micro-batches on chunk 0, the same p on chunk 1, ...
    return sum(1 for k in range(n) if (k % (p * v)) // p == chunk)


def walk_peak(actions, held: list[float], retained: list[float]) -> float:
    """Peak bytes over one rank's action list: ``held[c]`` per forward of chunk c until its backward
    (or its input-gradient pass), ``retained[c]`` from an input-gradient pass until its W."""

    live = peak = 0.0
    for a in actions:
        c = a.chunk
        if a.kind is Pass.FORWARD:
            live += held[c]
        elif a.kind is Pass.BACKWARD:
            live -= held[c]
        elif a.kind is Pass.INPUT_GRAD:
            live += retained[c] - held[c]
        else:
            live -= retained[c]
        peak = max(peak, live)
    return peak


@lru_cache(maxsize=256)
def held_profile(schedule: Schedule, pp: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the distinct maximal (forwards held per chunk..., W pending per chunk...) counts over
    its action list: the peak of any ``walk_peak`` is the largest of these dotted with (held, retained),
    so the search's memory estimate walks each schedule shape once, not once per candidate."""

    sched = build_schedule(schedule, pp, m, v)
    chunks = sched.virtual_stages
    out = []
    for acts in sched.actions:
        counts = [0] * (2 * chunks)
        seen = set()
        for k, a in enumerate(acts):
            c = a.chunk
            if a.kind is Pass.FORWARD:
                counts[c] += 1
            elif a.kind is Pass.INPUT_GRAD:
                counts[c] -= 1
                counts[chunks + c] += 1
            elif a.kind is Pass.BACKWARD:
                counts[c] -= 1
            else:
                counts[chunks + c] -= 1
            if a.kind is not Pass.BACKWARD and a.kind is not Pass.WEIGHT_GRAD and (
                    k + 1 == len(acts) or acts[k + 1].kind is not Pass.FORWARD):
                seen.add(tuple(counts))  # a forward only adds: the state after the next one dominates this
        out.append(_maximal(seen))
    return tuple(out)


def _maximal(states: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The states no other state dominates (>= in every count), sorted: only they can hold a peak."""
    import numpy as np

    if len(states) < 2:
        return tuple(sorted(states))
    arr = np.array(sorted(states), dtype=np.int64)
    covers = (arr[:, None, :] >= arr[None, :, :]).all(axis=2)  # [i, j]: state i >= state j everywhere
    np.fill_diagonal(covers, False)  # the states are distinct, so i >= j with i != j is domination
    return tuple(tuple(int(x) for x in row) for row in arr[~covers.any(axis=0)])


def profile_microbatches(schedule: Schedule, pp: int, m: int) -> int:
    """The micro-batch count whose action lists show the peak of ``m``: warm-up and a steady state
    are enough (4 x pp; tests/cost/test_schedule_memory.py checks it), so the search's estimate
    builds one order per pipeline depth instead of one per micro-batch count."""
    return min(m, 4 * pp)


def profile_peak(profile: tuple[tuple[int, ...], ...], held: list[float], retained: list[float]) -> float:
    weights = list(held) + list(retained)
    return max((sum(n * w for n, w in zip(p, weights)) for p in profile), default=0.0)


def walk_stage(model: ModelSpec, plan: PlanSpec, sched, profile, rank: int, saved, first, retained,
                embed_saved: int, output_saved: int, cache: dict | None = None) -> float:
    """Activations of one rank of a schedule that splits the backward: the peak of its action list.
    ``cache``: a dict the caller keeps across the ranks of one plan (its layer split, once)."""

    cache = cache if cache is not None else {}
    split = cache.get("split")
    if split is None:
        per = plan.virtual_layers(model.num_layers)
        starts = [0]
        for n in per:
            starts.append(starts[-1] + n)
        split = cache["split"] = (per, starts, {})
    per_vs, starts, kinds_of = split
    by_kind, emb_keep, out_keep = retained
    held, kept = [], []
    for c in range(sched.virtual_stages):
        vs = sched.virtual_stage(rank, c)
        start = starts[vs]
        kinds = kinds_of.get(vs)
        if kinds is None:
            kinds = kinds_of[vs] = kind_counts(model, start, per_vs[vs])
        h = k = 0.0
        for kind, n in kinds:
            h += saved.get(kind, first)[0] * n
            k += by_kind.get(kind, next(iter(by_kind.values()))) * n
        if vs == 0:
            h, k = h + embed_saved, k + emb_keep
        if vs == sched.num_virtual_stages - 1:
            mtp = model.mtp_layers
            h += output_saved * (1 + mtp) + (saved.get(model.mtp_kind, first)[0] * mtp if mtp else 0)
            k += out_keep * (1 + mtp) + (by_kind.get(model.mtp_kind, 0) * mtp if mtp else 0)
        held.append(h)
        kept.append(k)
    return profile_peak(profile, held, kept)
