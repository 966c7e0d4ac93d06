"""Validation rows: one measured training run each, read from a suite's CSV file.

Two formats (``docs/validation.md``):

* ``tflops-table``: Megatron-LM's SC21 table (``megatron.py``): GPT shapes and layouts with the
  achieved TFLOP/s per GPU;
* ``step-times``: one run per row with the model's shape, the layout and the software settings in
  columns, and the measured ``step_time_s`` (NVIDIA's NeMo/Megatron-Core benchmark tables).

A row that needs something the simulator cannot do yet (a kind of row it does not know) is kept and
marked ``not_modelled`` with the reason, so a suite always shows all of its rows.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from echo_plan.errors import EchoPlanError, FileFormatError
from echo_plan.files import read_text
from echo_plan.specs import ModelSpec
from echo_plan.specs import load_model, model_names
from echo_plan.specs.plan import balanced_split

STEP_UNIT = "s/step"
TFLOPS_UNIT = "TFLOP/s per GPU"
MODEL_COLUMNS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "vocab_size",
                 "seq_length", "activation", "norm", "position", "tied_embeddings")
PLAN_COLUMNS = ("gpus", "tp", "pp", "mbs", "gbs")


@dataclass(frozen=True)
class TrainingRow:
    label: str
    measured: float  # the suite's figure, in ``unit``
    unit: str
    not_modelled: str = ""  # why the simulator cannot predict it yet ("" when it can)
    model: Any = None  # ModelSpec
    gpus: int = 0
    plan: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # PlanSpec fields
    stack_overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    flops_per_step: float = 0.0  # the FLOPs the TFLOP/s figure counts per step (tflops-table rows)
    detail: str = ""  # choices made for what the suite leaves open
    measured_peak_gib: float | None = None  # the run's published peak memory per GPU, where the source gives it
    source: str = ""  # the release or run set the row comes from (the file's source column), where it names one

    @property
    def measured_step_s(self) -> float:
        if self.unit == TFLOPS_UNIT:
            return self.flops_per_step / (self.measured * 1e12 * self.gpus)
        return self.measured

    def figure(self, step_s: float) -> float:
        """A predicted step time in the suite's own unit."""
        if self.unit == TFLOPS_UNIT:
            return self.flops_per_step / (step_s * self.gpus) / 1e12
        return step_s


