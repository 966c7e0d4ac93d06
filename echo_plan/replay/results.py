"""What a simulated step produces: frozen result records read by the CLI, search and reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from echo_plan.cost.goodput import goodput
from echo_plan.cost.stage_memory import GiB, StageMemory


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Where the step's wall time goes, in seconds; the fields add up to the step time."""

    compute_s: float
    tp_comm_exposed_s: float
    pp_comm_exposed_s: float
    dp_comm_exposed_s: float
    bubble_s: float
    interference_s: float
    optimizer_s: float
    ep_comm_exposed_s: float = 0.0  # the MoE expert exchange (dispatch, combine) the compute waited on
    host_exposed_s: float = 0.0  # the GPU waiting for the host after the MoE dispatcher's synchronisation

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_exposed_s + self.pp_comm_exposed_s + self.dp_comm_exposed_s
                + self.bubble_s + self.interference_s + self.optimizer_s + self.ep_comm_exposed_s
                + self.host_exposed_s)

    def as_json(self) -> dict[str, float]:
        return {
            "compute": self.compute_s,
            "tp_comm_exposed": self.tp_comm_exposed_s,
            "ep_comm_exposed": self.ep_comm_exposed_s,
            "host_exposed": self.host_exposed_s,
            "pp_comm_exposed": self.pp_comm_exposed_s,
            "dp_comm_exposed": self.dp_comm_exposed_s,
            "bubble": self.bubble_s,
            "interference": self.interference_s,
            "optimizer": self.optimizer_s,
        }


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    """One span of the simulated step, for the Chrome/Perfetto trace and the report's timeline."""

    rank: int  # simulated rank (one per pipeline stage unless a what-if breaks symmetry)
    stream: str  # "compute", "tp_comm", "pp_comm", "dp_comm", ...
    name: str  # says what ran, e.g. "F mb3 chunk0 (layers 0-11)"
    start_s: float
    duration_s: float
    category: str  # "forward", "backward", "p2p", "dp", "optimizer", ...
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepResult:
    """The predicted training step for one plan of one model on one cluster."""

    model: str
    cluster: str
    num_gpus: int
    plan: dict[str, Any]  # PlanSpec.model_dump(mode="json")
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    memory: tuple[StageMemory, ...]
    breakdown: Breakdown
    timeline: tuple[TimelineEvent, ...] = ()
    notes: tuple[str, ...] = ()
    stack: str = ""  # the software stack's name
    step_time_range_s: tuple[float, float] | None = None  # (low, high) at range_coverage, from validation residuals
    range_coverage: float | None = None  # nominal share of measured runs inside the range
    range_basis: str = ""  # where the range comes from (or why it is a judgement)
    dp_exchange: dict[str, Any] | None = None  # a sparse dp_comm's parts per step (simulate.dp_exchange_summary)
    faults: dict[str, Any] | None = None  # faults applied, the healthy step and waits (replay/faults.py)
    goodput: dict[str, Any] | None = None  # under failures: ETTR and goodput (cost/goodput.py)
    traffic: dict[str, Any] | None = None  # routing and per-group ECMP slowdowns (cost/traffic.py)

    def with_goodput(self, plan: Any, failure_model: Any = None) -> "StepResult":
        """This result with its goodput under ``failure_model`` (default: cost/goodput.py's)."""
        from dataclasses import replace

        return replace(self, goodput=goodput(self, plan, failure_model).as_json())

    @property
    def goodput_tokens_per_s(self) -> float | None:
        return None if self.goodput is None else self.goodput["goodput_tokens_per_s"]

    @property
    def tokens_per_s_range(self) -> tuple[float, float] | None:
        """(low, high) tokens/s: the step-time range inverted."""
        if self.step_time_range_s is None:
            return None
        lo, hi = self.step_time_range_s
        tokens = self.tokens_per_s * self.step_time_s
        return (tokens / hi, tokens / lo)

    @property
    def memory_peak_gib(self) -> float:
        return max(m.total_bytes for m in self.memory) / GiB if self.memory else 0.0

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.memory)

    @property
    def overflow(self) -> tuple[int, float] | None:
        """(stage, GiB over capacity) of the worst overflowing stage, or None when it fits."""
        worst = max(self.memory, key=lambda m: m.overflow_bytes, default=None)
        if worst is None or worst.overflow_bytes == 0:
            return None
        return (worst.stage, worst.overflow_bytes / GiB)

    def as_json(self) -> dict[str, Any]:
        over = self.overflow
        return {
            "model": self.model,
            "cluster": self.cluster,
            "num_gpus": self.num_gpus,
            "plan": self.plan,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "mfu": self.mfu,
            "memory_peak_gib": self.memory_peak_gib,
            "fits": self.fits,
            "overflow": None if over is None else {"stage": over[0], "gib": over[1]},
            "breakdown": self.breakdown.as_json(),
            "memory_per_stage": [m.as_json() for m in self.memory],
            "notes": list(self.notes),
            "stack": self.stack,
            "step_time_range_s": list(self.step_time_range_s) if self.step_time_range_s else None,
            "tokens_per_s_range": list(self.tokens_per_s_range) if self.tokens_per_s_range else None,
            "range_coverage": self.range_coverage,
            "range_basis": self.range_basis,
            "dp_exchange": self.dp_exchange,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "effective_training_time_ratio": None if self.goodput is None else self.goodput["effective_training_time_ratio"],
            "goodput": self.goodput,
            **({"traffic": self.traffic} if self.traffic else {}),
            **({"healthy_step_time_s": self.faults["healthy_step_time_s"], "faults": self.faults["applied"],
                "fault_waits": self.faults["stages"]} if self.faults else {}),
        }
