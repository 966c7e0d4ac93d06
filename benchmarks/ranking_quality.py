"""Issue 31: is the plan the planner picks the one that ran fastest? Ranking quality on the visible suites.

Run: .venv/bin/python benchmarks/ranking_quality.py [--loso]

A planner is judged on the plan it picks, not on its mean error. Every training suite that ships with
echo-plan is predicted as `validate` predicts it (the suite's preset with its shipped calibration, each
row with its own stack); with --loso, by the calibration made without the suite (leave-one-suite-out,
calibrate/loso.py). The rows are then grouped where a team would choose between them, and each group's
rows are ranked by throughput per GPU (tokens/s/GPU: what a GPU-hour buys), predicted against measured:

* the same model and precision on different layouts or cluster sizes (the NeMo and long-context scaling
  rows, the MoE rows' configurations): which size or layout gives the most per GPU;
* the same model on the same GPUs in bf16 and in fp8: is FP8 worth it, and by how much.

The same plan measured again in another release is not another choice: a group that holds one candidate twice
is split by release (the rows' source), and a group needs two different plans.

Per group it prints the Spearman rank correlation (groups of 3 or more; for a pair, whether the order is
right), the regret of the predicted-best row (1 - measured throughput of the row predicted best / the best
measured), and the group's mean |error|. Target (issue 31): mean regret at most 2% over the groups.
SC21's table has one layout per model (nothing to rank), and the Llama 2 sweep one row per sequence
length: neither forms a group.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_plan.calibrate.loso import predict_without  # noqa: E402
from echo_plan.trace.cache import TraceCache  # noqa: E402
from echo_plan.validation.megatron import validation_dir  # noqa: E402
from echo_plan.validation.predict import RowSimulator  # noqa: E402
from echo_plan.validation.registry import training_rows, training_suite  # noqa: E402

REGRET_TARGET = 0.02


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2.0  # ties share their mean rank
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else float("nan")


def suite_rows(path: Path, cache, loso: bool):
    """(row, predicted step s) of every simulated row of one suite."""
    suite = training_suite(path)
    rows = [r for r in training_rows(suite) if not r.not_modelled]
    if loso:
        got = {r.label: r for r in predict_without(path, validation_dir(), cache).rows}
        return suite, [(r, r.measured_step_s * math.exp(got[r.label].residual)) for r in rows if r.label in got]
    sim = RowSimulator(suite.cluster, suite.stack, cache, model_settings=suite.model_settings)
    out = []
    for r in rows:
        p = sim.predict(r)
        if p.step_s is not None:
            out.append((r, p.step_s))
    return suite, out


def per_gpu(row, step_s: float) -> float:
    """Tokens per second per GPU of a row at a step time."""
    return row.plan["global_batch_size"] * row.model.seq_length / (step_s * row.gpus)


def candidate(row) -> tuple:
    """What a team chooses: the row's plan and its stack settings (the same candidate in another release is not
    another choice)."""
    return tuple(sorted(row.plan.items())) + tuple(sorted((k, str(v)) for k, v in row.stack_overrides.items()))


def groups(suite_name: str, rows):
    """Rows a team would choose between; where a group holds one candidate twice (measured in several releases),
    one group per release (``source``)."""
    by: dict[tuple, list] = defaultdict(list)
    for row, pred in rows:
        dtype = str(row.plan.get("dtype", ""))
        recipe = row.stack_overrides.get("fp8_recipe")
        precision = f"{dtype} {getattr(recipe, 'value', recipe)}" if recipe and dtype == "fp8" else dtype
        by[(suite_name, row.model.name, row.model.seq_length, precision, "sizes and layouts")].append((row, pred))
        by[(suite_name, row.model.name, row.model.seq_length, f"{row.gpus} GPUs", "bf16 or fp8")].append((row, pred))
    out = []
    for key, members in by.items():
        parts = [(key, members)]
        if len({candidate(r) for r, _ in members}) < len(members):
            releases: dict[str, list] = defaultdict(list)
            for row, pred in members:
                releases[row.source].append((row, pred))
            parts = [((*key[:3], f"{key[3]} {src}".strip(), key[4]), part) for src, part in releases.items()]
        for k, part in parts:
            if k[-1] == "bf16 or fp8":
                dtypes = {str(r.plan.get("dtype")) for r, _ in part}
                if dtypes != {"bf16", "fp8"} or len(part) != 2:
                    continue
            if len({candidate(r) for r, _ in part}) >= 2:
                out.append((k, part))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loso", action="store_true", help="predict each suite by the calibration made without it")
    args = ap.parse_args()
    start = time.perf_counter()
    cache = TraceCache(None)
    print(f"{'group':<62} {'n':>2} {'spearman':>9} {'regret':>7} {'mean err':>8}  picked (predicted best) / best")
    regrets, rhos = [], []
    for path in sorted(validation_dir().glob("*.csv")):
        suite, rows = suite_rows(path, cache, args.loso)
        for key, members in groups(suite.name, rows):
            meas = [per_gpu(r, r.measured_step_s) for r, _ in members]
            pred = [per_gpu(r, p) for r, p in members]
            picked = max(range(len(members)), key=lambda i: pred[i])
            best = max(range(len(members)), key=lambda i: meas[i])
            regret = 1.0 - meas[picked] / meas[best]
            err = sum(abs(p / r.measured_step_s - 1.0) for r, p in members) / len(members)
            if len(members) >= 3:
                rho = spearman(pred, meas)
                rhos.append(rho)
                rank = f"{rho:+.2f}"
            else:
                rank = "right" if picked == best else "WRONG"
            regrets.append(regret)
            name = f"{key[0]}: {key[1]} {key[3]} ({key[4]})"
            print(f"{name[:62]:<62} {len(members):>2} {rank:>9} {regret * 100:>6.1f}% {err * 100:>7.1f}%  "
                  f"{members[picked][0].label[len(key[1]) + 1:][:28]} / {members[best][0].label[len(key[1]) + 1:][:28]}")
    mean_regret = sum(regrets) / len(regrets)
    print(f"\n{len(regrets)} groups ({'leave-one-suite-out' if args.loso else 'shipped presets'}): mean regret "
          f"{mean_regret * 100:.2f}% (target at most {REGRET_TARGET * 100:.0f}%: "
          f"{'met' if mean_regret <= REGRET_TARGET else 'NOT met'}), worst {max(regrets) * 100:.1f}%, "
          f"{sum(1 for r in regrets if r > 0)} groups pick a row that was not the best; mean Spearman "
          f"{sum(rhos) / len(rhos):+.2f} over the {len(rhos)} groups of 3 or more (ranks of ties shared)")
    print(f"{time.perf_counter() - start:.1f} s on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
