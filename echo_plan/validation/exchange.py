"""DeepEP's published H800 bandwidths as a suite: the expert-exchange model (cost/expert_exchange.py)
against ``deepseek_v3_h800/deepep_h800.csv`` (issue 32).

The rows are DeepEP's normal (training) kernels at EP 8-64 in DeepSeek-V3's pre-training setting, as its
benchmark (tests/test_internode.py) runs them: 4,096 tokens of hidden 7,168 per GPU, 256 routed experts
(rounded down to a multiple of the EP size), top-8, the routing groups being the servers and at most 4
of them per token. Each row's figure is the bandwidth DeepEP prints, predicted on its own terms
(``ExchangeCost.reported_GBps``) with the H800 preset's NVLink and NIC and the shipped efficiencies of the
row's DeepEP release (``deepep_h800_2025_02.csv``: its first release's README, 2025-02; the shared
``deepep_h800.csv``: the figures after Tencent's optimisation, 2025-04, which has no ``release`` column); the rows
those were fitted on are named in
``echo_plan/data/expert_exchange.yaml``, the others are held out.
The low-latency rows (inference decoding kernels) are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from echo_plan.cost.expert_exchange import ExchangeCost, ExchangeEfficiency, Routing, cluster_rates, expert_exchange
from echo_plan.errors import FileFormatError
from echo_plan.specs.software_kinds import DeepEPRelease
from echo_plan.validation.rows import csv_records

DEEPEP_FILE = Path("deepseek_v3_h800") / "deepep_h800.csv"  # the 2025-04 release's figures (no release column)
# each DeepEP release's table (a file's own release column, where it has one, says the same)
DEEPEP_FILES = {DeepEPRelease.APR_2025: DEEPEP_FILE,
                DeepEPRelease.FEB_2025: Path("deepseek_v3_h800") / "deepep_h800_2025_02.csv"}
CLUSTER = "h800"
TOKENS, HIDDEN, EXPERTS, TOP_K, MAX_SERVERS = 4096, 7168, 256, 8, 4  # DeepEP's test_internode.py, the CSV header


@dataclass(frozen=True, slots=True)
class ExchangeRow:
    kernel: str  # "normal" or "low_latency"
    op: str  # "dispatch" or "combine"
    ep: int
    bottleneck: str
    measured_GBps: float
    release: str = DeepEPRelease.APR_2025.value  # the DeepEP release whose README published it

    @property
    def label(self) -> str:
        return f"{self.kernel} {self.op} EP {self.ep} ({self.release})"


def read_deepep(path: Path) -> list[ExchangeRow]:
    header, records = csv_records(path)
    need = ("kernel", "op", "ep", "bottleneck", "bandwidth_GBps")
    missing = [c for c in need if c not in header]
    if missing:
        raise FileFormatError(str(path), f"not DeepEP's bandwidth table: missing columns {', '.join(missing)}")
    rows = []
    known = [r.value for r in DeepEPRelease]
    for line, rec in records:
        release = rec.get("release") or DeepEPRelease.APR_2025.value
        if release not in known:
            raise FileFormatError(str(path), f"release {release!r} is not a DeepEP release echo-plan knows "
                                             f"({', '.join(known)})", line)
        try:
            rows.append(ExchangeRow(rec["kernel"], rec["op"], int(rec["ep"]), rec["bottleneck"],
                                    float(rec["bandwidth_GBps"]), release))
        except ValueError:
            raise FileFormatError(str(path), f"ep {rec['ep']!r} or bandwidth {rec['bandwidth_GBps']!r} is not a "
                                             "number", line) from None
    return rows


def predict(row: ExchangeRow, cluster, eff: ExchangeEfficiency, where: Path = DEEPEP_FILE) -> ExchangeCost:  # noqa: ANN001
    """DeepEP's normal kernel of ``row`` (read from ``where``) on ``cluster`` (EP over servers of the cluster's
    GPUs per server)."""
    g = cluster.gpus_per_node
    if row.ep % g or row.ep <= 0:
        raise FileFormatError(str(where), f"{row.label}: EP {row.ep} is not a whole number of {g}-GPU servers")
    servers = row.ep // g
    routing = Routing(EXPERTS // row.ep * row.ep, TOP_K, servers, g, min(servers, MAX_SERVERS))
    nvl, net = cluster_rates(cluster)
    return expert_exchange(TOKENS, HIDDEN * 2.0, routing, nvl, net, eff.nvlink, eff.network)
