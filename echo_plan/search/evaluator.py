"""Evaluating one candidate plan: the narrow interface between the search and the simulator.

An :class:`Evaluator` turns a plan into a StepResult and counts the traces it made and the trace
cache hits. The search builds evaluators from an :class:`EvaluatorFactory`, a small picklable
object, so that Ray workers can build their own; :class:`SimulatorFactory` is the real one and
calls ``echo_plan.simulate.simulate`` with an on-disk trace cache shared by every worker and a
level-1 memo kept for the life of the evaluator (one process).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from echo_plan.errors import EchoPlanError
from echo_plan.replay.results import StepResult
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.software import SoftwareSpec
from echo_plan.simulate import SimulationMemo
from echo_plan.trace.cache import TraceCache
from echo_plan.simulate import simulate


@runtime_checkable
class Evaluator(Protocol):
    def evaluate(self, plan: PlanSpec) -> StepResult:
        """Simulate one training step of ``plan``."""
        ...

    @property
    def traces_made(self) -> int:
        """Layer traces this evaluator produced so far (trace cache misses)."""
        ...

    @property
    def cache_hits(self) -> int:
        """Layer traces this evaluator found in the trace cache so far."""
        ...


@runtime_checkable
class EvaluatorFactory(Protocol):
    def build(self) -> Evaluator:
        """A fresh evaluator for this process (called once per process or Ray worker)."""
        ...


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What one evaluation gave: a result or an error, its wall time and the trace counters it moved."""

    result: StepResult | None
    error: str
    wall_s: float
    traces_made: int
    cache_hits: int
    node: str = ""  # the Ray node that ran it ("" in-process)


def run_one(evaluator: Evaluator, plan: PlanSpec) -> Evaluation:
    """Evaluate ``plan``; a plan the simulator rejects becomes an error string, not a crash."""
    made0, hits0 = evaluator.traces_made, evaluator.cache_hits
    t0 = time.perf_counter()
    try:
        result: StepResult | None = evaluator.evaluate(plan)
        error = ""
    except EchoPlanError as exc:
        result, error = None, str(exc)
    except Exception as exc:  # a simulator bug on one plan must not lose the whole search
        result = None
        last = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" at {Path(last.filename).name}:{last.lineno}" if last else ""
        error = f"{type(exc).__name__}: {exc}{where}"
    return Evaluation(result, error, time.perf_counter() - t0,
                      evaluator.traces_made - made0, evaluator.cache_hits - hits0)


class SimulatorEvaluator:
    """The real evaluator: ``simulate`` with a shared on-disk trace cache and a per-process memo.

    Before simulating, the plan's traces are fetched (or made) while holding a file lock named after
    the plan's (tp, micro-batch, dtype) in the cache folder, so when several Ray workers need the same
    new layer at once,
    one traces it and the others wait and read it from the cache: each distinct layer is traced
    once per search, not once per worker.
    """

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cache_dir: str | None,
                 stack: SoftwareSpec | None = None, memory_headroom_bytes: int | None = None, memo=None) -> None:
        self.model = model
        self.cluster = cluster
        self.memo = memo if memo is not None else SimulationMemo()
        self.stack = stack if stack is not None else self.memo.default_stack()
        self.headroom = memory_headroom_bytes
        self.cache = TraceCache(cache_dir)
        self._ready: set[tuple] = set()

    def evaluate(self, plan: PlanSpec) -> StepResult:
        key = (plan.tp, plan.cp, plan.sequence_parallel, plan.micro_batch_size, plan.dtype.value, plan.recompute.value)
        if key not in self._ready:
            from filelock import FileLock

            self.cache.root.mkdir(parents=True, exist_ok=True)
            # The embedding and output traces are shared by plans that differ in recompute or sequence
            # parallelism, so the lock covers every plan that can share a trace: same tp, mbs, dtype.
            lock = self.cache.root / f".lock-{self.model.name}-tp{plan.tp}-cp{plan.cp}-mbs{plan.micro_batch_size}-{plan.dtype.value}"
            with FileLock(str(lock)):
                # kept in the memo for later plans: the stack as simulate runs it, so the keys agree
                self.memo.traces(self.model, plan, self.cache, self.stack.as_run(plan, self.cluster.gpu.sm_arch))
            self._ready.add(key)
        return simulate(self.model, self.cluster, plan, stack=self.stack, cache=self.cache, memo=self.memo,
                        memory_headroom_bytes=self.headroom)

    def expect_many(self) -> None:
        """Many plans will follow: load the compiled level 2 now (it pays from the first plan on)."""
        self.memo.compiled.expect_many()

    @property
    def traces_made(self) -> int:
        return int(self.cache.misses)

    @property
    def cache_hits(self) -> int:
        return int(self.cache.hits)


@dataclass(frozen=True, slots=True)
class SimulatorFactory:
    """Builds :class:`SimulatorEvaluator`; picklable, so Ray workers build their own."""

    model: ModelSpec
    cluster: ClusterSpec
    cache_dir: str | None = None
    stack: SoftwareSpec | None = None
    memory_headroom_bytes: int | None = None

    def build(self) -> Evaluator:
        return SimulatorEvaluator(self.model, self.cluster, self.cache_dir, self.stack, self.memory_headroom_bytes)

    def build_sharing(self, memo) -> Evaluator:
        """An evaluator that keeps its results in ``memo`` (a SimulationMemo shared with other evaluators of
        this process: ``compare``'s sizes in one worker share traces, layer timings and schedules; the
        memo's keys hold the cluster, so no result of one cluster serves another)."""
        return SimulatorEvaluator(self.model, self.cluster, self.cache_dir, self.stack, self.memory_headroom_bytes,
                                  memo)


OnDone = Callable[[int, Evaluation], None]


class LocalPool:
    """Evaluates plans one after another in this process, with one evaluator for the whole search
    (keeping its results in ``memo`` where given: ``compare`` shares one between its sizes; ``many``:
    the search is large enough for the evaluator to prepare for it, as ``expect_many`` does)."""

    def __init__(self, factory: EvaluatorFactory, memo=None, many: bool = False) -> None:
        sharing = getattr(factory, "build_sharing", None) if memo is not None else None
        self.evaluator = sharing(memo) if sharing is not None else factory.build()
        prepare = getattr(self.evaluator, "expect_many", None) if many else None
        if prepare is not None:
            prepare()
        self.workers = 1

    def evaluate_many(self, plans: list[PlanSpec], on_done: OnDone) -> list[Evaluation]:
        out = []
        for i, plan in enumerate(plans):
            ev = run_one(self.evaluator, plan)
            on_done(i, ev)
            out.append(ev)
        return out

    def close(self) -> None:
        return None
