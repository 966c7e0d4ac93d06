"""When does gradient sparsification pay? Step time across densities and break-even densities.

For one plan (the data-parallel layout it fixes) each sparse method is simulated at a grid of
densities, and its break-even density is found: the largest density at which its step is no
slower than the same plan with the dense reduction (``None`` when even a density of 1e-6 is
slower). Step time grows with density for every method (more indices and values to move), so the
break-even is found by bisection on log10(density). docs/sparsification.md derives the expected
trends: Top-k's break-even falls as the data-parallel group grows (its index all-gather and the
union grow with p), ExDyna's stays flat (each worker moves its share of k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from echo_plan.errors import SpecError
from echo_plan.specs.plan import DpComm, PlanSpec

DEFAULT_DENSITIES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
LOWEST_DENSITY = 1e-6
BISECTION_STEPS = 20  # log10 bracket of 6 decades / 2^20: break-even to ~0.001% relative


@dataclass(frozen=True, slots=True)
class MethodCurve:
    method: DpComm
    break_even_density: float | None
    points: tuple[tuple[float, float, dict[str, Any] | None], ...]  # (density, step s, exchange parts)


@dataclass(frozen=True, slots=True)
class SparsifyOutcome:
    model: str
    cluster: str
    num_gpus: int
    plan: dict[str, Any]  # the dense plan
    dense_step_time_s: float
    dp: int
    curves: tuple[MethodCurve, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model, "cluster": self.cluster, "num_gpus": self.num_gpus, "plan": self.plan,
            "data_parallel": self.dp, "dense_step_time_s": self.dense_step_time_s,
            "methods": {c.method.value: {
                "break_even_density": c.break_even_density,
                "step_time_s_by_density": [{"density": d, "step_time_s": t, "exchange": parts}
                                           for d, t, parts in c.points],
            } for c in self.curves},
            "not_modelled": "convergence: a sparsifier changes the number of steps to a given loss; these are "
                            "per-step figures",
        }


def check_densities(densities: tuple[float, ...]) -> tuple[float, ...]:
    if not densities:
        raise SpecError("--densities", "", "one or more densities in (0, 1]")
    for d in densities:
        if not (isinstance(d, (int, float)) and math.isfinite(d) and 0.0 < d <= 1.0):
            raise SpecError("--densities", d, "densities in (0, 1], e.g. 0.001,0.01,0.1")
    return tuple(sorted(set(float(d) for d in densities)))


def analyse(plan: PlanSpec, step: Callable[[PlanSpec], Any], densities: tuple[float, ...] = DEFAULT_DENSITIES,
            methods: tuple[DpComm, ...] = tuple(m for m in DpComm if m.sparse),
            progress: Callable[[int, int, str], None] | None = None) -> tuple[Any, tuple[MethodCurve, ...]]:
    """The dense step and each method's curve; ``step(plan)`` simulates one plan (a StepResult)."""
    if plan.distributed_optimizer:
        raise SpecError("--distributed-optimizer", True, "sparse exchanges cannot feed the distributed optimizer's "
                        "sharded reduce-scatter; compare without it")
    if plan.dp < 2:
        raise SpecError("dp", plan.dp, "sparsification needs data parallelism (dp >= 2)")
    densities = check_densities(densities)
    base = plan.replace(dp_comm=DpComm.DENSE.value, density=1.0)
    dense = step(base)
    curves = []
    for i, method in enumerate(methods):
        if progress is not None:
            progress(i, len(methods), method.value)
        cache: dict[float, float] = {}

        def time_at(d: float, method=method, cache=cache, keep: list | None = None) -> float:
            if d not in cache:
                r = step(base.replace(dp_comm=method.value, density=d))
                cache[d] = r.step_time_s
                if keep is not None:
                    keep.append((d, r.step_time_s, r.dp_exchange))
            return cache[d]

        points: list = []
        for d in densities:
            time_at(d, keep=points)
        curves.append(MethodCurve(method, _break_even(lambda d: time_at(d) <= dense.step_time_s), tuple(points)))
    return dense, tuple(curves)


def _break_even(pays: Callable[[float], bool]) -> float | None:
    """The largest density in [LOWEST_DENSITY, 1] at which ``pays`` holds (monotone), or None."""
    if pays(1.0):
        return 1.0
    if not pays(LOWEST_DENSITY):
        return None
    lo, hi = math.log10(LOWEST_DENSITY), 0.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if pays(10 ** mid):
            lo = mid
        else:
            hi = mid
    return 10 ** lo
