"""The plan search as an Optuna study: sampling, evaluation rounds, persistence and the outcome.

* Every combination of the space is checked first (``prune.py``); the sampler's categorical
  choices per knob are the values that at least one valid candidate takes, and a sampled
  combination that breaks a rule becomes a pruned trial with its reason, with no simulation.
* Samplers: TPE (single objective, step time), NSGA-II (tokens/s vs peak memory: Pareto front) and
  grid (every valid candidate). ``auto`` is grid when the valid candidates fit in the budget,
  else TPE.
* The budget counts distinct plans simulated (``DEFAULT_TRIALS``); repeats of a plan reuse its
  result. Trials are asked in rounds of ``ROUND_SIZE`` and told in ask order, so the sequence of
  proposals, hence the answer, is the same in-process and on any number of Ray workers.
* TPE ends with a local polish: the last ``POLISH_SHARE`` of the budget goes to the valid plans
  nearest to the best plan so far (fewest knobs changed, then the smallest moves along each
  knob's values), re-centred after every round. TPE finds the region of the optimum; the polish
  checks its neighbours, which TPE may leave untried (held by tests on two model/cluster pairs).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

from echo_plan.errors import EchoPlanError
from echo_plan.replay.results import StepResult
from echo_plan.search.evaluator import Evaluation, EvaluatorFactory, LocalPool
from echo_plan.search.explain import knob_stats, offload_hint
from echo_plan.search.progress import ProgressSink
from echo_plan.search.config import DEFAULT_TRIALS, SamplerKind, SearchConfig, prune_for, resolve_sampler
from echo_plan.search.prune import MemoryEstimator, PrunedSpace, PruneReason, Verdict, plan_key
from echo_plan.search.results import SearchOutcome, TrialRecord, TrialState
from echo_plan.search.space import Knob
from echo_plan.search.storage import TrialStore, default_storage_url, derive_study_name, model_code_version
from echo_plan.cost.kernel_db import database_digest
from echo_plan import __version__
from echo_plan.search.ray_eval import ray_advice
from echo_plan.search.process_pool import MIN_PLANS_FOR_PROCESSES, auto_processes, own_pool
from echo_plan.search.ray_eval import RayPool

# the search's public names (SearchConfig and the sampler live in config.py; imported from here too)
__all__ = ["DEFAULT_TRIALS", "IN_MEMORY", "POLISH_SHARE", "ROUND_SIZE", "SamplerKind", "SearchConfig", "pareto_front",
           "prune_for", "resolve_sampler", "run_search"]
ROUND_SIZE = 8  # trials asked together (TPE with constant liar), independent of the worker count
MAX_TRIALS_FACTOR = 5  # stop after this many trials per budgeted plan (samplers that keep repeating)
POLISH_SHARE = 0.2  # TPE: the last fifth of the budget explores around the best plan so far
IN_MEMORY = "memory"  # storage value for a study that is not persisted


def run_search(config: SearchConfig, factory: EvaluatorFactory, *, pruned: PrunedSpace | None = None,
               memory: MemoryEstimator | None = None, progress: ProgressSink | None = None,
               processes: Any = None, memo: Any = None) -> SearchOutcome:
    """Run (or resume) the search and return its outcome; every finished trial is already stored.
    ``processes``: a ProcessPool (search/process_pool.py) the caller owns and shares between searches;
    ``memo``: a SimulationMemo an in-process search keeps its results in (shared between searches)."""
    if config.budget < 1:
        raise EchoPlanError("--trials must be at least 1")
    t0 = time.perf_counter()
    pruned = pruned if pruned is not None else prune_for(config, memory)
    if not pruned.valid:
        counts = "; ".join(f"{n} {r}" for r, n in pruned.counts().items())
        raise EchoPlanError(f"no candidate plan of the space passes the checks ({pruned.total} candidates: "
                            f"{counts}); run with --explain to see each knob value, or widen the space"
                            + offload_hint(config.stack, config.cluster, config.space, pruned))
    return _Search(config, factory, pruned, progress, processes, memo).run(t0)


class _Search:
    """One run of a search: the mirror study, the store, the records made so far."""

    def __init__(self, config: SearchConfig, factory: EvaluatorFactory, pruned: PrunedSpace,
                 progress: ProgressSink | None, processes: Any = None, memo: Any = None) -> None:
        import optuna

        self.shared_processes = processes
        self.shared_memo = memo
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.config = config
        self.factory = factory
        self.pruned = pruned
        self.progress = progress
        self.sampler = resolve_sampler(config, len(pruned.valid))
        self.varying = [k.value for k in config.space.varying]
        self.index = {tuple(v.combo.values()): i for i, v in enumerate(pruned.verdicts)}
        self.distributions = self._distributions()
        self.directions = ["maximize", "minimize"] if self.sampler is SamplerKind.NSGA2 else ["minimize"]
        self._target = 0
        self._keys: dict[int, tuple] = {}  # id(verdict) -> plan key (verdicts live as long as the search)
        self.records: list[TrialRecord] = []
        self.results: dict[tuple, StepResult] = {}
        self.attempted: set[tuple] = set()
        self.traces_made = self.cache_hits = 0
        self.polished = 0  # plans chosen by the local polish (TPE)
        self._by_key: dict[tuple, Verdict] | None = None
        self.notes: list[str] = []
        model_json = config.model.model_dump(mode="json")
        cluster_json = config.cluster.model_dump(mode="json")

        self.study_name = config.study_name or derive_study_name(
            model_json, cluster_json, config.global_batch_size, config.space.digest(), self.sampler.value,
            config.seed, f"{__version__}+{model_code_version()}",
            [config.software.model_dump(mode="json"), config.memory_headroom_bytes, database_digest(config.cluster.gpu)])
        self.url = config.storage or default_storage_url()
        self.store = None if self.url == IN_MEMORY else TrialStore(self.url, self.study_name, self.directions)
        self.mirror = optuna.create_study(directions=self.directions, sampler=self._make_sampler())

    # -- setup -----------------------------------------------------------------------------------
    def _resolved(self, v: Verdict) -> Verdict:
        return self.pruned.verdicts[v.same_as] if v.reason is PruneReason.DUPLICATE and v.same_as is not None else v

    def _distributions(self) -> dict[str, Any]:
        """Per varying knob, the values (in the space's order) that some valid candidate takes."""
        from optuna.distributions import CategoricalDistribution

        taken: dict[str, set] = {name: set() for name in self.varying}
        for v in self.pruned.verdicts:
            if self._resolved(v).reason is None:
                for name in self.varying:
                    taken[name].add(v.combo[name])
        return {name: CategoricalDistribution([x for x in self.config.space.values(Knob(name)) if x in taken[name]])
                for name in self.varying}

    def _make_sampler(self) -> Any:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.sampler is SamplerKind.TPE:
                return optuna.samplers.TPESampler(seed=self.config.seed, multivariate=True, constant_liar=True,
                                                  n_startup_trials=min(10, max(2, self.config.budget // 5)),
                                                  warn_independent_sampling=False)
            if self.sampler is SamplerKind.NSGA2:
                pop = max(4, min(50, self.config.budget // 3))
                return optuna.samplers.NSGAIISampler(seed=self.config.seed, population_size=pop)
            return optuna.samplers.RandomSampler(seed=self.config.seed)  # grid: every trial is enqueued

    def _resume(self) -> None:
        if self.store is None:
            return
        loaded = self.store.load()
        for record in loaded:
            self.records.append(record)
            if record.state is not TrialState.PRUNED:
                key = plan_key(record.plan)
                self.attempted.add(key)
                if record.result is not None:
                    self.results[key] = record.result
            self._add_to_mirror(record)
        if loaded:
            self.notes.append(f"resumed {len(loaded)} finished trials from study {self.study_name!r}")

    def _add_to_mirror(self, record: TrialRecord) -> None:
        """A stored trial as history for the sampler (skipped if the space's choices changed)."""
        params = {k: record.plan.get(k) for k in self.varying}
        if all(params[k] in self.distributions[k].choices for k in self.varying):
            self._tell(None, params, record)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, t0: float) -> SearchOutcome:
        self._resume()
        n_valid = len(self.pruned.valid)
        explicit_grid = self.sampler is SamplerKind.GRID and self.config.n_trials is None
        target = n_valid if explicit_grid else min(self.config.budget, n_valid)  # grid: exhaustive
        pool = self._pool(target - len(self.attempted))
        max_trials = len(self.records) + MAX_TRIALS_FACTOR * self.config.budget
        if self.sampler is SamplerKind.GRID:
            for v in self.pruned.valid:
                if plan_key(v.plan.model_dump(mode="json")) not in self.attempted:
                    self.mirror.enqueue_trial({k: v.combo[k] for k in self.varying})
        self._target = target
        polish_from = target - int(POLISH_SHARE * target) if self.sampler is SamplerKind.TPE else target
        try:
            while len(self.attempted) < target and len(self.records) < max_trials:
                size = ROUND_SIZE if self.sampler is not SamplerKind.GRID else max(ROUND_SIZE, 2 * pool.workers)
                polish = len(self.attempted) >= polish_from and self._incumbent() is not None
                self._round(pool, min(size, target - len(self.attempted)), polish)
            if len(self.attempted) < target:
                self.notes.append(f"the sampler stopped proposing new plans after {len(self.records)} trials "
                                  f"({len(self.attempted)} distinct plans simulated)")
        finally:
            nodes = getattr(pool, "nodes", None)
            if nodes is not None:  # on Ray: would one process have been faster on this machine?

                self.notes += ray_advice(self.records, time.perf_counter() - t0, pool.workers)
            if nodes:
                self.notes.append(f"evaluated on {len(nodes)} Ray node{'s' if len(nodes) > 1 else ''}: " + ", ".join(
                    f"{n[:8]} {c} plans" for n, c in sorted(nodes.items(), key=lambda kv: (-kv[1], kv[0]))))
            workers = getattr(pool, "pool", None)
            if workers is not None:
                self.notes.append(f"evaluated on {workers.processes} local processes" + (
                    f"; {workers.deaths} died and were restarted" if workers.deaths else ""))
            pool.close()
            if self.progress is not None:
                self.progress.close()
        return self._outcome(time.perf_counter() - t0)

    def _pool(self, plans_left: int) -> Any:
        if self.config.workers > 0 or self.config.ray_address:
            return RayPool(self.factory, self.config.workers or None, self.config.ray_address)
        if self.shared_processes is not None:
            return self.shared_processes.bind(self.factory)

        n = self.config.processes if self.config.processes is not None else auto_processes(plans_left)
        if n > 1:
            return own_pool(self.factory, n)
        return LocalPool(self.factory, self.shared_memo, many=plans_left >= MIN_PLANS_FOR_PROCESSES)

    def _incumbent(self) -> Verdict | None:
        """The candidate of the fastest fitting plan simulated so far (the first such on a tie)."""
        fitting = [(r.step_time_s, key) for key, r in self.results.items() if r.fits]
        if not fitting:
            return None
        if self._by_key is None:
            self._by_key = {self._key(v): v for v in self.pruned.valid}
        return self._by_key.get(min(fitting)[1])

    def _round(self, pool: Any, n: int, polish: bool = False) -> None:
        """Ask ``n`` trials, repair proposals that are pruned or already simulated, evaluate the new
        plans (committing each as it finishes), then tell everything in ask order. With ``polish``
        the ``n`` plans are instead the not yet simulated ones nearest to the best so far."""
        entries: list[tuple[Any, dict[str, Any], Verdict]] = []  # (asked trial or None if a repair, params, verdict)
        claimed: set[tuple] = set()
        best = self._incumbent() if polish else None
        if best is not None:
            centre = {k: best.combo[k] for k in self.varying}
            for _ in range(max(1, n)):
                near = self._repair(centre, claimed, best.plan.dp)
                if near is None:
                    break
                claimed.add(self._key(near))
                entries.append((None, {k: near.combo[k] for k in self.varying}, near))
            self.polished += len(entries)
        for trial in (self.mirror.ask(self.distributions) for _ in range(max(1, n) if best is None else 0)):
            v = self._verdict_for(trial.params)
            entries.append((trial, dict(trial.params), v))
            key = self._key(v)
            if key is not None and key not in self.attempted and key not in claimed:
                claimed.add(key)
            elif self.sampler is not SamplerKind.GRID:
                repair = self._repair(trial.params, claimed)
                if repair is not None:
                    claimed.add(self._key(repair))
                    entries.append((None, {k: repair.combo[k] for k in self.varying}, repair))
        base = len(self.records)
        slots: list[TrialRecord | None] = [None] * len(entries)
        to_eval: list[int] = []
        in_round: set[tuple] = set()
        for i, (_, params, v) in enumerate(entries):
            key = self._key(v)
            if key is None:
                plan = v.plan.model_dump(mode="json") if v.plan is not None else dict(v.combo)
                slots[i] = TrialRecord(base + i, plan, TrialState.PRUNED, None, v.reason.value, v.detail)
                self._commit(slots[i], params)
            elif key in self.attempted:
                slots[i] = self._reuse(base + i, v, key, "repeat of an earlier trial")
                self._commit(slots[i], params)
            elif key not in in_round:
                in_round.add(key)
                to_eval.append(i)

        def on_done(j: int, ev: Evaluation) -> None:
            i = to_eval[j]
            v = entries[i][2]
            key = self._key(v)
            self.attempted.add(key)
            self.traces_made += ev.traces_made
            self.cache_hits += ev.cache_hits
            plan = v.plan.model_dump(mode="json")
            if ev.result is not None:
                self.results[key] = ev.result
                rec = TrialRecord(base + i, plan, TrialState.COMPLETE, ev.result, None, "", ev.wall_s)
            else:
                rec = TrialRecord(base + i, plan, TrialState.FAILED, None, None, ev.error, ev.wall_s)
            slots[i] = rec
            self._commit(rec, entries[i][1])

        pool.evaluate_many([entries[i][2].plan for i in to_eval], on_done)
        for i, (_, params, v) in enumerate(entries):
            if slots[i] is None:  # a second trial of a plan first evaluated in this round
                slots[i] = self._reuse(base + i, v, self._key(v), "same plan as another trial of its round")
                self._commit(slots[i], params)
        for (trial, params, _), rec in zip(entries, slots):
            self._tell(trial, params, rec)
            self.records.append(rec)

    def _key(self, v: Verdict) -> tuple | None:
        if v.reason is not None or v.plan is None:
            return None
        key = self._keys.get(id(v))
        if key is None:
            key = self._keys[id(v)] = plan_key(v.plan.model_dump(mode="json"))
        return key

    def _repair(self, params: dict[str, Any], claimed: set[tuple], dp: int | None = None) -> Verdict | None:
        """The valid, not yet simulated candidate nearest to a proposal: fewest knobs changed, then the
        smallest moves along each knob's list of values, then the space's order. With the proposal's
        ``dp`` known, changing tp and pp together while keeping dp (moving GPUs between tensor and
        pipeline parallelism) counts as one change, as changing either alone does."""
        pos = {name: {val: i for i, val in enumerate(self.distributions[name].choices)} for name in self.varying}
        best, best_d = None, None
        for order, v in enumerate(self.pruned.valid):
            key = self._key(v)
            if key in self.attempted or key in claimed:
                continue
            changed = [k for k in self.varying if v.combo[k] != params[k]]
            relayout = dp is not None and v.plan.dp == dp and "tp" in changed and "pp" in changed
            d = (len(changed) - relayout, sum(abs(pos[k][v.combo[k]] - pos[k][params[k]]) for k in changed), order)
            if best_d is None or d < best_d:
                best, best_d = v, d
        return best

    def _verdict_for(self, params: dict[str, Any]) -> Verdict:
        fixed = {k.value: vals[0] for k, vals in self.config.space.knobs if len(vals) == 1}
        combo = dict(fixed, **params)
        i = self.index[tuple(combo[k.value] for k, _ in self.config.space.knobs)]
        return self._resolved(self.pruned.verdicts[i])

    def _reuse(self, number: int, v: Verdict, key: tuple, why: str) -> TrialRecord:
        result = self.results.get(key)
        state = TrialState.COMPLETE if result is not None else TrialState.FAILED
        return TrialRecord(number, v.plan.model_dump(mode="json"), state, result, None, why)

    def _values(self, rec: TrialRecord) -> list[float] | None:
        r = rec.result
        if rec.state is not TrialState.COMPLETE or r is None or not r.fits:
            return None
        if self.sampler is SamplerKind.NSGA2:
            return [r.tokens_per_s, r.memory_peak_gib]
        return [r.step_time_s]

    def _commit(self, rec: TrialRecord, params: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.commit(rec, self._values(rec))
        if self.progress is not None:
            fitting = [r.step_time_s for r in self.results.values() if r.fits]
            best = f"{min(fitting):.3f} s/step" if fitting else ""
            pruned = sum(1 for r in self.records if r.state is TrialState.PRUNED) + (rec.state is TrialState.PRUNED)
            self.progress.update(len(self.attempted), self._target,
                                 len(self.records) + 1, pruned, best)

    def _tell(self, trial: Any, params: dict[str, Any], rec: TrialRecord) -> None:
        """Tell an asked trial its result; add a repaired one as a finished trial of its own."""
        from optuna.trial import TrialState as OptunaState, create_trial

        values = self._values(rec)
        state = OptunaState.COMPLETE if values is not None else (
            OptunaState.FAIL if rec.state is TrialState.FAILED else OptunaState.PRUNED)
        if trial is not None:
            if values is not None:
                self.mirror.tell(trial, values)
            else:
                self.mirror.tell(trial, state=state)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mirror.add_trial(create_trial(state=state, values=values, params=params,
                                               distributions=dict(self.distributions)))

    # -- the outcome -------------------------------------------------------------------------------
    def _outcome(self, wall_s: float) -> SearchOutcome:
        fitting = [r for r in self.results.values() if r.fits]
        ranked = tuple(sorted(fitting, key=lambda r: (r.step_time_s, str(sorted(r.plan.items())))))
        failed = sum(1 for r in self.records if r.state is TrialState.FAILED and r.detail
                     and not r.detail.startswith(("repeat", "same plan")))
        too_big = sum(1 for r in self.results.values() if not r.fits)
        notes = list(self.notes)
        notes.append(f"{self.sampler.value} sampler; budget {self._target} distinct plans "
                     f"({'--trials' if self.config.n_trials is not None else 'default'}); "
                     f"{len(self.pruned.valid)} of {self.pruned.total} candidates passed the checks; "
                     f"{len(self.attempted)} simulated")
        if self.polished:
            notes.append(f"the last {self.polished} plans were the nearest neighbours of the best plan so far")
        if too_big:
            notes.append(f"{too_big} simulated plan{'s' if too_big > 1 else ''} did not fit in memory (the simulator's "
                         "memory is above the estimate)")
        if failed:
            notes.append(f"{failed} plans failed to simulate (see the trials' detail)")
        return SearchOutcome(
            model=self.config.model.model_dump(mode="json"), cluster=self.config.cluster.model_dump(mode="json"),
            space=self.config.space.as_json(), sampler=self.sampler.value, seed=self.config.seed,
            study_name=self.study_name, storage=self.url, trials=tuple(self.records), ranked=ranked,
            pruned_counts=self.pruned.counts(), candidates_total=self.pruned.total, traces_made=self.traces_made,
            trace_cache_hits=self.cache_hits, wall_s=wall_s, tokens_budget=self.config.tokens_budget,
            notes=tuple(notes), pareto=pareto_front(fitting),
            pruned_by_knob=knob_stats(self.pruned, self.records),
            stack=self.config.software.model_dump(mode="json"),
            memory_headroom_gib=(fitting[0].memory[0].headroom_bytes / 2**30 if fitting and fitting[0].memory
                                 else None),
        )


def pareto_front(results: list[StepResult]) -> tuple[StepResult, ...]:
    """Plans no other beats on both tokens/s (higher) and peak memory (lower), fastest first."""
    front: list[StepResult] = []
    for r in sorted(results, key=lambda r: (-r.tokens_per_s, r.memory_peak_gib)):
        if not front or r.memory_peak_gib < front[-1].memory_peak_gib:
            front.append(r)
    return tuple(front)

