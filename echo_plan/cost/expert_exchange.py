"""The hierarchical expert exchange of DeepEP's normal kernels, with node-limited routing (issue 32).

DeepEP (github.com/deepseek-ai/DeepEP, the kernels DeepSeek-V3 trains with) dispatches a token to the
servers holding its experts once per server over the network (RDMA, to the GPU of the same local index
there) and forwards it inside each server over NVLink to every GPU that holds one of its experts;
combine runs the same paths backwards. With node-limited routing (DeepSeek-V3: its 8 routed experts on
at most 4 of the servers, the routing groups being the servers' experts) a token crosses the network at
most M times whatever the expert-parallel size. Per GPU and per exchange, with T tokens of h elements:

* network bytes sent = T x E[remote servers a token reaches] x h x b;
* NVLink bytes received = T_in x h x b, T_in = the token copies forwarded to this GPU (one per token per
  GPU holding at least one of its experts), the server's own included;
* time = max(network bytes / (NIC rate x eff_net), NVLink bytes / (NVLink rate x eff_nvl)): the two run
  on their own SMs and overlap, so the slower path sets the time.

Experts are drawn uniformly (balanced routing, as DeepEP's benchmark and DeepSeek's profile route):
within a reached server its share of a token's experts falls on distinct GPUs as draws without
replacement. The rates are the cluster's: NVLink as NCCL counts it (links x per-link bandwidth), the
NIC's line rate times its measured efficiency; ``eff_nvl`` and ``eff_net`` are what DeepEP's kernels
reach of them (``echo_plan/data/expert_exchange.yaml``, fitted on named rows of DeepEP's published
H800 bandwidths, the others held out: ``calibrate/deepep_fit.py``), one pair per DeepEP release (the stack's
``deepep_release``): the first release's kernels (2025-02, what DeepSeek-V3 trained with) reach less of the
network than those after Tencent's optimisation (2025-04), on the same benchmark.

DeepEP reports a "bandwidth" per exchange: the NVLink bytes over the time within one server, and with
several servers the "RDMA" bytes over the time, where its RDMA bytes count every server a token reaches,
its own included (tests/test_internode.py: ``num_rdma_token_sent``). ``ExchangeCost.reported_GBps``
gives that figure, so the model is checked against the published numbers on their own terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from math import comb
from typing import Any

import yaml

from echo_plan.cost.base import Algorithm, CollectiveEstimate, Protocol_
from echo_plan.errors import FileFormatError
from echo_plan.specs.moe import server_limit
from echo_plan.specs.software_kinds import DeepEPRelease
from echo_plan.trace.records import CollectiveKind, GroupKind

__all__ = ["DeepEPCollectives", "ExchangeCost", "ExchangeEfficiency", "Routing", "cluster_rates", "deepep_collectives",
           "distinct_fraction", "expert_exchange", "load_exchange_efficiency"]


def distinct_fraction(draws: float, pool: int, per_bin: int) -> float:
    """Probability that a given bin of ``per_bin`` items out of ``pool`` gets at least one of ``draws``
    items drawn without replacement (a non-integer number of draws interpolates)."""
    if pool <= 0 or per_bin <= 0 or draws <= 0:
        return 0.0
    lo = int(draws)
    frac = draws - lo

    def none(k: int) -> float:
        if k > pool:
            return 0.0
        return comb(pool - per_bin, k) / comb(pool, k) if k <= pool - per_bin else 0.0

    miss = none(lo) if frac == 0 else (1 - frac) * none(lo) + frac * none(lo + 1)
    return 1.0 - miss


@dataclass(frozen=True, slots=True)
class Routing:
    """Where a token's experts are: ``experts`` routed experts, ``top_k`` per token, spread over ``servers``
    of ``gpus_per_server`` GPUs (expert parallelism over ``servers`` x ``gpus_per_server`` GPUs), at most
    ``max_servers`` servers per token (None: unlimited)."""

    experts: int
    top_k: int
    servers: int
    gpus_per_server: int
    max_servers: int | None = None

    def servers_per_token(self) -> float:
        """Expected distinct servers a token reaches (its own counted)."""
        per = self.experts // self.servers
        free = self.servers * distinct_fraction(self.top_k, self.experts, per)
        if self.max_servers is None or self.max_servers >= self.servers:
            return free
        # groups chosen by their best expert's score each keep that expert: every limited server is reached
        return min(float(self.max_servers), free)

    def gpus_per_reached_server(self) -> float:
        """Expected distinct GPUs of a reached server that hold one of the token's experts."""
        local = self.experts // self.servers
        draws = self.top_k / self.servers_per_token()
        return self.gpus_per_server * distinct_fraction(draws, local, local // self.gpus_per_server)


@dataclass(frozen=True, slots=True)
class ExchangeCost:
    time_s: float
    network_bytes: float  # sent per GPU over the NIC (remote servers only)
    nvlink_bytes: float  # received per GPU over NVLink (forwarded copies, the server's own included)
    rdma_counted_bytes: float  # DeepEP's RDMA count: every reached server, the GPU's own included
    bottleneck: str  # "nvlink" or "network"
    single_server: bool

    @property
    def reported_GBps(self) -> float:
        """The bandwidth DeepEP's benchmark prints for this exchange (see the module docstring)."""
        counted = self.nvlink_bytes if self.single_server else self.rdma_counted_bytes
        return counted / self.time_s / 1e9 if self.time_s > 0 else 0.0


def expert_exchange(tokens: int, bytes_per_token: float, routing: Routing, nvlink_GBps: float, network_GBps: float,
                    eff_nvlink: float = 1.0, eff_network: float = 1.0) -> ExchangeCost:
    """One dispatch (or combine) of ``tokens`` tokens of ``bytes_per_token`` each from every GPU of the
    expert-parallel group, on the slower of its two paths (the module docstring)."""
    reach = routing.servers_per_token()
    per_server = routing.gpus_per_server * routing.servers
    # copies arriving at one server: every GPU's tokens, each reaching `reach` of the servers
    arrivals = per_server * tokens * reach / routing.servers
    nvl = arrivals * routing.gpus_per_reached_server() / routing.gpus_per_server * bytes_per_token
    counted = tokens * reach * bytes_per_token
    net = counted * (routing.servers - 1) / routing.servers  # every server equally likely: the own one 1/N
    t_nvl = nvl / (nvlink_GBps * eff_nvlink * 1e9)
    t_net = net / (network_GBps * eff_network * 1e9) if net else 0.0
    return ExchangeCost(max(t_nvl, t_net), net, nvl, counted, "nvlink" if t_nvl >= t_net else "network",
                        routing.servers == 1)


def cluster_rates(cluster) -> tuple[float, float]:  # noqa: ANN001
    """(NVLink GB/s one way as NCCL counts it, network GB/s one GPU can send: its servers' usable NIC rate
    shared among its GPUs) of ``cluster``."""
    return cluster.gpu.nvlink_uni_GBps, cluster.network.node_GBps / cluster.gpus_per_node


@dataclass(frozen=True, slots=True)
class ExchangeEfficiency:
    """What one release of DeepEP's normal kernels reaches of the two rates (``echo_plan/data/expert_exchange.yaml``)."""

    nvlink: float
    network: float
    fitted_on: tuple[str, ...] = ()
    source: str = ""
    release: str = DeepEPRelease.APR_2025.value


EXCHANGE_FORMAT = "echo-plan-expert-exchange/2"


def load_exchange_efficiency(text: str | None = None,
                             release: DeepEPRelease | str = DeepEPRelease.APR_2025) -> ExchangeEfficiency:
    """The shipped efficiencies of ``release`` (or those in ``text``, YAML of the same format)."""
    raw = yaml.safe_load(text if text is not None else
                         (resources.files("echo_plan") / "data" / "expert_exchange.yaml").read_text(encoding="utf-8"))
    key = DeepEPRelease(release).value
    if not isinstance(raw, dict) or raw.get("format") != EXCHANGE_FORMAT:
        raise FileFormatError("expert_exchange.yaml", f"not {EXCHANGE_FORMAT}: re-run python -m "
                              "echo_plan.calibrate.deepep_fit --write")
    releases = raw.get("deepep_normal") or {}
    if key not in releases:
        raise FileFormatError("expert_exchange.yaml", f"no shares for DeepEP release {key} (it has "
                              f"{', '.join(map(str, releases)) or 'none'})")
    d = releases[key]
    return ExchangeEfficiency(float(d["nvlink_efficiency"]), float(d["network_efficiency"]),
                              tuple(str(x) for x in d.get("fitted_on") or ()), str(d.get("source") or ""), key)


@dataclass(frozen=True)
class DeepEPCollectives:
    """A collective model that runs the expert-parallel all-to-alls as DeepEP's exchange (the stack's
    ``moe_dispatcher: deepep``) and leaves every other collective to ``base``. ``nbytes`` of a traced
    all-to-all is all a rank sends, one copy per routed expert, so a token's bytes are nbytes / top_k."""

    base: Any  # the CollectiveModel for everything else
    experts: int
    top_k: int
    groups: tuple[int, int] | None  # (routing groups, groups per token) of group-limited routing, else None
    eff: ExchangeEfficiency

    def time(self, kind, nbytes: int, group, cluster) -> CollectiveEstimate:  # noqa: ANN001
        if kind is not CollectiveKind.ALL_TO_ALL or group.kind is not GroupKind.EP or group.size <= 1 or nbytes <= 0:
            return self.base.time(kind, nbytes, group, cluster)
        per_node, servers = group.placement(cluster.domain_gpus)
        limit = None if self.groups is None else server_limit(self.groups[0], self.groups[1], servers)
        routing = Routing(self.experts, self.top_k, servers, per_node, limit)
        nvl, net = cluster_rates(cluster)
        tokens_bytes = nbytes / self.top_k
        got = expert_exchange(1, tokens_bytes, routing, nvl, net, self.eff.nvlink, self.eff.network)
        algbw = nbytes / got.time_s / 1e9 if got.time_s > 0 else 0.0
        return CollectiveEstimate(got.time_s, Algorithm.CUSTOM, Protocol_.SIMPLE, algbw, algbw)

    def candidates(self, kind, nbytes: int, group, cluster) -> list:  # noqa: ANN001
        return [self.time(kind, nbytes, group, cluster)]


def deepep_collectives(base: Any, model: Any, eff: ExchangeEfficiency | None = None) -> DeepEPCollectives:
    """``base`` with ``model``'s expert-parallel exchange run as DeepEP's (its routing and node limit), at the
    shares ``eff`` of one release (None: the current release's)."""
    moe = model.moe
    groups = None if moe.routing_groups is None else (moe.routing_groups, moe.groups_per_token)
    return DeepEPCollectives(base, moe.num_experts, moe.top_k, groups, eff or load_exchange_efficiency())


def deepep_note(model: Any, ep_group: Any, gpus_per_node: int, release: str = DeepEPRelease.APR_2025.value,
                token_bytes: tuple[float, float, str] | None = None) -> str:
    """Where DeepEP's exchange of ``model`` (its ``release``'s kernels) runs on this EP group and what node-limited
    routing saves: each token's copies over the network with and without the limit, and the GPUs it is forwarded to.
    ``token_bytes``: (bytes of one token's row as dispatched, as combined, the dispatch's format), to say the
    network bytes a token costs each way."""
    per_node, servers = ep_group.placement(gpus_per_node)
    moe = model.moe
    limit = moe.server_limit(servers)
    limited = Routing(moe.num_experts, moe.top_k, servers, per_node, limit)
    free = Routing(moe.num_experts, moe.top_k, servers, per_node, None)
    per_expert = moe.top_k * (servers - 1) / servers

    def remote(r: Routing) -> float:
        return r.servers_per_token() * (servers - 1) / servers

    def kib(copies: float, first: bool = False) -> str:
        if token_bytes is None:
            return ""
        d, c, dtype = token_bytes
        if first:
            return f" ({dtype} dispatch {copies * d / 1024:.1f} KiB a token, bf16 combine {copies * c / 1024:.1f} KiB)"
        return f" ({copies * d / 1024:.1f} / {copies * c / 1024:.1f} KiB)"

    if servers == 1:
        return (f"DeepEP exchange ({release} kernels): ep {ep_group.size} inside one server over NVLink; each token to "
                f"{limited.gpus_per_reached_server():.1f} GPUs on average")
    words = (f"at most {limit} of {servers} servers per token (group-limited routing)" if limit is not None
             else f"{servers} servers, no routing limit")
    return (f"DeepEP exchange ({release} kernels): ep {ep_group.size} over {servers} servers, {words}: each token "
            f"crosses the network {remote(limited):.2f} times, once per remote server reached{kib(remote(limited), True)}; "
            f"{remote(free):.2f} times without the limit{kib(remote(free))}; {per_expert:.2f} as one copy per remote "
            f"expert{kib(per_expert)}; then NVLink to {limited.gpus_per_reached_server():.1f} GPUs per server")
