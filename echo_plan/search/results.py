"""What a search and a compare produce: the contract between search/, report/ and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from echo_plan.replay.results import StepResult


class TrialState(str, Enum):
    COMPLETE = "complete"  # simulated; see result.fits
    PRUNED = "pruned"  # rejected before simulation; see pruned_reason
    FAILED = "failed"  # the evaluation raised; see error


@dataclass(frozen=True, slots=True)
class TrialRecord:
    number: int
    plan: dict[str, Any]  # PlanSpec.model_dump(mode="json")
    state: TrialState
    result: StepResult | None = None
    pruned_reason: str | None = None  # a stable category, e.g. "tp exceeds a node", "out of memory (estimate)"
    detail: str = ""  # the specific message for this candidate
    wall_s: float = 0.0


REUSED_DETAILS = ("repeat", "same plan")  # trials that reused an earlier simulation of the same plan


def simulated_this_study(trials) -> int:
    """Trials this study actually simulated: not pruned, not reusing another trial's simulation."""
    return sum(1 for t in trials if t.state is not TrialState.PRUNED and not t.detail.startswith(REUSED_DETAILS))


@dataclass(frozen=True, slots=True)
class SearchOutcome:
    model: dict[str, Any]  # ModelSpec.model_dump(mode="json")
    cluster: dict[str, Any]  # ClusterSpec.model_dump(mode="json")
    space: dict[str, Any]  # the search space as loaded (knobs, fixed settings, its file)
    sampler: str
    seed: int
    study_name: str
    storage: str
    trials: tuple[TrialRecord, ...]
    ranked: tuple[StepResult, ...]  # fitting plans, fastest first, one per distinct plan
    pruned_counts: dict[str, int]  # reason -> candidates pruned for it (the whole space for grid)
    candidates_total: int  # size of the space before pruning
    traces_made: int
    trace_cache_hits: int
    wall_s: float
    tokens_budget: float | None = None
    notes: tuple[str, ...] = ()
    pareto: tuple[StepResult, ...] = ()  # NSGA-II: fitting plans no other beats on both tokens/s and memory
    # knob -> value -> {"candidates": n, "valid": n, "evaluated": n, <prune reason>: n, ...}: why a value
    # was (never) tried
    pruned_by_knob: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    stack: dict[str, Any] = field(default_factory=dict)  # SoftwareSpec.model_dump(mode="json")
    memory_headroom_gib: float | None = None  # kept free on every GPU for a plan to count as fitting

    @property
    def best(self) -> StepResult | None:
        return self.ranked[0] if self.ranked else None


@dataclass(frozen=True, slots=True)
class CompareRow:
    num_gpus: int
    outcome: SearchOutcome
    scaling_efficiency: float | None  # throughput per GPU relative to the smallest size
    train_time_s: float | None  # time to train the token budget
    gpu_hours: float | None
    cost: float | None  # gpu_hours x price, when a price was given
    goodput_tokens_per_s: float | None = None  # healthy throughput x ETTR (cost/goodput.py)
    ettr: float | None = None  # effective training time ratio under the failure model
    train_time_failures_s: float | None = None  # the token budget at the goodput


@dataclass(frozen=True, slots=True)
class CompareOutcome:
    model: dict[str, Any]
    cluster: dict[str, Any]
    rows: tuple[CompareRow, ...]
    tokens_budget: float | None
    price_per_gpu_hour: float | None
    wall_s: float
    notes: tuple[str, ...] = field(default_factory=tuple)