def csv_records(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """(header, [(line number, record)]) of a CSV file whose comment lines start with '#'."""
    lines = read_text(path).splitlines()
    numbered = [(n, ln) for n, ln in enumerate(lines, start=1) if ln.strip() and not ln.lstrip().startswith("#")]
    if not numbered:
        raise FileFormatError(str(path), "no header and no rows")
    header = [c.strip() for c in next(csv.reader([numbered[0][1]]))]
    out = []
    for n, ln in numbered[1:]:
        values = next(csv.reader([ln]))
        if len(values) != len(header):
            raise FileFormatError(str(path), f"{len(values)} values for {len(header)} columns", n)
        out.append((n, {k: v.strip() for k, v in zip(header, values)}))
    return header, out


def _bool(value: str, column: str, path: Path, line: int) -> bool:
    v = value.strip().lower()
    if v in ("true", "yes", "1"):
        return True
    if v in ("false", "no", "0"):
        return False
    raise FileFormatError(str(path), f"column {column}: {value!r} is not true or false", line)


def _num(rec: dict[str, str], column: str, path: Path, line: int, kind: type = int) -> Any:
    raw = rec.get(column, "")
    try:
        value = kind(raw)
    except ValueError:
        raise FileFormatError(str(path), f"column {column}: {raw!r} is not {'an integer' if kind is int else 'a number'}",
                              line) from None
    if kind is float and not value == value:  # NaN
        raise FileFormatError(str(path), f"column {column}: {raw!r} is not a number", line)
    return value


def _position(value: str) -> tuple[str, float]:
    """'learned', 'none', 'rope', 'rope(50% of head dim)' -> (position_embedding, rotary_percent)."""
    v = value.strip().lower()
    if v.startswith(("rope", "rotary")):
        if "(" in v and "%" in v:
            pct = float(v[v.index("(") + 1: v.index("%")])
            return "rotary", pct / 100.0
        return "rotary", 1.0
    return v, 1.0


def _label(rec: dict[str, str]) -> str:
    return f"{rec.get('model', '?')} {rec.get('precision', '')} {rec.get('gpus', '?')} GPUs".replace("  ", " ")


def _why_not(rec: dict[str, str], suite_reason: str) -> str:
    reasons = [suite_reason] if suite_reason else []
    if rec.get("kind", "step") not in ("step", "tflops"):
        reasons.append(f"a row of kind {rec.get('kind')!r} (step or tflops are known)")
    if rec.get("not_modelled"):
        reasons.append(rec["not_modelled"])
    return "; ".join(dict.fromkeys(reasons))


@dataclass(frozen=True)
class RowCorrection:
    """A value the file lists that the run's own configuration contradicts: rows whose columns equal
    ``match`` are predicted with the columns of ``values`` instead (their labels keep the listed values),
    and ``why`` (the evidence) is shown beside the row."""

    match: Mapping[str, str]
    values: Mapping[str, str]
    why: str


def apply_corrections(path: Path, records: list[tuple[int, dict[str, str]]], header: list[str],
                      corrections: tuple[RowCorrection, ...]) -> dict[int, str]:
    """Apply ``corrections`` to the records in place; {line: what was changed and why}. A correction
    naming a column the file lacks, or matching no row, is an error (a changed file must be noticed)."""
    notes: dict[int, str] = {}
    for fix in corrections:
        unknown = [c for c in (*fix.match, *fix.values) if c not in header]
        if unknown:
            raise FileFormatError(str(path), f"a row correction names column(s) {', '.join(unknown)} that the file "
                                             f"lacks (columns: {', '.join(header)})")
        hits = [(line, rec) for line, rec in records if all(rec.get(c) == v for c, v in fix.match.items())]
        if not hits:
            wanted = ", ".join(f"{c}={v}" for c, v in fix.match.items())
            raise FileFormatError(str(path), f"a row correction matches no row ({wanted})")
        for line, rec in hits:
            changed = ", ".join(f"{c} {v} (listed {rec.get(c)})" for c, v in fix.values.items())
            rec.update(fix.values)
            notes[line] = f"run as {changed}: {fix.why}"
    return notes


def read_step_times(path: Path, not_modelled: str = "",
                    row_defaults: Mapping[str, Mapping[str, str]] | None = None,
                    corrections: tuple[RowCorrection, ...] = ()) -> tuple[TrainingRow, ...]:
    """Rows of a ``step-times`` suite (see the module docstring); labels are unique in the file.
    ``row_defaults``: per model name, values of columns the file leaves out (its header states them);
    ``corrections``: listed values the runs' own configs contradict (labels keep the listed values)."""
    header, records = csv_records(path)
    if row_defaults:
        extra = [c for d in row_defaults.values() for c in d if c not in header]
        header = header + list(dict.fromkeys(extra))
        for _, rec in records:
            for col, value in (row_defaults.get(rec.get("model", ""), {})).items():
                if rec.get(col, "") == "":
                    rec[col] = value
    missing = [c for c in ("model",) + PLAN_COLUMNS if c not in header]
    if missing:
        raise FileFormatError(str(path), f"not a step-times suite: missing columns {', '.join(missing)}")
    labels: dict[str, int] = {}
    for _, rec in records:
        labels[_label(rec)] = labels.get(_label(rec), 0) + 1
    named = {}
    for line, rec in records:  # labels name the rows as the file lists them
        label = _label(rec)
        if labels[label] > 1:
            label += f" tp{rec.get('tp')} pp{rec.get('pp')} mbs{rec.get('mbs')} gbs{rec.get('gbs')}"
        named[line] = label
    again: dict[str, int] = {}
    for label in named.values():
        again[label] = again.get(label, 0) + 1
    for line, rec in records:  # the same configuration in several releases: the source tells them apart
        if again[named[line]] > 1 and rec.get("source"):
            named[line] += f" ({rec['source']})"
    corrected = apply_corrections(path, records, header, corrections) if corrections else {}
    rows = []
    for line, rec in records:
        label = named[line]
        why = _why_not(rec, not_modelled)
        measured_col = "step_time_s" if rec.get("step_time_s") else "tflops_per_gpu"
        unit = STEP_UNIT if measured_col == "step_time_s" else TFLOPS_UNIT
        measured = _num(rec, measured_col, path, line, float) if rec.get(measured_col) else float("nan")
        if why:
            rows.append(TrainingRow(label, measured, unit, not_modelled=why))
            continue
        absent = [c for c in MODEL_COLUMNS + (measured_col,) if c not in header or rec.get(c, "") == ""]
        preset = _preset(rec, path, line) if absent and measured_col not in absent else None
        if preset is not None:  # the file names a model preset (its header gives the shapes) instead of columns
            preset = _with_columns(preset, rec, path, line)
            flops = nemo_model_flops(preset, _num(rec, "gbs", path, line), path, line) if unit == TFLOPS_UNIT else 0.0
            rows.append(TrainingRow(label, measured, unit, model=preset, gpus=_num(rec, "gpus", path, line),
                                    plan=MappingProxyType(_plan_fields(rec, path, line, preset)),
                                    stack_overrides=MappingProxyType(_stack_fields(rec, path, line)),
                                    flops_per_step=flops, detail=corrected.get(line, ""),
                                    measured_peak_gib=_peak(rec, path, line), source=rec.get("source", "")))
            continue
        if absent:
            raise FileFormatError(str(path), f"row {label!r} cannot be simulated: no {', '.join(absent)}", line)
        position, rotary = _position(rec["position"])
        try:
            model = ModelSpec.build({
                "name": rec["model"], "num_layers": _num(rec, "num_layers", path, line),
                "hidden_size": _num(rec, "hidden_size", path, line),
                "ffn_hidden_size": _num(rec, "ffn_hidden_size", path, line),
                "num_attention_heads": _num(rec, "num_attention_heads", path, line),
                "num_kv_heads": _num(rec, "num_kv_heads", path, line), "vocab_size": _num(rec, "vocab_size", path, line),
                "seq_length": _num(rec, "seq_length", path, line), "activation": rec["activation"],
                "norm": rec["norm"], "position_embedding": position, "rotary_percent": rotary,
                "tied_embeddings": _bool(rec["tied_embeddings"], "tied_embeddings", path, line),
                "bias": _bool(rec["bias"], "bias", path, line) if rec.get("bias") else None,
                "qk_norm": _bool(rec["qk_norm"], "qk_norm", path, line) if rec.get("qk_norm") else False,
                "source": f"{path.name}, line {line}",
            }, context=f"{path.name}, line {line}")
        except EchoPlanError as exc:
            raise FileFormatError(str(path), str(exc), line) from None
        flops = nemo_model_flops(model, _num(rec, "gbs", path, line), path, line) if unit == TFLOPS_UNIT else 0.0
        rows.append(TrainingRow(label, measured, unit, model=model, gpus=_num(rec, "gpus", path, line),
                                plan=MappingProxyType(_plan_fields(rec, path, line, model)),
                                stack_overrides=MappingProxyType(_stack_fields(rec, path, line)),
                                flops_per_step=flops, detail=corrected.get(line, ""),
                                measured_peak_gib=_peak(rec, path, line), source=rec.get("source", "")))
    return tuple(rows)


def _peak(rec: dict[str, str], path: Path, line: int) -> float | None:
    """The row's published peak memory per GPU (GiB, column peak_mem_GiB), or None."""
    return _num(rec, "peak_mem_GiB", path, line, float) if rec.get("peak_mem_GiB") else None


def _with_columns(model: Any, rec: dict[str, str], path: Path, line: int) -> Any:
    """A preset with the shape columns the row does give (a sweep's reduced layers, say) applied."""
    changes = {c: _num(rec, c, path, line) for c in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                     "num_attention_heads", "num_kv_heads") if rec.get(c)}
    changes = {k: v for k, v in changes.items() if getattr(model, k, v) != v}
    return model.replace(**changes) if changes else model


