"""``compare --cluster h800,h200,b200,gb200-nvl72``: the same sizes searched on several kinds of cluster.

Each cluster is a full ``compare`` (its own best plan per size: an NVL72 rack keeps tensor and expert
groups of up to 72 GPUs on NVLink, a 180 GB GPU fits plans an 80 GB one cannot). The comparison puts
the best plans side by side with what the decision needs: time to train the token budget, GPU-hours,
the cost at each cluster's own price per GPU-hour, and the energy of the GPUs (each at its board
power for the whole run: an estimate that leaves out CPUs, network, storage and cooling). A cluster
whose GPU no measured run calibrates says so in its row: its times are the kernel model's as published.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.files import parse_yaml, read_text
from echo_plan.limits import MAX_PRICE_PER_GPU_HOUR as MAX_PRICE
from echo_plan.search.results import CompareOutcome
from echo_plan.search.serialize import compare_to_json
from echo_plan.search.table import cell, plan_label
from echo_plan.specs.calibration import calibration_status

CLUSTER_COMPARE_FORMAT = "echo-plan-compare-cluster/1"


def read_cluster_list(text: str) -> tuple[list[str], list[float | None]] | None:
    """A YAML file listing clusters to compare (``clusters:`` entries with ``cluster`` and an optional
    ``price_per_gpu_hour``), or None when ``text`` names no such file (a preset, a cluster file, a list)."""
    path = Path(text)
    if path.suffix.lower() not in (".yaml", ".yml") or not path.is_file():
        return None
    doc = parse_yaml(read_text(path), str(path))
    if not isinstance(doc, dict) or "clusters" not in doc:
        return None  # a cluster file of one's own
    entries = doc["clusters"]
    if not isinstance(entries, list) or not entries:
        raise SpecError("clusters", entries, "a list of entries such as {cluster: h800, price_per_gpu_hour: 2.1}",
                        str(path))
    names, prices = [], []
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("cluster"), str) or set(e) - {"cluster", "price_per_gpu_hour"}:
            raise SpecError("clusters", e, "an entry with cluster (a preset or a file) and optionally "
                                           "price_per_gpu_hour", str(path))
        ref = e["cluster"]
        if (path.parent / ref).is_file():  # a cluster file named relative to the list
            ref = str(path.parent / ref)
        names.append(ref)
        price = e.get("price_per_gpu_hour")
        if price is not None and (not isinstance(price, (int, float)) or isinstance(price, bool)
                                  or not 0 < price <= MAX_PRICE):
            raise SpecError("price_per_gpu_hour", price, f"a positive number at most {MAX_PRICE:,.0f}", str(path))
        prices.append(None if price is None else float(price))
    return names, prices


def parse_names(text: str, option: str = "--cluster") -> list[str]:
    out = list(dict.fromkeys(p.strip() for p in str(text).split(",") if p.strip()))
    if not out:
        raise SpecError(option, text, "one or more cluster presets or files, comma-separated (h800,b200)")
    return out


def parse_prices(text: str | None, clusters: list[str]) -> list[float | None]:
    """One price per GPU-hour for every cluster, or one per cluster in their order; None: no cost."""
    if text is None:
        return [None] * len(clusters)
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise SpecError("--price-per-gpu-hour", text, "numbers, e.g. 2.5 or 2.1,2.5,6 (one per cluster)") from None
    if len(values) == 1:
        values = values * len(clusters)
    if len(values) != len(clusters):
        raise SpecError("--price-per-gpu-hour", text, f"one price, or one per cluster ({len(clusters)}: "
                                                      f"{', '.join(clusters)})")
    for v in values:
        if not 0 < v <= MAX_PRICE:
            raise EchoPlanError(f"--price-per-gpu-hour {v!r} must be positive and at most {MAX_PRICE:,.0f} (rented "
                                "H100s cost ~2-10 an hour)")
    return values


@dataclass(frozen=True, slots=True)
class ClusterComparison:
    """One ``compare`` outcome per cluster, in the order the user listed them."""

    outcomes: tuple[tuple[str, CompareOutcome, float | None, float | None, str], ...]  # name, outcome, price, W, status

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for name, outcome, price, watts, status in self.outcomes:
            for row in outcome.rows:
                best = row.outcome.best
                hours = row.gpu_hours
                energy = hours * watts / 1e6 if hours is not None and watts else None  # MWh
                out.append({"cluster": name, "gpu": outcome.cluster["gpu"]["name"], "num_gpus": row.num_gpus,
                            "plan": plan_label(best.plan) if best is not None else None,
                            "step_time_s": best.step_time_s if best else None,
                            "step_time_range_s": list(best.step_time_range_s) if best and best.step_time_range_s
                            else None,
                            "tokens_per_s": best.tokens_per_s if best else None,
                            "train_days": row.train_time_s / 86400 if row.train_time_s else None,
                            "gpu_hours": hours, "price_per_gpu_hour": price,
                            "cost": hours * price if hours is not None and price is not None else None,
                            "energy_MWh": energy, "calibration": status})
        return out

    def as_json(self) -> dict[str, Any]:
        return {"format": CLUSTER_COMPARE_FORMAT, "clusters": [o[0] for o in self.outcomes], "rows": self.rows(),
                "energy_note": ENERGY_NOTE,
                "by_cluster": {name: compare_to_json(o) for name, o, *_ in self.outcomes}}


ENERGY_NOTE = ("energy: the GPUs at their board power for the whole run, an estimate (CPUs, network, storage and "
               "cooling not counted)")


def run_cluster_compare(clusters: list[Any], prices: list[float | None],
                        run: Callable[[Any], CompareOutcome]) -> ClusterComparison:
    """``run`` (a ``compare`` for one cluster spec) once per cluster."""
    if len({c.name for c in clusters}) != len(clusters):
        raise EchoPlanError("--cluster: the same cluster twice")
    out = []
    for cluster, price in zip(clusters, prices):
        status = calibration_status(cluster)
        out.append((cluster.name, run(cluster), price, cluster.gpu.tdp_W,
                    "calibrated" if status.startswith("calibrated") else
                    status if status.startswith("calibration inherited") else status.split(":")[0]))
    return ClusterComparison(tuple(out))


def _range(rng: list[float] | None) -> str:
    return "-" if not rng else f"{rng[0]:.2f}-{rng[1]:.2f}"


def format_cluster_compare(c: ClusterComparison) -> list[str]:
    rows = c.rows()
    width = max([len(r["plan"] or "no plan fits") for r in rows] + [9])
    name_w = max(len(r["cluster"]) for r in rows)

    f = cell
    head = (f"{'cluster':<{name_w}}  {'GPUs':>5}  {'best plan':<{width}}  {'step s':>8}  {'80% range':>13}  {'tokens/s':>10}  "
            f"{'days':>7}  {'GPU-hours':>10}  {'cost':>11}  {'MWh':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['cluster']:<{name_w}}  {r['num_gpus']:>5}  {r['plan'] or 'no plan fits':<{width}}  "
                     f"{f(r['step_time_s'], '8.3f')}  {_range(r['step_time_range_s']):>13}  "
                     f"{f(r['tokens_per_s'], '10,.0f')}  {f(r['train_days'], '7.1f')}  "
                     f"{f(r['gpu_hours'], '10,.0f')}  {f(r['cost'], '11,.0f')}  {f(r['energy_MWh'], '7.1f')}")
    for name, _, _, _, status in c.outcomes:
        if status.startswith("no calibration"):
            lines.append(f"{name}: {status}: its times are the kernel model's as published, less certain than a "
                         "calibrated cluster's (its range says how much)")
        elif status != "calibrated":
            lines.append(f"{name}: {status}: less certain than a cluster calibrated on its own runs (its range "
                         "says how much)")
    lines.append(ENERGY_NOTE)
    return lines
