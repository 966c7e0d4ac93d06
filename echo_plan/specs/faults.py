"""Fault specs (a slow GPU, a slow NIC, slow NVLink) and what they do to one plan's ranks.

Written on the command line as ``KIND:key=value,...`` or in a YAML fault file (a list of mappings
with ``kind`` and the same keys):

* ``straggler:rank=R,compute=F``: GPU ``R`` computes F times slower (F > 1 slows it; 0 < F).
* ``link:node=N,nic=I,bw=F``: NIC ``I`` of server ``N`` runs at F x its rate (the GPU of that rail).
* ``nvlink:node=N,bw=F``: NVLink inside server ``N`` runs at F x its rate.
* ``node:node=N,compute=F``: every GPU of server ``N`` computes F times slower.
* ``uplink:leaf=L,down=C``: C of the spine uplinks of leaf switch ``L`` (on one rail plane) are down;
  their flows move to the leaf's remaining uplinks (needs ``--routing ecmp|planned``; docs/traffic.md).
* ``gpu-hang:rank=R``: GPU ``R`` stops (a kernel that never ends): it never enters its next collective.
* ``nic-hang:node=N,nic=I``: NIC ``I`` of server ``N`` stops moving data: the collectives through it
  post work that never finishes.

A hang stops the job, so it has no step time: hang faults are for ``simulate --emit-records``, which
writes the records of the hung job for ``diagnose`` (docs/diagnose.md); the step replay ignores them.

Effects on the replay, which simulates one rank per pipeline stage: a fault slows the stage that
holds the affected GPUs, because everything such a GPU synchronises with waits for it: its tensor-
and expert-parallel group in every layer, its data-parallel group at the gradient reduction, its
pipeline neighbours at each transfer. A synchronous collective that runs through a slow link runs
at that link's rate (a ring is as fast as its slowest hop; an all-to-all ends when the slow peer's
traffic ends), so the stage's collectives are timed on the cluster with that component slowed.
Stages that hold no affected GPU keep the healthy costs and wait for the slow one through the
schedule's dependencies: their wait comes out of the replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from echo_plan.errors import SpecError
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.specs.plan import PlanSpec
from echo_plan.specs.cluster import Routing

MAX_FAULTS = 1000


class FaultKind(str, Enum):
    STRAGGLER = "straggler"
    LINK = "link"
    NVLINK = "nvlink"
    NODE = "node"
    UPLINK = "uplink"
    GPU_HANG = "gpu-hang"
    NIC_HANG = "nic-hang"

    @property
    def hang(self) -> bool:
        return self in (FaultKind.GPU_HANG, FaultKind.NIC_HANG)


_KEYS = {
    FaultKind.STRAGGLER: {"rank": int, "compute": float},
    FaultKind.LINK: {"node": int, "nic": int, "bw": float},
    FaultKind.NVLINK: {"node": int, "bw": float},
    FaultKind.NODE: {"node": int, "compute": float},
    FaultKind.UPLINK: {"leaf": int, "down": int},
    FaultKind.GPU_HANG: {"rank": int},
    FaultKind.NIC_HANG: {"node": int, "nic": int},
}


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    params: tuple[tuple[str, float], ...]

    def get(self, key: str) -> float:
        return dict(self.params)[key]

    def label(self) -> str:
        return f"{self.kind.value}:" + ",".join(f"{k}={v:g}" for k, v in self.params)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, **{k: v for k, v in self.params}}


def fault_from_mapping(data: Any, where: str) -> Fault:
    if not isinstance(data, dict):
        raise SpecError("fault", data, "a mapping with kind and its keys", where)
    raw = dict(data)
    kind_name = raw.pop("kind", None)
    try:
        kind = FaultKind(str(kind_name))
    except ValueError:
        raise SpecError("fault.kind", kind_name, "one of " + ", ".join(k.value for k in FaultKind), where) from None
    keys = _KEYS[kind]
    missing = [k for k in keys if k not in raw]
    unknown = [k for k in raw if k not in keys]
    if unknown or missing:
        raise SpecError(f"fault {kind.value}", ",".join(unknown or missing),
                        f"{kind.value} takes exactly {', '.join(keys)}", where)
    params = []
    for key, typ in keys.items():
        value = raw[key]
        try:
            if isinstance(value, bool):
                raise ValueError
            number = typ(value) if typ is float else int(str(value))
        except (TypeError, ValueError):
            raise SpecError(f"{kind.value}.{key}", value, "an integer" if typ is int else "a number", where) from None
        if typ is float and not (0.0 < number <= 1e6):
            raise SpecError(f"{kind.value}.{key}", value, "a factor > 0 (compute: > 1 is slower; bw: < 1 is slower)",
                            where)
        if typ is int and number < 0:
            raise SpecError(f"{kind.value}.{key}", value, "a non-negative index", where)
        params.append((key, float(number)))
    return Fault(kind, tuple(params))


def parse_fault(text: str) -> Fault:
    """``KIND:key=value,...`` (the --fault syntax)."""
    kind, sep, rest = text.partition(":")
    if not sep:
        raise SpecError("--fault", text, "KIND:key=value,... e.g. straggler:rank=117,compute=1.25")
    data: dict[str, Any] = {"kind": kind.strip()}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecError("--fault", text, "KIND:key=value,... e.g. link:node=14,nic=5,bw=0.5")
        if key.strip() in data:
            raise SpecError("--fault", text, f"{key.strip()} is given twice; give each key once")
        data[key.strip()] = value.strip()
    return fault_from_mapping(data, "--fault")


def check_faults(faults: tuple[Fault, ...], plan: PlanSpec, cluster: ClusterSpec) -> None:
    """One-line errors for faults that name what this cluster and plan do not have."""
    if len(faults) > MAX_FAULTS:
        raise SpecError("faults", len(faults), f"at most {MAX_FAULTS}")
    for f in faults:
        if f.kind in (FaultKind.STRAGGLER, FaultKind.GPU_HANG) and not f.get("rank") < plan.world_size:
            raise SpecError(f"{f.kind.value}.rank", int(f.get("rank")),
                            f"a rank below {plan.world_size} (the plan's GPUs)")
        if f.kind in (FaultKind.LINK, FaultKind.NVLINK, FaultKind.NODE, FaultKind.NIC_HANG) \
                and not f.get("node") < cluster.num_nodes:
            raise SpecError(f"{f.kind.value}.node", int(f.get("node")), f"a server below {cluster.num_nodes}")
        if f.kind is FaultKind.UPLINK:
            _check_uplink(f, cluster)
        if f.kind in (FaultKind.LINK, FaultKind.NIC_HANG):
            if cluster.num_nodes == 1:
                raise SpecError("link", f.label(), f"{cluster.name} resized to one server has no network links; "
                                "use nvlink:node=0,bw=F")
            if not f.get("nic") < cluster.network.nics_per_node:
                raise SpecError(f"{f.kind.value}.nic", int(f.get("nic")), f"a NIC below {cluster.network.nics_per_node} "
                                "(NICs per server)")


def _check_uplink(f: Fault, cluster: ClusterSpec) -> None:
    net = cluster.network
    if net.routing is Routing.NONE:
        raise SpecError("uplink", f.label(), "uplink faults need the leaf/spine model: add --routing ecmp or "
                        "--routing planned")
    if not f.get("leaf") < cluster.num_leaves:
        raise SpecError("uplink.leaf", int(f.get("leaf")), f"a leaf below {cluster.num_leaves} ({cluster.name}: "
                        f"{net.servers_per_leaf} servers per leaf)")
    if not 1 <= f.get("down") < net.leaf_uplinks:
        raise SpecError("uplink.down", int(f.get("down")), f"1 to {net.leaf_uplinks - 1} (the leaf has "
                        f"{net.leaf_uplinks} uplinks; one must stay up)")


@dataclass(frozen=True, slots=True)
class StageEffect:
    """What the faults do to one pipeline stage's ranks."""

    compute_scale: float = 1.0  # compute slowed by this factor
    net_bw: float = 1.0  # its collectives and transfers see the network at this fraction
    nvlink_bw: float = 1.0  # ... and NVLink at this fraction
    causes: tuple[str, ...] = ()
    failed_uplinks: tuple[tuple[int, int], ...] = ()  # (leaf, uplinks down): the fabric every stage sees

    @property
    def healthy(self) -> bool:
        return self.compute_scale == 1.0 and self.net_bw == 1.0 and self.nvlink_bw == 1.0 and not self.failed_uplinks