def nemo_model_flops(model: Any, gbs: int, path: Path, line: int) -> float:
    """The model FLOPs of one step as NeMo counts them for its Llama families (NVIDIA NeMo,
    nemo/utils/flops_formulas.py, ``llama2``/``llama3``): per sequence and layer
    s h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V/(L h)), forward and backward, full (not causal) attention."""
    if not model.activation.gated or model.is_moe:
        raise FileFormatError(str(path), f"a TFLOP/s row of {model.name}: NeMo's Llama FLOPs formula needs a dense "
                                         "gated-MLP model", line)
    s, h, L = model.seq_length, model.hidden_size, model.num_layers
    per = (12 + 12 * model.kv_heads / model.num_attention_heads + 18 * model.ffn_size / h + 12 * s / h
           + 6 * model.vocab_size / (L * h))
    return float(gbs) * s * L * h * h * per


def _preset(rec: dict[str, str], path: Path, line: int) -> Any:
    """The model preset a row names, at the row's sequence length; None when the name is no preset."""
    if rec.get("model") not in model_names():
        return None
    model = load_model(rec["model"])
    if rec.get("seq_length"):
        model = model.replace(seq_length=_num(rec, "seq_length", path, line), source=f"{path.name}, line {line}")
    return model


def _plan_fields(rec: dict[str, str], path: Path, line: int, model: Any = None) -> dict[str, Any]:
    """The row's plan. Rows of an MoE model without the columns run as the NeMo/Megatron-Bridge recipes do:
    sequence parallel with tp > 1 and the distributed optimizer (ASSUMPTION: recipe defaults); a pipeline
    (or, interleaved, its virtual stages) that does not divide the layers splits them as ``balanced_split``
    does (the recipes' own pipeline layouts are not in the file)."""
    tp, pp, gpus = (_num(rec, c, path, line) for c in ("tp", "pp", "gpus"))
    vpp = _num(rec, "vpp", path, line) if rec.get("vpp") else 1
    cp = _num(rec, "cp", path, line) if rec.get("cp") else 1
    fields: dict[str, Any] = {
        "tp": tp, "pp": pp, "dp": gpus // (tp * pp * cp) if tp * pp * cp else 0, "micro_batch_size": _num(rec, "mbs", path, line),
        "global_batch_size": _num(rec, "gbs", path, line), "virtual_stages": vpp,
        "recompute": rec.get("recompute") or "none", "dtype": row_dtype(rec.get("precision") or "bf16"),
    }
    for col in ("ep", "etp", "cp"):
        if rec.get(col):
            fields[col] = _num(rec, col, path, line)
    if model is not None and model.is_moe:
        fields.update(sequence_parallel=tp > 1, distributed_optimizer=True)
        if not rec.get("recompute"):
            del fields["recompute"]  # the suite's model settings may say
        if vpp == 1 and pp > 1 and model.num_layers % pp:
            fields["layer_split"] = balanced_split(model.num_layers, pp)
        elif vpp > 1 and model.num_layers % (pp * vpp):  # ASSUMPTION: per virtual stage, as even as possible
            fields["layer_split"] = balanced_split(model.num_layers, pp * vpp)
    for col, key in (("sequence_parallel", "sequence_parallel"), ("distributed_optimizer", "distributed_optimizer"),
                     ("overlap_grad_sync", "overlap_grad_reduce"), ("overlap_param_sync", "overlap_param_gather"),
                     ("reshard_after_forward", "reshard_after_forward")):
        if rec.get(col):
            fields[key] = _bool(rec[col], col, path, line)
    if rec.get("layer_split") == "auto" and model is not None:  # as even as possible, fewer on the ends
        fields["layer_split"] = balanced_split(model.num_layers, pp * vpp)
    elif rec.get("layer_split"):
        raise FileFormatError(str(path), f"column layer_split: {rec['layer_split']!r} (auto is known)", line)
    if rec.get("sharding"):
        fields["sharding"] = rec["sharding"]
    for col in ("shard_degree", "recompute_layers"):
        if rec.get(col) and rec[col] != "0":
            fields[col] = _num(rec, col, path, line)
    return fields


