"""Fitting what DeepEP's normal kernels reach of NVLink and of the network, on named rows (issue 32).

    python -m echo_plan.calibrate.deepep_fit            # fit and print
    python -m echo_plan.calibrate.deepep_fit --write    # and write echo_plan/data/expert_exchange.yaml

The exchange model (cost/expert_exchange.py) takes the cluster's NVLink and NIC rates; what DeepEP's
kernels reach of them is fitted here: the NVLink share on the single-server rows (EP 8, where NVLink is
all there is), the network share on the largest EP's rows (EP 64, network-bound). A reported bandwidth
is proportional to the share of the path that bounds it, so each share is the geometric mean of
measured / predicted-at-full-rate over its rows. EP 16 and EP 32 stay held out (`validate` shows them).
Each DeepEP release (its own table, ``validation/exchange.py`` DEEPEP_FILES) gets its own pair of shares.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import yaml

from echo_plan.cost.expert_exchange import EXCHANGE_FORMAT, ExchangeEfficiency
from echo_plan.errors import EchoPlanError
from echo_plan.files import write_atomic
from echo_plan.specs import load_cluster
from echo_plan.specs.software_kinds import DeepEPRelease
from echo_plan.validation.exchange import CLUSTER, DEEPEP_FILES, predict, read_deepep
from echo_plan.validation.megatron import validation_dir

NVLINK_ROWS = (8,)  # EP sizes whose rows fit the NVLink share
NETWORK_ROWS = (64,)  # and the network share
DATA = Path(__file__).resolve().parents[1] / "data" / "expert_exchange.yaml"
SOURCES = {DeepEPRelease.FEB_2025: "DeepEP's first README, commit ebfe47e, 2025-02-24",
           DeepEPRelease.APR_2025: "DeepEP docs/legacy.md, the README of 2025-04-22"}


def fit_release(rows: list, release: DeepEPRelease, cluster) -> dict:  # noqa: ANN001
    """One release's two shares from its own ``rows`` (NVLINK_ROWS and NETWORK_ROWS; the others held out)."""
    full = ExchangeEfficiency(1.0, 1.0)

    def share(eps: tuple[int, ...], path: str) -> tuple[float, list[str]]:
        chosen = [r for r in rows if r.ep in eps]
        got = [predict(r, cluster, full) for r in chosen]
        if not chosen or any(c.bottleneck != path for c in got):
            raise EchoPlanError(f"DeepEP {release.value}: the rows at EP {eps} are missing or not all {path}-bound: "
                                "they cannot fit its share")
        logs = [math.log(r.measured_GBps / c.reported_GBps) for r, c in zip(chosen, got)]
        return math.exp(sum(logs) / len(logs)), [r.label for r in chosen]

    nvl, nvl_rows = share(NVLINK_ROWS, "nvlink")
    net, net_rows = share(NETWORK_ROWS, "network")
    return {"nvlink_efficiency": round(nvl, 4), "network_efficiency": round(net, 4), "fitted_on": nvl_rows + net_rows,
            "source": f"{DEEPEP_FILES[release]} ({SOURCES[release]}, H800) on the {CLUSTER} "
                      "preset's NVLink and NIC; fitted by python -m echo_plan.calibrate.deepep_fit (NVLink share on "
                      "EP 8, network share on EP 64; EP 16 and 32 held out)"}


def fit(vdir: Path) -> dict:
    cluster = load_cluster(CLUSTER)

    def rows(release: DeepEPRelease) -> list:
        return [r for r in read_deepep(vdir / DEEPEP_FILES[release])
                if r.kernel == "normal" and r.release == release.value]
    return {"format": EXCHANGE_FORMAT,
            "deepep_normal": {rel.value: fit_release(rows(rel), rel, cluster) for rel in DeepEPRelease}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {DATA.name}")
    args = ap.parse_args(argv)
    got = fit(validation_dir())
    for release, d in got["deepep_normal"].items():
        print(f"DeepEP {release}: nvlink_efficiency {d['nvlink_efficiency']}, network_efficiency "
              f"{d['network_efficiency']} (fitted on {', '.join(d['fitted_on'])})")
    if args.write:
        head = ("# What DeepEP's normal kernels reach of a cluster's NVLink and network rates (cost/expert_exchange.py).\n"
                "# Written by python -m echo_plan.calibrate.deepep_fit from named rows; do not edit.\n")
        write_atomic(DATA, head + yaml.safe_dump(got, sort_keys=False, width=110))
        print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
