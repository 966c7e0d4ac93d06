"""The throughput vs memory Pareto front: plans no other plan beats on both at once."""

from __future__ import annotations

from typing import Sequence


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (memory, throughput) that no other point dominates.

    A point dominates another when it needs no more memory and gives no less throughput, and is
    strictly better in one of them. Exact duplicates keep the first. The indices come back in
    order of increasing memory (so the front can be drawn as a line).
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1], i))
    front: list[int] = []
    best_tp = float("-inf")
    for i in order:
        mem, tp = points[i]
        if tp > best_tp:
            front.append(i)
            best_tp = tp
    return front
