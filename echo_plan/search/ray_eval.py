"""Evaluating plans on Ray workers: a local Ray started and stopped here (``--workers N``) or an
existing cluster (``--ray-address``).

Each worker is an actor that builds its own evaluator from the (picklable) factory once, so it
keeps the simulator's level-1 memo across the plans it is given, and all workers share the
factory's on-disk trace cache folder. Results come back as they finish; the caller commits each
one to the study storage at once, so a crashed worker loses only the plan it was running.
``compare`` keeps one Ray up for all its cluster sizes (``ray_session``).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

from echo_plan.errors import EchoPlanError
from echo_plan.search.results import TrialState
from echo_plan.search.evaluator import Evaluation, EvaluatorFactory, OnDone, run_one
from echo_plan.specs.plan import PlanSpec


def start_ray(workers: int | None, address: str | None) -> bool:
    """Start a local Ray with ``workers`` CPUs, or connect to ``address``, unless Ray is already up
    in this process. Returns True when this call started it (so its caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING,
                                  log_to_driver=False, configure_logging=True)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if address is not None:
        check_reachable(address)
    else:  # a local Ray keeps Ray's default token authentication; only its notice that it is on goes
        logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_auth_on_notice)
    try:
        if address is not None:
            ray.init(address=address, **kwargs)
        else:  # a new local Ray of its own, even when a Ray cluster runs on this machine
            ray.init(address="local", num_cpus=workers, **kwargs)
    except Exception as exc:  # connection refused, bad address, ...
        raise EchoPlanError(f"cannot start or reach Ray ({address or 'local'}): {type(exc).__name__}: {exc}") \
            from None
    return True


def _auth_on_notice(record: logging.LogRecord) -> bool:
    """Drop Ray's notice that token authentication is enabled (the default); keep every other record."""
    return not record.getMessage().startswith("Token authentication is enabled")


@contextmanager
def ray_session(workers: int | None, address: str | None) -> Iterator[None]:
    """Ray up for the whole block (several searches: ``compare``), down afterwards if started here;
    the RayPools made inside reuse it instead of starting and stopping a Ray each."""
    if address is None and (workers is None or workers < 1):
        raise EchoPlanError("--workers must be a positive number of Ray workers")
    started = start_ray(workers, address)
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


class RayPool:
    """A pool of Ray actors, each with its own evaluator; ``close`` stops a Ray it started."""

    def __init__(self, factory: EvaluatorFactory, workers: int | None = None, address: str | None = None) -> None:
        if address is None and (workers is None or workers < 1):
            raise EchoPlanError("--workers must be a positive number of Ray workers")
        import ray

        self._ray = ray
        self._started = start_ray(workers, address)
        if workers is None or workers < 1:
            workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.workers = workers
        self._factory = factory
        self._actor_cls = ray.remote(num_cpus=1, max_restarts=0)(_Worker)
        self._actors = [self._actor_cls.remote(factory) for _ in range(workers)]
        self.nodes: dict[str, int] = {}  # Ray node id -> plans evaluated there

    def evaluate_many(self, plans: list[PlanSpec], on_done: OnDone) -> list[Evaluation]:
        """Every plan on some worker; ``on_done(i, evaluation)`` runs in this process as each finishes."""
        ray = self._ray
        out: list[Evaluation | None] = [None] * len(plans)
        pending: dict[Any, tuple[int, int]] = {}  # object ref -> (plan index, actor index)
        queue = list(range(len(plans)))
        free = list(range(len(self._actors)))
        while queue or pending:
            while queue and free:
                i, a = queue.pop(0), free.pop(0)
                ref = self._actors[a].run.remote(plans[i].model_dump(mode="json"))
                pending[ref] = (i, a)
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i, a = pending.pop(ref)
                try:
                    ev = ray.get(ref)
                except Exception as exc:  # the worker died (ray.exceptions.RayActorError) or the task failed
                    ev = Evaluation(None, f"worker failed: {type(exc).__name__}: {exc}".splitlines()[0], 0.0, 0, 0)
                    self._actors[a] = self._respawn(a)
                out[i] = ev
                if ev.node:
                    self.nodes[ev.node] = self.nodes.get(ev.node, 0) + 1
                on_done(i, ev)
                free.append(a)
        return [e for e in out if e is not None]

    def _respawn(self, a: int) -> Any:
        """A fresh actor in place of one that failed (the old one is killed if still alive)."""
        try:
            self._ray.kill(self._actors[a])
        except Exception:  # already dead
            pass
        return self._actor_cls.remote(self._factory)

    def close(self) -> None:
        """Stop this pool's actors (their CPUs go back to Ray for the next pool), and Ray if started here."""
        for actor in self._actors:
            try:
                self._ray.kill(actor)
            except Exception:  # already dead
                pass
        self._actors = []
        if self._started:
            self._ray.shutdown()
            self._started = False


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nothing listens on (ray.init would retry for minutes).
    ``auto`` and ``ray://`` client addresses are left to Ray."""
    import socket

    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise EchoPlanError(f"--ray-address {address}: nothing answers there ({exc}); start Ray with "
                            f"`ray start --head` or use --workers N for a local one") from None


class _Worker:
    """One Ray actor: an evaluator built once, then one plan per call."""

    def __init__(self, factory: EvaluatorFactory) -> None:
        self.evaluator = factory.build()

    def run(self, plan_fields: dict[str, Any]) -> Evaluation:
        import dataclasses

        import ray

        ev = run_one(self.evaluator, PlanSpec.build(plan_fields))
        return dataclasses.replace(ev, node=ray.get_runtime_context().get_node_id())


def ray_advice(records, wall_s: float, workers: int) -> list[str]:
    """A measured word on --workers/--ray-address: the simulations alone took this long in all, so
    one process doing them in turn would have beaten the parallel search when that is less."""
    simulated = sum(r.wall_s for r in records if r.state is not TrialState.PRUNED and r.result is not None)
    if simulated <= 0 or simulated >= wall_s:
        return []
    return [f"in-process would have been faster here: the plans took {simulated:.1f} s of simulation in all, "
            f"the search on {workers} Ray workers {wall_s:.1f} s (starting Ray and shipping work cost more than "
            f"the parallelism saved); drop --workers on this machine"]
