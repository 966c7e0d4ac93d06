"""Predict Narayanan et al. 2021 (SC21), Table 1: Megatron-LM weak scaling on DGX A100.

Each row is a GPT model (heads, hidden, layers), its tensor and pipeline degrees, its GPU count
and global batch; the published figure is achieved TFLOP/s per GPU counting full activation
recomputation (``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per iteration). We simulate each row
on the ``dgx-a100`` preset resized to the row's GPUs, in fp16 with full recomputation, and turn
the predicted step time into the same figure with the same formula.

The table leaves the micro-batch size and interleaving open. Our default choice
(:func:`megatron_choice`), the same rule for every row:

* micro-batch 1 whenever there is a pipeline (pp > 1): the paper's guidance (section 3.4: larger
  micro-batches grow the bubble for a fixed batch) and Megatron-LM's GPT-3 175B example script
  (``--micro-batch-size 1``); with no pipeline there is no bubble and a larger micro-batch only
  makes GEMMs bigger, so micro-batch 4 (a common Megatron-LM setting for small models; the
  sensitivity table shows the others);
* the interleaved schedule with 2 model chunks per rank when pp > 1 and the layers and
  micro-batches allow it (the paper introduces it and reports 10+% gains at this scale); plain
  1F1B otherwise;
* the 2021 software stack: gradients all-reduced after the backward pass (Megatron-LM's local
  DDP of 2021 had no overlap; ``--overlap-grad-reduce`` came with Megatron-core in 2023), no
  distributed optimizer (also later), and unfused attention (software2021.py: FlashAttention
  appeared in 2022).

Calibration: :func:`fit_compute_scale` fits ONE factor on all compute kernel times (what the
roofline model misses of a 2021 cuBLAS/PyTorch stack under sustained load) on a subset of rows
(the even-indexed ones by default) and the report gives the error on the held-out rows apart.

:func:`sensitivity` reruns a row over micro-batch sizes and interleaving depths.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from echo_plan.errors import FileFormatError

ENV_VAR = "ECHO_PLAN_VALIDATION_DIR"
TABLE = "megatron_weak_scaling_a100.csv"
SEQ, VOCAB = 2048, 51200  # the table's header: sequence 2048, vocabulary 51,200


def validation_dir() -> Path:
    """$ECHO_PLAN_VALIDATION_DIR, else ``<repo root>/../shared/validation``."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[2]
    return root.parent / "shared" / "validation"


@dataclass(frozen=True, slots=True)
class TableSettings:
    """What a table of this format leaves implicit; defaults are the SC21 table's (its header)."""

    cluster: str = "dgx-a100"
    seq_length: int = SEQ
    vocab_size: int = VOCAB
    dtype: str = "fp16"
    recompute: str = "full"
    unfused_attention: bool = True  # the 2021 software stack (software2021.py)


MEGATRON_2021 = TableSettings()


@dataclass(frozen=True, slots=True)
class Row:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    published_tflops: float
    micro_batch_size: int | None = None  # when the table gives it; else megatron_choice decides
    virtual_stages: int | None = None


def load_rows(path: str | Path | None = None) -> tuple[Row, ...]:
    p = Path(path) if path is not None else validation_dir() / TABLE
    if not p.exists():
        raise FileFormatError(str(p), f"no such file (set {ENV_VAR} to the folder holding {TABLE})")
    lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]
    rows = []
    for n, rec in enumerate(csv.DictReader(lines), start=2):
        try:
            mbs, vpp = rec.get("micro_batch_size"), rec.get("virtual_stages")
            rows.append(Row(float(rec["params_b"]), int(rec["heads"]), int(rec["hidden"]), int(rec["layers"]),
                            int(rec["tp"]), int(rec["pp"]), int(rec["gpus"]), int(rec["global_batch"]),
                            float(rec["achieved_tflops_per_gpu"]),
                            int(mbs) if mbs not in (None, "") else None,
                            int(vpp) if vpp not in (None, "") else None))
        except (KeyError, ValueError, TypeError) as exc:
            raise FileFormatError(str(p), f"row {n} of the table is malformed: {exc}") from None
    return tuple(rows)


def row_model(row: Row, settings: TableSettings = MEGATRON_2021):
    from echo_plan.specs import ModelSpec

    return ModelSpec.build({
        "name": f"gpt-{row.params_b:g}b", "num_layers": row.layers, "hidden_size": row.hidden,
        "num_attention_heads": row.heads, "vocab_size": settings.vocab_size, "seq_length": settings.seq_length,
        "source": "validation table row",
    })


def row_cluster(row: Row, settings: TableSettings = MEGATRON_2021):
    from echo_plan.specs import load_cluster

    return load_cluster(settings.cluster, gpus=row.gpus)


def row_plan(row: Row, mbs: int, vpp: int, settings: TableSettings = MEGATRON_2021):
    from echo_plan.specs import PlanSpec

    dp = row.gpus // (row.tp * row.pp)
    return PlanSpec.build({
        "tp": row.tp, "pp": row.pp, "dp": dp, "micro_batch_size": mbs, "global_batch_size": row.global_batch,
        "virtual_stages": vpp, "schedule": "interleaved" if vpp > 1 else "1f1b", "recompute": settings.recompute,
        "dtype": settings.dtype, "distributed_optimizer": False, "overlap_grad_reduce": False,
    })


def interleaving_allowed(row: Row, mbs: int, vpp: int) -> bool:
    if vpp == 1:
        return True
    dp = row.gpus // (row.tp * row.pp)
    m = row.global_batch // (dp * mbs)
    return row.pp > 1 and row.layers % (row.pp * vpp) == 0 and m % row.pp == 0