def stage_of(rank: int, plan: PlanSpec) -> int:
    """Megatron's rank order: tp fastest, then dp, then pp."""
    return rank // plan.stage_ranks


def stage_effects(faults: tuple[Fault, ...], plan: PlanSpec, cluster: ClusterSpec) -> tuple[StageEffect, ...]:
    """Per pipeline stage: the worst compute slow-down and link rates among the GPUs the faults hit."""
    effects = [dict(compute=1.0, net=1.0, nvl=1.0, causes=[]) for _ in range(plan.pp)]
    gpn = cluster.gpus_per_node

    def hit(rank: int, f: Fault, **what: float) -> None:
        if rank >= plan.world_size:
            return  # a GPU of the cluster that the plan leaves idle
        e = effects[stage_of(rank, plan)]
        if "compute" in what:
            e["compute"] = max(e["compute"], what["compute"])
        if "net" in what:
            e["net"] = min(e["net"], what["net"])
        if "nvl" in what:
            e["nvl"] = min(e["nvl"], what["nvl"])
        if f.label() not in e["causes"]:
            e["causes"].append(f.label())

    uplinks: dict[int, int] = {}
    for f in faults:
        if f.kind.hang:  # no step time: only the emitted records show a hang
            continue
        if f.kind is FaultKind.STRAGGLER:
            hit(int(f.get("rank")), f, compute=f.get("compute"))
            continue
        if f.kind is FaultKind.UPLINK:  # the fabric is shared: every stage's collectives see it, and
            leaf = int(f.get("leaf"))   # the stages whose servers sit under the leaf are named
            uplinks[leaf] = min(cluster.network.leaf_uplinks - 1, uplinks.get(leaf, 0) + int(f.get("down")))
            for node in cluster.servers_under(leaf):
                for r in range(node * gpn, (node + 1) * gpn):
                    hit(r, f)
            continue
        node = int(f.get("node"))
        ranks = range(node * gpn, (node + 1) * gpn)
        if f.kind is FaultKind.NODE:
            for r in ranks:
                hit(r, f, compute=f.get("compute"))
        elif f.kind is FaultKind.NVLINK:
            for r in ranks:
                hit(r, f, nvl=f.get("bw"))
        else:
            for r in nic_ranks(node, int(f.get("nic")), cluster):
                hit(r, f, net=f.get("bw"))
    failed = tuple(sorted(uplinks.items()))
    return tuple(StageEffect(e["compute"], e["net"], e["nvl"], tuple(e["causes"]), failed) for e in effects)


