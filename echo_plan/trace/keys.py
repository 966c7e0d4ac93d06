"""TraceKey construction: everything that changes a trace, without importing torch.

``code_version`` hashes the source of the modules that define and run the traced code and the
installed torch version (its dispatch decides which aten ops appear), so editing a module or
upgrading torch invalidates cached traces.
"""

from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

from echo_plan.errors import SpecError
from echo_plan.specs import DType, ModelSpec, Recompute
from echo_plan.specs.moe import DENSE, ExpertLayout, LayerKind
from echo_plan.trace.records import StageKind, TraceKey
from echo_plan.specs.plan_checks import validate_cp

# The modules whose source decides what a trace contains.
TRACED_MODULES = (
    "block.py", "attention.py", "kernels.py", "overlap.py", "layers.py", "parallel.py", "stages.py", "fake_pg.py",
    "capture.py", "recorder.py", "opinfo.py", "modtrack.py", "records.py", "moe.py", "mla.py", "moe_kernels.py",
    "fp8.py", "fp8_kernels.py", "quant_state.py", "mx_kernels.py", "fused_elementwise.py",
    "context_parallel.py", "linears.py", "loss_kernels.py",
)
TRACE_DTYPES = (DType.BF16, DType.FP16, DType.FP8, DType.FP4)


def code_version() -> str:
    """A short hash of the traced modules' source and the torch version."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in TRACED_MODULES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    try:
        h.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        h.update(b"torch-unknown")
    return h.hexdigest()[:16]


def structure(model: ModelSpec, stage: StageKind) -> str:
    """Canonical text of the model fields that change this stage's trace."""
    fields = [
        f"hidden={model.hidden_size}", f"heads={model.num_attention_heads}", f"kv_heads={model.kv_heads}",
        f"ffn={model.ffn_size}", f"activation={model.activation.value}", f"norm={model.norm.value}",
        f"position={model.position_embedding.value}", f"seq={model.seq_length}",
        f"bias={model.has_bias}", f"rotary_dims={model.rotary_dims}",
    ]
    if model.rope_attention_factor != 1.0:
        fields.append(f"rope_factor={model.rope_attention_factor}")
    if model.attention_head_dim is not None or model.qk_norm:
        fields += [f"head_dim={model.head_dim}", f"qk_norm={model.qk_norm}"]
    if model.mla is not None:
        fields.append("mla=" + model.mla.model_dump_json())
    if model.moe is not None and stage is StageKind.BLOCK:
        fields.append("moe=" + model.moe.model_dump_json())
    if stage is not StageKind.BLOCK:
        fields += [f"vocab={model.vocab_size}", f"tied={model.tied_embeddings}"]
    return ";".join(fields)


def check_tp(model: ModelSpec, tp: int, sequence_parallel: bool) -> None:
    """Raise SpecError unless ``tp`` can shard ``model`` (heads, kv heads, FFN, and seq with SP)."""
    if tp < 1:
        raise SpecError("tp", tp, "must be a positive integer")
    valid = [t for t in range(1, model.num_attention_heads + 1)
             if model.num_attention_heads % t == 0 and model.kv_heads % t == 0 and model.ffn_size % t == 0]
    for value, what in ((model.num_attention_heads, "num_attention_heads"), (model.kv_heads, "num_kv_heads"),
                        (model.ffn_size, "ffn_hidden_size")):
        if value % tp:
            raise SpecError("tp", tp, f"must divide {what} {value} of {model.name}; valid: "
                            f"{', '.join(map(str, valid))}")
    if sequence_parallel and model.seq_length % tp:
        raise SpecError("sequence_parallel", True,
                        f"needs seq_length {model.seq_length} divisible by tp {tp}")


def check_cp(model: ModelSpec, cp: int, tp: int, sequence_parallel: bool) -> None:
    """Raise SpecError unless ``cp`` can split ``model``'s sequence (with ``tp``'s sharding)."""
    if cp < 1:
        raise SpecError("cp", cp, "must be a positive integer")
    if cp == 1:
        return

    validate_cp(cp, tp, sequence_parallel, model)
    check_tp(model, tp, False)


def make_key(model: ModelSpec, stage: StageKind, *, tp: int, sequence_parallel: bool,
             micro_batch_size: int, dtype: DType, recompute: Recompute, version: str | None = None,
             software: str = "", kind: LayerKind = DENSE, layout: ExpertLayout | None = None,
             cp: int = 1) -> TraceKey:
    """The cache key of a trace; validates the arguments first. ``cp`` > 1: the rank holds seq / cp
    tokens (two of 2 x cp chunks); its traces are told apart by ``variant`` (cp 1 keys are unchanged)."""
    check_cp(model, cp, tp, sequence_parallel)
    if cp == 1:
        check_tp(model, tp, sequence_parallel)
    variant = ""
    if stage is StageKind.BLOCK and kind != DENSE:
        variant = kind.label()
        if kind.moe:
            layout = layout or ExpertLayout(etp=tp)
            check_layout(model, layout)
            variant += ";" + layout.label()
    if cp > 1:
        variant += f";cp{cp}"
    if micro_batch_size < 1:
        raise SpecError("micro_batch_size", micro_batch_size, "must be a positive integer")
    dtype = DType(dtype)
    if dtype not in TRACE_DTYPES:
        raise SpecError("dtype", dtype.value, "traces use bf16 or fp16 activations and weights (fp8, fp4: bf16 with "
                        "FP8 or NVFP4 GEMMs)")
    sp = bool(sequence_parallel and tp > 1)  # Megatron-LM ignores sequence parallelism at tp 1
    if stage is not StageKind.BLOCK:  # Megatron-LM recomputes transformer layers only
        recompute = Recompute.NONE
    return TraceKey(
        stage=StageKind(stage), structure=structure(model, stage), tp=tp, sequence_parallel=sp,
        micro_batch_size=micro_batch_size, seq_length=model.seq_length, dtype=dtype.value,
        recompute=Recompute(recompute).value, code_version=version or code_version(), software=software,
        variant=variant,
    )


def check_layout(model: ModelSpec, layout: ExpertLayout) -> None:
    """Raise SpecError unless ``layout`` can shard ``model``'s experts."""
    moe = model.moe
    if moe is None:
        raise SpecError("ep", layout.ep, f"expert parallelism needs a mixture-of-experts model; {model.name} is dense")
    if layout.ep < 1 or moe.num_experts % layout.ep:
        raise SpecError("ep", layout.ep, f"must divide num_experts {moe.num_experts} of {model.name}")
    if layout.etp < 1 or moe.expert_ffn_hidden_size % layout.etp or (moe.shared_ffn and moe.shared_ffn % layout.etp):
        raise SpecError("etp", layout.etp, f"must divide expert_ffn_hidden_size {moe.expert_ffn_hidden_size} of "
                        f"{model.name}")
    if not 1.0 <= layout.imbalance <= 1024.0:
        raise SpecError("expert_imbalance", layout.imbalance, "between 1 (balanced) and 1024")
