"""``compare``: the best plan per cluster size, scaling efficiency, and the cost of a token budget."""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, ContextManager, Iterator

from echo_plan.errors import EchoPlanError
from echo_plan.limits import MAX_COMPARE_SIZES, MAX_GPUS, MAX_PRICE_PER_GPU_HOUR, MAX_TOKENS
from echo_plan.search.evaluator import EvaluatorFactory
from echo_plan.search.progress import ProgressSink
from echo_plan.search.prune import PrunedSpace
from echo_plan.search.results import CompareOutcome, CompareRow, SearchOutcome
from echo_plan.search.study import SearchConfig, prune_for, run_search
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.search.ray_eval import ray_session
from echo_plan.search.process_pool import ProcessPool, auto_processes
from echo_plan.simulate import SimulationMemo
from echo_plan.cost.goodput import goodput
from echo_plan.specs.plan import PlanSpec

_TOKEN_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_tokens(text: str | float) -> float:
    """A token count from ``300B``, ``1.5T``, ``2e12``, ``500M`` or a plain number."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
        if m is None:
            raise EchoPlanError(f"--tokens {text!r} is not a token count; use e.g. 300B, 1.5T or 2e12")
        value = float(m.group(1)) * _TOKEN_SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise EchoPlanError(f"--tokens {text!r} must be a positive number of tokens")
    if value > MAX_TOKENS:
        raise EchoPlanError(f"--tokens {text!r} is more than {MAX_TOKENS:.0e} tokens; the largest published "
                            "training runs use ~1e13-4e13")
    return value


def parse_gpu_list(text: str) -> list[int]:
    """``64,96,128`` -> [64, 96, 128] (sorted, distinct)."""
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise EchoPlanError(f"--gpus {text!r}: {part!r} is not a positive number of GPUs; use e.g. 64,96,128")
        if int(part) > MAX_GPUS:
            raise EchoPlanError(f"--gpus: {part} GPUs is more than {MAX_GPUS:,}")
        out.add(int(part))
    if not out:
        raise EchoPlanError("--gpus needs at least one cluster size, e.g. 64,96,128")
    if len(out) > MAX_COMPARE_SIZES:
        raise EchoPlanError(f"--gpus lists {len(out)} cluster sizes; at most {MAX_COMPARE_SIZES} (each is a search)")
    return sorted(out)


def empty_outcome(config: SearchConfig, why: str, candidates_total: int = 0,
                  pruned_counts: dict[str, int] | None = None) -> SearchOutcome:
    """The outcome of a size with no plan that passes the checks (so compare can still show it)."""
    return SearchOutcome(
        model=config.model.model_dump(mode="json"), cluster=config.cluster.model_dump(mode="json"),
        space=config.space.as_json(), sampler=config.sampler.value, seed=config.seed, study_name="", storage="",
        trials=(), ranked=(), pruned_counts=dict(pruned_counts or {}), candidates_total=candidates_total,
        traces_made=0, trace_cache_hits=0, wall_s=0.0, tokens_budget=config.tokens_budget, notes=(why,),
    )


def run_compare(base: SearchConfig, sizes: list[int], factory_for: Callable[[ClusterSpec], EvaluatorFactory],
                price_per_gpu_hour: float | None = None,
                progress_for: Callable[[int], ProgressSink | None] | None = None,
                failure_model=None) -> CompareOutcome:
    """One search per cluster size (``base`` with the cluster resized), then the comparison."""
    if price_per_gpu_hour is not None and not 0 < price_per_gpu_hour <= MAX_PRICE_PER_GPU_HOUR:
        raise EchoPlanError(f"--price-per-gpu-hour {price_per_gpu_hour!r} must be positive and at most "
                            f"{MAX_PRICE_PER_GPU_HOUR:,.0f} (rented H100s cost ~2-10 an hour)")
    t0 = time.perf_counter()
    outcomes: list[tuple[int, SearchOutcome]] = []
    with _ray_for(base), _processes_for(base) as processes:  # one Ray or pool for every size
        remote = processes is not None or base.workers > 0 or bool(base.ray_address)
        memo = None if remote else _shared_memo()  # in-process: one memo for every size
        with _pruned_ahead(base, sizes, remote) as pruned_for:
            for gpus in sizes:
                outcomes.append((gpus, _search_size(base, gpus, factory_for, progress_for, processes,
                                                    pruned_for(gpus), memo)))
    return build_compare(base, outcomes, price_per_gpu_hour, time.perf_counter() - t0, failure_model)


@contextmanager
def _pruned_ahead(base: SearchConfig, sizes: list[int], ahead: bool) -> Iterator[Callable[[int], Any]]:
    """Each size's checked space. With worker processes (or Ray), every size is checked in a thread of
    this process while the workers simulate the sizes before it (checking a size takes seconds, in which
    the workers would otherwise wait); in-process, each when its turn comes. The same checks either way."""
    if not ahead:
        yield lambda gpus: _prune_size(base, gpus)
        return
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="echo-plan-prune")
    futures = {gpus: executor.submit(_prune_size, base, gpus) for gpus in sizes}
    try:
        yield lambda gpus: futures.pop(gpus).result()  # each size's checks are let go once it ran
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def _ray_for(base: SearchConfig) -> ContextManager[None]:
    if base.workers > 0 or base.ray_address:
        return ray_session(base.workers or None, base.ray_address)
    return nullcontext()


@contextmanager
def _processes_for(base: SearchConfig) -> Iterator[Any]:
    """One pool of local worker processes for every size (None: in-process, or on Ray)."""
    n = base.processes if base.processes is not None else auto_processes(base.budget)
    if base.workers > 0 or base.ray_address or n < 2:
        yield None
        return
    pool = ProcessPool(n)
    try:
        yield pool
    finally:
        pool.close()


def _shared_memo() -> Any:
    """The SimulationMemo an in-process compare's sizes share (traces, schedules; its keys hold the
    cluster, so no result of one size serves another)."""
    return SimulationMemo()


def _prune_size(base: SearchConfig, gpus: int) -> PrunedSpace:
    return prune_for(replace(base, cluster=base.cluster.resized(gpus=gpus)))


def _search_size(base: SearchConfig, gpus: int, factory_for: Callable[[ClusterSpec], EvaluatorFactory],
                 progress_for: Callable[[int], ProgressSink | None] | None, processes: Any = None,
                 pruned: PrunedSpace | None = None, memo: Any = None) -> SearchOutcome:
    cluster = base.cluster.resized(gpus=gpus)
    config = replace(base, cluster=cluster)
    pruned = pruned if pruned is not None else _prune_size(base, gpus)
    if not pruned.valid:
        counts = "; ".join(f"{n} {r}" for r, n in pruned.counts().items())
        return empty_outcome(config, f"no plan passes the checks on {gpus} GPUs ({counts})", pruned.total,
                             pruned.counts())
    progress = progress_for(gpus) if progress_for is not None else None
    return run_search(config, factory_for(cluster), pruned=pruned, progress=progress, processes=processes, memo=memo)


def build_compare(base: SearchConfig, outcomes: list[tuple[int, SearchOutcome]], price: float | None,
                  wall_s: float, failure_model=None) -> CompareOutcome:
    """Scaling efficiency (tokens/s per GPU against the smallest size with a plan), time, GPU-hours, cost."""
    ref = next(((g, o.best) for g, o in outcomes if o.best is not None), None)
    notes: list[str] = []
    if ref is not None and ref[0] != outcomes[0][0]:
        notes.append(f"scaling efficiency is relative to {ref[0]} GPUs, the smallest size with a plan that fits")
    rows = []
    for gpus, o in outcomes:
        best = o.best
        eff = train = hours = cost = None
        if best is not None:
            if ref is not None:
                eff = (best.tokens_per_s / gpus) / (ref[1].tokens_per_s / ref[0])
            if base.tokens_budget is not None:
                train = base.tokens_budget / best.tokens_per_s
                hours = train / 3600.0 * gpus
                cost = hours * price if price is not None else None
        good = ettr = train_f = None
        if best is not None:
            g = goodput(best, PlanSpec.build(best.plan), failure_model)
            good, ettr = g.goodput_tokens_per_s, g.ettr
            if base.tokens_budget is not None and good > 0:
                train_f = base.tokens_budget / good
        rows.append(CompareRow(gpus, o, eff, train, hours, cost, good, ettr, train_f))
    notes += goodput_notes(rows)
    return CompareOutcome(model=base.model.model_dump(mode="json"), cluster=base.cluster.model_dump(mode="json"),
                          rows=tuple(rows), tokens_budget=base.tokens_budget, price_per_gpu_hour=price,
                          wall_s=wall_s, notes=tuple(notes))


def goodput_notes(rows: list[CompareRow]) -> list[str]:
    """Where adding GPUs stops paying once failures are counted (goodput: throughput x ETTR)."""
    sized = [(r.num_gpus, r.goodput_tokens_per_s, r.ettr) for r in rows if r.goodput_tokens_per_s]
    if len(sized) < 2:
        return []
    best = max(sized, key=lambda x: x[1])
    out = [f"with failures counted (goodput = throughput x effective training time ratio, cost/goodput.py), "
           f"ETTR falls from {sized[0][2]:.1%} on {sized[0][0]} GPUs to {sized[-1][2]:.1%} on {sized[-1][0]}"]
    if best[0] != sized[-1][0]:
        out.append(f"adding GPUs stops paying at {best[0]} GPUs: beyond it goodput falls "
                   f"({best[1]:,.0f} tokens/s there, {sized[-1][1]:,.0f} on {sized[-1][0]})")
    else:
        a, b = sized[-2], sized[-1]
        gain = b[1] / a[1] - 1
        out.append(f"goodput still grows at the largest size: +{gain:.1%} for {b[0] / a[0]:.2g}x the GPUs "
                   f"({a[0]} -> {b[0]}), i.e. {gain / (b[0] / a[0] - 1):.0%} of linear")
    return out