def nic_ranks(node: int, nic: int, cluster: ClusterSpec) -> range:
    """The GPUs on a NIC's rail (rail-optimised servers: NIC i serves GPUs i x gpn / nics ...)."""
    gpn = cluster.gpus_per_node
    per_nic = max(1, gpn // cluster.network.nics_per_node)
    return range(node * gpn + nic * per_nic, node * gpn + (nic + 1) * per_nic)


def slowed_cluster(cluster: ClusterSpec, effect: StageEffect) -> ClusterSpec:
    """The cluster as the affected stage's collectives see it (its slow link on every hop it uses)."""
    if effect.net_bw == 1.0 and effect.nvlink_bw == 1.0 and not effect.failed_uplinks:
        return cluster
    gpu = cluster.gpu.replace(nvlink_link_bw_GBps=cluster.gpu.nvlink_link_bw_GBps * effect.nvlink_bw,
                              nvlink_bw_GBps=cluster.gpu.nvlink_bw_GBps * effect.nvlink_bw)
    net = cluster.network
    changes: dict = {"nic_bw_Gbps": net.nic_bw_Gbps * effect.net_bw}
    if net.uplink_bw_Gbps is None and effect.net_bw != 1.0:  # a slow NIC does not slow the leaf's uplinks
        changes["uplink_bw_Gbps"] = net.nic_bw_Gbps
    if effect.failed_uplinks:
        merged = dict(net.failed_uplinks)
        for leaf, down in effect.failed_uplinks:
            merged[leaf] = min(net.leaf_uplinks - 1, merged.get(leaf, 0) + down)
        changes["failed_uplinks"] = tuple(sorted(merged.items()))
    net = net.replace(**changes)
    return cluster.replace(gpu=gpu.model_dump(), network=net.model_dump())
