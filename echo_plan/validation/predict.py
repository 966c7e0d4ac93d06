"""Predicting a validation row the way a user would: the row's cluster preset (with the
calibration it ships), the row's software stack, ``echo_plan.simulate.simulate``.

Nothing here corrects a prediction: what ``validate`` measures is what ``simulate`` gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from echo_plan.errors import EchoPlanError
from echo_plan.validation.rows import TrainingRow
from echo_plan.simulate import SimulationMemo
from echo_plan.specs import load_cluster
from echo_plan.specs import load_stack
from echo_plan.specs import PlanSpec
from echo_plan.specs import ModelSpec
from echo_plan.simulate import simulate


@dataclass(frozen=True)
class RowMemory:
    """The fullest GPU of a predicted run: its peak, what a plan may use (capacity less the headroom), the
    capacity. A run that ran must be predicted to fit (issue 31)."""

    peak_gib: float
    usable_gib: float
    capacity_gib: float
    reserved_gib: float = 0.0  # the most the caching allocator holds on any GPU (max_memory_reserved's figure)
    device_gib: float | None = None  # the most memory in use on any GPU (nvidia-smi's figure: the reserve, context
    # and NCCL); None: the peak (nothing allocated after it that the caching allocator must keep beside it)

    @classmethod
    def of(cls, memory) -> "RowMemory | None":  # noqa: ANN001
        if not memory:
            return None
        worst = max(memory, key=lambda m: m.total_bytes)
        return cls(worst.total_bytes / GIB, worst.usable_bytes / GIB, worst.capacity_bytes / GIB,
                   max(m.reserved_bytes for m in memory) / GIB, max(m.device_bytes for m in memory) / GIB)

    def words(self) -> str:
        return f"{self.peak_gib:.1f}/{self.usable_gib:.0f} GiB" + ("" if self.peak_gib <= self.usable_gib else " OVER")


GIB = float(2**30)


@dataclass(frozen=True)
class RowPrediction:
    row: TrainingRow
    step_s: float | None  # None when the row is not modelled or could not be simulated
    fits: bool = True
    problem: str = ""  # why there is no prediction
    range_s: tuple[float, float] | None = None  # the range simulate attaches
    memory: RowMemory | None = None  # the predicted peak of the fullest GPU against what it may use

    @property
    def figure(self) -> float | None:
        return None if self.step_s is None else self.row.figure(self.step_s)

    @property
    def log_residual(self) -> float | None:
        """log(predicted / measured step time)."""
        import math

        if self.step_s is None:
            return None
        return math.log(self.step_s / self.row.measured_step_s)

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, in the suite's own unit."""
        f = self.figure
        return None if f is None else (f - self.row.measured) / self.row.measured

    @property
    def in_range(self) -> bool | None:
        if self.range_s is None:
            return None
        return self.range_s[0] <= self.row.measured_step_s <= self.range_s[1]


class RowSimulator:
    """Simulates rows on one cluster preset with one stack; keeps a memo and trace cache across rows."""

    def __init__(self, cluster: Any, stack_name: str, cache: Any = None, memo: Any = None,
                 model_settings: Any = None, stack_transform: Callable[[Any], Any] | None = None) -> None:
        """``stack_transform``: applied to every row's stack last (leave-one-suite-out's priors, calibrate/loso.py)."""
        self.base = load_cluster(cluster) if isinstance(cluster, str) else cluster
        self.stack_name = stack_name
        self.stack_transform = stack_transform
        self.model_settings = dict(model_settings or {})  # model name -> stack settings of its runs
        self.cache = cache
        self.memo = memo if memo is not None else SimulationMemo()

    def stack_for(self, row: TrainingRow) -> Any:
        model_settings = self.model_settings.get(row.model.name, {})
        settings = {k: v for k, v in model_settings.items()
                    if k not in PlanSpec.model_fields and k not in ModelSpec.model_fields
                    and k not in ("layer_split_offsets", "stack")}
        settings.update(row.stack_overrides)  # the row's own columns win
        # a model's runs measured with another stack preset than the suite's name it (``stack: NAME``)
        stack = load_stack(model_settings.get("stack", self.stack_name), settings)
        return stack if self.stack_transform is None else self.stack_transform(stack)

    def plan_for(self, row: TrainingRow) -> Any:
        """The row's plan; plan settings of the suite's model settings fill what the row's columns leave out."""
        settings = self.model_settings.get(row.model.name, {})
        fields = {k: v for k, v in settings.items() if k in PlanSpec.model_fields}
        fields.update(row.plan)
        offsets = settings.get("layer_split_offsets")  # the recipe's first/last stage hold this many layers
        if offsets is not None:  # fewer (negative) than the others; interleaved: the first and last virtual stage
            chunks, first, last = int(fields["pp"]) * int(fields.get("virtual_stages", 1)), int(offsets[0]), int(offsets[1])
            middle, rest = divmod(self.model_for(row).num_layers - first - last, chunks)
            # under interleaving an end chunk may hold no layer: the embedding, or the MTP layers and the loss, take
            # its place (Megatron-Core's account_for_embedding/loss_in_pipeline_split; DeepSeek-V3's pipeline layout
            # "Et|(tt|)*30mL" on H100: one layer first, none last)
            smallest = middle + min(first, last)
            if rest == 0 and chunks > 1 and (smallest >= 1 or (smallest == 0 and chunks > int(fields["pp"]))):
                fields["layer_split"] = (middle + first,) + (middle,) * (chunks - 2) + (middle + last,)
        return PlanSpec.build(fields, context=row.label)

    def model_for(self, row: TrainingRow) -> Any:
        """The row's model with the suite's model settings that are ModelSpec fields (e.g. mtp_layers)."""
        changes = {k: v for k, v in self.model_settings.get(row.model.name, {}).items()
                   if k in ModelSpec.model_fields}
        return row.model.replace(**changes) if changes else row.model

    def cluster_for(self, row: TrainingRow) -> Any:
        return self.base.resized(gpus=row.gpus)

    def predict(self, row: TrainingRow, compute: Any = None) -> RowPrediction:
        """One row; ``compute`` replaces the cluster's compute model (calibration fits use it)."""
        if row.not_modelled:
            return RowPrediction(row, None, problem=f"not modelled yet: {row.not_modelled}")
        try:
            cluster = self.cluster_for(row)
            plan = self.plan_for(row)
            result = simulate(self.model_for(row), cluster, plan, stack=self.stack_for(row), cache=self.cache, memo=self.memo,
                              compute=compute)
        except EchoPlanError as exc:
            return RowPrediction(row, None, problem=f"cannot simulate: {exc}")
        return RowPrediction(row, result.step_time_s, result.fits, range_s=result.step_time_range_s,
                             memory=RowMemory.of(result.memory))

    def predict_all(self, rows: Iterable[TrainingRow], compute: Any = None,
                    progress: Callable[[int, int, str], None] | None = None) -> tuple[RowPrediction, ...]:
        rows = tuple(rows)
        out = []
        for i, row in enumerate(rows):
            if progress is not None:
                progress(i, len(rows), row.label)
            out.append(self.predict(row, compute))
        return tuple(out)
