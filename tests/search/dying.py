"""A toy evaluator whose process dies on one plan (importable by worker processes)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from . import toy


class Dying(toy.ToyEvaluator):
    def evaluate(self, plan):
        if plan.tp == 8 and plan.pp == 2:
            os._exit(1)  # the worker process dies mid-plan
        return super().evaluate(plan)


@dataclass(frozen=True)
class DyingFactory(toy.ToyFactory):
    def build(self) -> Dying:
        return Dying(self.model, self.cluster)
