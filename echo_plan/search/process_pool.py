"""Evaluating plans on several local processes, without Ray.

A search on one machine spends most of its time in the level-2 replay of candidate plans, one after
another on one core. :class:`ProcessPool` runs them on N worker processes of this machine instead:
each worker builds its own evaluator once per factory, all of them keeping their results in one memo
per worker (so the level-1 memo grows over the search, and over ``compare``'s sizes), and plans are
handed out one at a time (the slowest-looking first), so a slow plan does not hold back the others.
Results come back, and ``on_done`` is called, in the order the plans were given, so the sampler sees
exactly what it sees in-process: the same seed gives the same ranking with any number of processes.

Workers start from a fork server (``multiprocessing``'s ``forkserver``: a clean process that has
imported nothing of this one, so no lock or thread of the parent is copied mid-use); they share the
on-disk trace cache, and the evaluator's file lock makes one of them trace a new layer while the
others wait for it. A worker that dies (killed, out of memory) breaks the pool: it is restarted,
the plan that killed it is marked failed (as on Ray) and the others still run.

Ray (``--workers``, ``--ray-address``) is for several machines; on one machine this pool starts in
well under a second and has no scheduler between the search and the workers.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

from echo_plan.search.evaluator import Evaluation, EvaluatorFactory, OnDone, run_one
from echo_plan.specs.plan import PlanSpec

MAX_AUTO_PROCESSES = 4  # each worker holds its own memo and, when it traces, its own torch (~1 GB)
MIN_PLANS_FOR_PROCESSES = 16  # fewer plans than this: starting workers costs more than it saves


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def auto_processes(plans_to_evaluate: int) -> int:
    """The worker processes a search of about ``plans_to_evaluate`` plans uses when the user does not
    say: one per usable CPU (at most MAX_AUTO_PROCESSES), or 1 (in-process) for a small search or a
    one-CPU machine."""
    if plans_to_evaluate < MIN_PLANS_FOR_PROCESSES:
        return 1
    return min(usable_cpus(), MAX_AUTO_PROCESSES)


def worker_context() -> Any:
    """How worker processes start: from a fork server (a clean process: no lock or thread of this one is
    copied mid-use), or spawned where the OS has none."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


# -- the worker side: one evaluator per factory, for the life of the worker process --------------------
_WORKER_EVALUATORS: dict[str, Any] = {}  # only ever filled inside a worker process
_WORKER_MEMO: dict[str, Any] = {}  # likewise: the SimulationMemo its evaluators share (compare's sizes)


def _factory_key(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _evaluate(job: tuple[str, bytes, PlanSpec]) -> Evaluation:
    key, blob, plan = job
    evaluator = _WORKER_EVALUATORS.get(key)
    if evaluator is None:
        factory = pickle.loads(blob)
        sharing = getattr(factory, "build_sharing", None)
        if sharing is None:
            evaluator = factory.build()
        else:
            evaluator = sharing(_worker_memo())
        prepare = getattr(evaluator, "expect_many", None)
        if prepare is not None:  # a worker exists because many plans follow: the compiled replay pays
            prepare()
        _WORKER_EVALUATORS[key] = evaluator
    return run_one(evaluator, plan)


def _worker_memo() -> Any:
    """The SimulationMemo the worker's sharing evaluators use (made on first use)."""
    if "memo" not in _WORKER_MEMO:
        from echo_plan.simulate import SimulationMemo  # the simulator, imported in the worker only

        _WORKER_MEMO["memo"] = SimulationMemo()
    return _WORKER_MEMO["memo"]


def _warm(_: int) -> int:
    """Imports the simulator, and loads the compiled replay kernels (into the worker memo's switch, and
    so into this process's Numba), in a worker while the parent prepares the first round."""
    _worker_memo().compiled.expect_many()
    return os.getpid()


def replay_size(plan: PlanSpec) -> int:
    """About how many level-2 tasks simulating ``plan`` replays (a guess, only to hand the slowest plans of
    a round out first, so that the round does not wait for one started last): per pipeline rank and
    model chunk, a forward and a backward per micro-batch replayed, and the steady state replays 9 pp
    micro-batches when that is fewer (replay/steady.py)."""
    m = plan.num_microbatches
    return plan.pp * plan.virtual_stages * (9 * plan.pp if plan.pp > 1 and 9 * plan.pp < m else m)


class ProcessPool:
    """N local worker processes shared by every search that binds to it (``compare`` binds each size)."""

    def __init__(self, processes: int) -> None:
        if processes < 2:
            raise ValueError("a process pool needs at least 2 processes; use LocalPool for one")
        self.processes = processes
        self.deaths = 0  # worker processes that died while evaluating a plan
        self._executor: Any = None
        self._start()

    def _start(self) -> None:
        from concurrent.futures import ProcessPoolExecutor

        self._executor = ProcessPoolExecutor(max_workers=self.processes, mp_context=worker_context())
        for i in range(self.processes):
            self._executor.submit(_warm, i)

    def _restart(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._start()

    def bind(self, factory: EvaluatorFactory) -> "BoundPool":
        return BoundPool(self, factory)

    def run(self, blob: bytes, plans: list[PlanSpec], on_done: OnDone) -> list[Evaluation]:
        """Evaluate ``plans`` (``on_done`` in their order). When a worker dies the pool is restarted and
        the plans not yet finished run one at a time, so the plan that kills a worker is the one marked
        failed, as on Ray; the others still run."""
        from concurrent.futures.process import BrokenProcessPool

        key = _factory_key(blob)
        out: list[Evaluation] = []
        try:
            futures: list[Any] = [None] * len(plans)
            for i in sorted(range(len(plans)), key=lambda i: -replay_size(plans[i])):  # the slowest first
                futures[i] = self._executor.submit(_evaluate, (key, blob, plans[i]))
            for fut in futures:
                ev = fut.result()
                on_done(len(out), ev)
                out.append(ev)
            return out
        except BrokenProcessPool:
            self._restart()
        for plan in plans[len(out):]:  # one at a time: a death now names its plan
            try:
                ev = self._executor.submit(_evaluate, (key, blob, plan)).result()
            except BrokenProcessPool:
                self.deaths += 1
                self._restart()
                ev = Evaluation(None, "worker failed: its process died while evaluating this plan (killed, or "
                                "out of memory)", 0.0, 0, 0)
            on_done(len(out), ev)
            out.append(ev)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class BoundPool:
    """A :class:`ProcessPool` evaluating with one factory: the pool interface the search uses."""

    def __init__(self, pool: ProcessPool, factory: EvaluatorFactory, owns: bool = False) -> None:
        self.pool = pool
        self.factory = factory
        self.workers = pool.processes
        self._blob = pickle.dumps(factory)
        self._owns = owns

    def evaluate_many(self, plans: list[PlanSpec], on_done: OnDone) -> list[Evaluation]:
        return self.pool.run(self._blob, plans, on_done)

    def close(self) -> None:
        if self._owns:
            self.pool.close()


def own_pool(factory: EvaluatorFactory, processes: int) -> BoundPool:
    """A pool of ``processes`` workers for one search, closed with it."""
    return BoundPool(ProcessPool(processes), factory, owns=True)