def megatron_choice(row: Row) -> tuple[int, int]:
    """(micro-batch, virtual stages): the row's own when the table gives them, else the rule in
    the module docstring."""
    if row.micro_batch_size is not None:
        return row.micro_batch_size, row.virtual_stages or 1
    if row.pp == 1:
        return 4, 1
    return 1, 2 if interleaving_allowed(row, 1, 2) else 1


@dataclass(frozen=True, slots=True)
class Prediction:
    row: Row
    mbs: int
    vpp: int
    predicted_tflops: float
    step_time_s: float
    fits: bool

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted - published) / published."""
        return (self.predicted_tflops - self.row.published_tflops) / self.row.published_tflops


class Predictor:
    """Simulates rows with the 2021 kernels; keeps one memo and one compute model per factor."""

    def __init__(self, cache=None, memo=None, compute_scale: float = 1.0, unfused_attention: bool | None = None,
                 settings: TableSettings = MEGATRON_2021) -> None:
        from echo_plan.simulate import SimulationMemo

        self.cache = cache
        self.memo = memo if memo is not None else SimulationMemo()
        self.compute_scale = compute_scale
        self.settings = settings
        self.unfused_attention = settings.unfused_attention if unfused_attention is None else unfused_attention
        self._compute: dict[tuple, object] = {}

    def compute_model(self, cluster, scale: float):
        from echo_plan.validation.software2021 import ScaledComputeModel, UnfusedAttentionModel

        key = (cluster.gpu.name, scale)
        if key not in self._compute:
            model = self.memo.default_compute(cluster)
            if self.unfused_attention:
                model = UnfusedAttentionModel(model)
            self._compute[key] = ScaledComputeModel(model, scale) if scale != 1.0 else model
        return self._compute[key]

    def predict(self, row: Row, mbs: int, vpp: int, scale: float | None = None) -> "Prediction":
        from echo_plan.replay.metrics import megatron_gpt_flops
        from echo_plan.simulate import simulate

        st = self.settings
        cluster = row_cluster(row, st)
        compute = self.compute_model(cluster, self.compute_scale if scale is None else scale)
        result = simulate(row_model(row, st), cluster, row_plan(row, mbs, vpp, st), cache=self.cache, memo=self.memo,
                          compute=compute)
        flops = megatron_gpt_flops(row.global_batch, st.seq_length, row.layers, row.hidden, st.vocab_size,
                                   full_recompute=st.recompute == "full")
        return Prediction(row, mbs, vpp, flops / (result.step_time_s * row.gpus) / 1e12, result.step_time_s,
                          result.fits)

    def table(self, rows=None, scale: float | None = None) -> tuple["Prediction", ...]:
        rows = rows if rows is not None else load_rows()
        return tuple(self.predict(r, *megatron_choice(r), scale=scale) for r in rows)

    def sensitivity(self, row: Row, mbs_options=(1, 2, 4, 8), vpp_options=(1, 2, 4)) -> tuple["Prediction", ...]:
        """Predictions of one row for every allowed (micro-batch, virtual stages) choice."""
        out = []
        dp = row.gpus // (row.tp * row.pp)
        for mbs in mbs_options:
            if row.global_batch % (dp * mbs):
                continue
            for vpp in vpp_options:
                if interleaving_allowed(row, mbs, vpp):
                    out.append(self.predict(row, mbs, vpp))
        return tuple(out)


def fit_compute_scale(predictor: Predictor, rows, tol: float = 0.01) -> tuple[float, tuple[Prediction, ...]]:
    """The compute-time factor that makes the mean log error over ``rows`` zero, and those rows'
    predictions at it. Compute dominates every row, so the predicted TFLOP/s is close to inversely
    proportional to the factor: fixed-point steps on the geometric-mean ratio until a step changes
    the factor by less than ``tol``."""
    import math

    scale = 1.0
    for _ in range(5):
        preds = predictor.table(rows, scale=scale)
        step = math.exp(sum(math.log(p.predicted_tflops / p.row.published_tflops) for p in preds) / len(preds))
        if abs(step - 1.0) < tol:
            return scale, preds
        scale *= step
    return scale, predictor.table(rows, scale=scale)


def split_rows(rows) -> tuple[tuple[Row, ...], tuple[Row, ...]]:
    """(fit rows, held-out rows): even-indexed rows fit, odd-indexed rows test."""
    return tuple(rows[0::2]), tuple(rows[1::2])


def mean_abs_error(preds) -> float:
    return sum(abs(p.error) for p in preds) / len(preds)


def format_table(preds) -> str:
    lines = [f"{'model':>8} {'tp':>3} {'pp':>3} {'gpus':>5} {'gbs':>5} {'mbs':>3} {'vpp':>3} "
             f"{'published':>9} {'predicted':>9} {'error':>7} fits"]
    for p in preds:
        r = p.row
        lines.append(f"{r.params_b:>7g}B {r.tp:>3} {r.pp:>3} {r.gpus:>5} {r.global_batch:>5} {p.mbs:>3} {p.vpp:>3} "
                     f"{r.published_tflops:>9.0f} {p.predicted_tflops:>9.1f} {p.error * 100:>+6.1f}% "
                     f"{'yes' if p.fits else 'no'}")
    lines.append(f"mean absolute error: {mean_abs_error(preds) * 100:.1f}%")
    return "\n".join(lines)
