"""What a search is asked to do (``SearchConfig``), its sampler, and the check of every candidate
before any simulation (``prune_for``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from echo_plan.search.prune import MemoryEstimator, PrunedSpace, Pruner, prune_space
from echo_plan.search.space import SearchSpace
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.software import SoftwareSpec
from echo_plan.specs.presets import load_stack

DEFAULT_TRIALS = 100  # distinct plans simulated per search unless --trials says otherwise


class SamplerKind(str, Enum):
    AUTO = "auto"
    TPE = "tpe"
    NSGA2 = "nsga2"
    GRID = "grid"


@dataclass(frozen=True)
class SearchConfig:
    model: ModelSpec
    cluster: ClusterSpec
    global_batch_size: int
    space: SearchSpace
    sampler: SamplerKind = SamplerKind.AUTO
    seed: int = 0
    n_trials: int | None = None  # distinct plans to simulate; None: DEFAULT_TRIALS
    storage: str | None = None  # Optuna storage URL; None: SQLite in the user data dir; "memory"
    study_name: str | None = None  # None: derived from model, cluster, gbs, space, sampler, seed
    workers: int = 0  # >0: a local Ray with that many workers
    processes: int | None = 1  # local worker processes without Ray; None: one per CPU for a large search
    ray_address: str | None = None  # an existing Ray cluster
    tokens_budget: float | None = None
    stack: SoftwareSpec | None = None  # None: the megatron-core preset
    memory_headroom_bytes: int | None = None  # None: memory.yaml's default fraction of the GPU
    cache_dir: str | None = None  # the trace cache (None: $ECHO_PLAN_CACHE_DIR or the user cache folder)

    @property
    def budget(self) -> int:
        return self.n_trials if self.n_trials is not None else DEFAULT_TRIALS

    @property
    def software(self) -> SoftwareSpec:
        if self.stack is not None:
            return self.stack

        return load_stack()


def prune_for(config: SearchConfig, memory: MemoryEstimator | None = None) -> PrunedSpace:
    """Check every candidate of the config's space (no simulation)."""
    pruner = Pruner(config.model, config.cluster, config.global_batch_size, config.space, memory=memory,
                    stack=config.software, memory_headroom_bytes=config.memory_headroom_bytes,
                    trace_cache_dir=config.cache_dir)
    return prune_space(pruner)


def resolve_sampler(config: SearchConfig, n_valid: int) -> SamplerKind:
    if config.sampler is SamplerKind.AUTO:
        return SamplerKind.GRID if n_valid <= config.budget else SamplerKind.TPE
    return config.sampler
