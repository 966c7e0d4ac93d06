"""What ``diagnose`` concludes: a syndrome, suspects (most likely first) and the evidence."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class Syndrome(str, Enum):
    HEALTHY = "healthy"
    COMMUNICATION_HANG = "communication_hang"
    NON_COMMUNICATION_HANG = "non_communication_hang"
    COMMUNICATION_SLOW = "communication_slow"
    NON_COMMUNICATION_SLOW = "non_communication_slow"


class Component(str, Enum):
    GPU = "gpu"  # the GPU (or what runs on its host) computes slowly or has stopped
    NIC = "nic"  # the rank's network card: its sends and its receives
    NVLINK = "nvlink"  # the server's NVLink/NVSwitch domain
    LINK = "link"  # one connection between two ranks (cable, switch port, path)


@dataclass(frozen=True)
class Suspect:
    rank: int | None
    node: int | None
    component: Component
    confidence: float
    why: str
    peer: int | None = None  # a link's other end

    def as_json(self) -> dict[str, Any]:
        out = {"rank": self.rank, "node": self.node, "component": self.component.value,
               "confidence": round(self.confidence, 3), "why": self.why}
        if self.peer is not None:
            out["peer"] = self.peer
        return out


@dataclass(frozen=True)
class Diagnosis:
    syndrome: Syndrome
    suspects: tuple[Suspect, ...]
    evidence: dict[str, Any]
    ranks_present: int
    missing_ranks: tuple[int, ...]
    records: int
    notes: tuple[str, ...] = field(default=())

    @property
    def verdict(self) -> str:
        if self.syndrome is Syndrome.HEALTHY:
            return "healthy: no rank, NIC, NVLink or link stands out"
        top = self.suspects[0] if self.suspects else None
        what = self.syndrome.value.replace("_", " ")
        if top is None:
            return f"{what}: no single component could be singled out"
        where = f"rank {top.rank}" if top.rank is not None else f"node {top.node}"
        if top.component is Component.LINK and top.peer is not None:
            where = f"the link rank {top.rank} -> rank {top.peer}"
        node = f" (node {top.node})" if top.node is not None and top.rank is not None else ""
        return f"{what}: {top.component.value} of {where}{node}, confidence {top.confidence:.0%}"

    def as_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "syndrome": self.syndrome.value,
                "suspects": [s.as_json() for s in self.suspects], "evidence": self.evidence,
                "ranks_present": self.ranks_present, "missing_ranks": list(self.missing_ranks),
                "records": self.records, "notes": list(self.notes)}


def confidence(strength: float, share: int = 1) -> float:
    """A judgement, not a calibrated probability: ``strength`` is how far the signal is past its
    threshold (1 = at the threshold, 2 = twice as far from normal), ``share`` how many suspects
    the evidence cannot tell apart. At the threshold 0.5, saturating to 0.99; split evenly."""
    s = max(0.0, strength)
    return min(0.99, s / (1.0 + s)) / max(1, share) if s < 99 else 0.99 / max(1, share)