# A precision column names the plan's dtype, or a Blackwell recipe: mxfp8 is fp8 with the MXFP8 recipe (the
# stack's fp8_recipe), nvfp4 is fp4 (Transformer Engine's NVFP4BlockScaling, the one FP4 training recipe).
RECIPE_PRECISIONS = {"mxfp8": ("fp8", "mxfp8"), "nvfp4": ("fp4", None)}


def row_dtype(precision: str) -> str:
    """The plan dtype of a precision column value."""
    return RECIPE_PRECISIONS.get(precision.lower(), (precision, None))[0]


def _plus_list(value: str) -> tuple[str, ...]:
    """A column of names joined by '+' (``layernorm+moe_act``); ``none``: the empty list."""
    value = value.strip().lower()
    return () if value == "none" else tuple(m.strip() for m in value.split("+") if m.strip())


def _stack_fields(rec: dict[str, str], path: Path, line: int) -> dict[str, Any]:
    """The row's own software settings, on top of the suite's stack."""
    out: dict[str, Any] = {}
    recipe = RECIPE_PRECISIONS.get((rec.get("precision") or "").lower(), (None, None))[1]
    if recipe is not None:
        out["fp8_recipe"] = recipe
    if rec.get("dropout"):
        p = _num(rec, "dropout", path, line, float)
        out.update(hidden_dropout=p, attention_dropout=p)
    if rec.get("cuda_graph_scope"):  # the parts of each layer the run captured in CUDA graphs
        out["cuda_graph_scope"] = _plus_list(rec["cuda_graph_scope"])
    # how tokens reach their experts (alltoall, allgather, deepep); the loss kernel the run's framework version ran;
    # whose fused-attention kernels it ran
    for col in ("moe_dispatcher", "cross_entropy", "attention_library"):
        if rec.get(col):
            out[col] = rec[col].strip().lower()
    for col in ("tp_comm_overlap", "torch_compile", "fp8_param_gather", "fp4_param_gather", "moe_a2a_overlap"):
        if rec.get(col):
            out[col] = _bool(rec[col], col, path, line)
    if rec.get("recompute_modules"):  # what selective recompute re-runs (e.g. layernorm+moe_act)
        out["recompute_modules"] = _plus_list(rec["recompute_modules"])
    grad = (rec.get("grad_sync_dtype") or "").lower()
    if grad in ("bf16", "fp32", "fp16"):
        out["grad_reduce_dtype"] = grad
    return out
