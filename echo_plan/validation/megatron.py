"""Narayanan et al. 2021 (SC21), Table 1 (Megatron-LM weak scaling on DGX A100) as validation rows.

Each row is a GPT model (heads, hidden, layers), its tensor and pipeline degrees, its GPU count
and global batch; the published figure is achieved TFLOP/s per GPU counting full activation
recomputation (``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per iteration). The rows run on the
``dgx-a100`` preset with the ``megatron-lm-2021`` stack (stacks/megatron-lm-2021.yaml: unfused
attention, dropout, gradients all-reduced after the backward pass, no distributed optimizer), in
fp16 with full recomputation, and the predicted step time turns into the same figure with the same
formula.

The table leaves the micro-batch size and interleaving open. The choice (:func:`megatron_choice`),
the same rule for every row:

* micro-batch 1 whenever there is a pipeline (pp > 1): the paper's guidance (section 3.4: larger
  micro-batches grow the bubble for a fixed batch) and Megatron-LM's GPT-3 175B example script
  (``--micro-batch-size 1``); with no pipeline there is no bubble and a larger micro-batch only
  makes GEMMs bigger, so micro-batch 4 (a common Megatron-LM setting for small models;
  ``benchmarks/accuracy_sensitivity.py`` shows the others);
* the interleaved schedule with 2 model chunks per rank when pp > 1 and the layers and
  micro-batches allow it (the paper introduces it and reports 10+% gains at this scale); plain
  1F1B otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from echo_plan.errors import FileFormatError
from echo_plan.validation.rows import TFLOPS_UNIT, TrainingRow, csv_records
from echo_plan.replay.metrics import megatron_gpt_flops
from echo_plan.specs import ModelSpec

ENV_VAR = "ECHO_PLAN_VALIDATION_DIR"
TABLE = "megatron_weak_scaling_a100.csv"
TABLE_COLUMNS = ("params_b", "heads", "hidden", "layers", "tp", "pp", "gpus", "global_batch",
                 "achieved_tflops_per_gpu")


SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "validation"


def validation_dir() -> Path:
    """The suites that ship with echo-plan (package data: echo_plan/data/validation/), the ones the
    presets' calibration was fitted on."""
    return SHIPPED_DIR


def added_validation_dirs() -> list[Path]:
    """Folders of more suites named by $ECHO_PLAN_VALIDATION_DIR (several separated by os.pathsep)."""
    return [Path(p) for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip()]


@dataclass(frozen=True, slots=True)
class TableSettings:
    """What a table of this format leaves implicit; defaults are the SC21 table's (its header)."""

    seq_length: int = 2048
    vocab_size: int = 51200
    dtype: str = "fp16"
    recompute: str = "full"


def interleaving_allowed(layers: int, pp: int, gpus: int, tp: int, gbs: int, mbs: int, vpp: int) -> bool:
    if vpp == 1:
        return True
    dp = gpus // (tp * pp)
    m = gbs // (dp * mbs)
    return pp > 1 and layers % (pp * vpp) == 0 and m % pp == 0


def megatron_choice(layers: int, pp: int, gpus: int, tp: int, gbs: int) -> tuple[int, int]:
    """(micro-batch, virtual stages) by the rule in the module docstring."""
    if pp == 1:
        return 4, 1
    return 1, 2 if interleaving_allowed(layers, pp, gpus, tp, gbs, 1, 2) else 1


def read_tflops_table(path: Path, settings: TableSettings = TableSettings(),
                      choice: tuple[int, int] | None = None) -> tuple[TrainingRow, ...]:
    """Rows of an SC21-format table; ``choice`` forces one (micro-batch, virtual stages) for every row."""
    if not path.exists():
        raise FileFormatError(str(path), f"no such file (set {ENV_VAR} to the folder holding the suites)")
    header, records = csv_records(path)
    missing = [c for c in TABLE_COLUMNS if c not in header]
    if missing:
        raise FileFormatError(str(path), f"not a TFLOP/s table: missing columns {', '.join(missing)} "
                              f"(required: {', '.join(TABLE_COLUMNS)})")
    rows = []
    for line, rec in records:
        try:
            p_b, heads, hidden, layers = float(rec["params_b"]), int(rec["heads"]), int(rec["hidden"]), int(rec["layers"])
            tp, pp, gpus, gbs = int(rec["tp"]), int(rec["pp"]), int(rec["gpus"]), int(rec["global_batch"])
            tflops = float(rec["achieved_tflops_per_gpu"])
            mbs_col, vpp_col = rec.get("micro_batch_size"), rec.get("virtual_stages")
        except ValueError as exc:
            raise FileFormatError(str(path), f"row is malformed: {exc}", line) from None
        if choice is not None:
            mbs, vpp = choice
        elif mbs_col:
            mbs, vpp = int(mbs_col), int(vpp_col or 1)
        else:
            mbs, vpp = megatron_choice(layers, pp, gpus, tp, gbs)
        model = ModelSpec.build({
            "name": f"gpt-{p_b:g}b", "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "vocab_size": settings.vocab_size, "seq_length": settings.seq_length, "source": f"{path.name}, line {line}",
        }, context=f"{path.name}, line {line}")
        plan = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "micro_batch_size": mbs, "global_batch_size": gbs,
                "virtual_stages": vpp, "recompute": settings.recompute, "dtype": settings.dtype,
                "distributed_optimizer": False}
        flops = megatron_gpt_flops(gbs, settings.seq_length, layers, hidden, settings.vocab_size,
                                   full_recompute=settings.recompute == "full")
        rows.append(TrainingRow(f"{p_b:g}B tp{tp} pp{pp} {gpus} GPUs", tflops, TFLOPS_UNIT, model=model, gpus=gpus,
                                plan=MappingProxyType(plan), flops_per_step=flops, detail=f"mbs {mbs} vpp {vpp}"))
    return tuple(rows)
