"""One transformer layer traced through Megatron-Core's own code (``echo-plan trace --source megatron-core``).

The layer is Megatron-Core's ``TransformerLayer`` from its local (non-Transformer-Engine) GPT spec, built
and run forward and backward on tensor-parallel rank 0 under PyTorch's fake process group and fake tensors
(nothing is computed, shapes are real; an MoE layer runs for real, its all-gather dispatcher picking tokens by
value, which fake tensors cannot size, so only small MoE shapes: ``REAL_RUN_LIMIT_FLOP``), with echo-plan's recorder writing down every op and collective in
the trace format the cost models read. It runs in a process of its own, so that Megatron-Core's global
state and the CPU stand-ins never meet the rest of the program; the trace is cached like the built-in
tracer's (its key names Megatron-Core's version), so a search never runs it twice.

Megatron-Core 0.16 assumes CUDA in a few calls; each is answered on the CPU with what the call does on a
GPU (``STAND_INS``; docs/conformance.md). What cannot be traced this way is refused in one line (``why_not``):
sequence parallelism (the local spec's torch norm refuses it), multi-head latent attention (0.16's local
spec passes ``k_channels`` to a core attention that does not take it), expert parallelism above 1 and the
all-to-all dispatcher (a CUDA stream in its constructor), sliding windows, and FP8 (Transformer Engine's).
Full recompute is Megatron-Core's ``TransformerBlock``'s: the layer runs inside a one-layer block.

Megatron-Core is an optional extra (``pip install -e '.[frameworks]'``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from importlib import metadata
from typing import Any

from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.specs import Activation, DType, ModelSpec, Norm, PositionEmbedding, Recompute, SoftwareSpec
from echo_plan.specs.moe import DENSE, LayerKind
from echo_plan.trace.cache import TraceCache
from echo_plan.trace.keys import code_version, make_key
from echo_plan.trace.records import LayerTrace, OpKind, Phase, StageKind, TraceKey
from echo_plan.trace.serialize import key_to_dict, trace_from_dict, trace_to_dict

STAND_INS = (
    "torch.cuda.current_device -> the CPU (GlobalMemoryBuffer.get_tensor)",
    "fused_softmax.get_default_causal_mask -> the same mask on the CPU",
    "tensor_parallel.get_cuda_rng_tracker -> a tracker whose fork() changes nothing (no dropout here)",
    "random._get_cuda_rng_state -> the CPU's, random._set_cuda_rng_state -> nothing (recompute's checkpoint)",
    "random.FP8GlobalStateManager -> FP8 off (CheckpointWithoutOutput tests `fp8 is not None`, true for False)",
    "moe_utils.te_general_gemm -> None (0.16's router names it only when Transformer Engine imports)",
)
TIMEOUT_S = 600
# MoE layers run for real on the CPU (the all-gather dispatcher picks tokens by value, masked_select, whose
# output size fake tensors cannot know): only layers up to this many FLOPs (forward and backward), seconds of
# CPU work; JUDGEMENT, a bound on the wait, not on the result.
REAL_RUN_LIMIT_FLOP = 2e11
ACTIVATIONS = {Activation.SWIGLU: (True, "silu"), Activation.GELU: (False, "gelu")}


def megatron_core_version() -> str | None:
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def why_not(model: ModelSpec, kind: LayerKind, *, sequence_parallel: bool, recompute: Recompute, dtype: DType,
            ep: int) -> str | None:
    """Why this layer cannot be traced through Megatron-Core on the CPU (one line), or None."""
    if megatron_core_version() is None:
        return "megatron-core is not installed (pip install -e '.[frameworks]')"
    if model.mla is not None:
        return ("multi-head latent attention: Megatron-Core 0.16's local spec passes k_channels to a core "
                "attention that does not take it (docs/conformance.md)")
    if sequence_parallel:
        return "sequence parallelism: the local spec's torch norm refuses it (Apex's needs CUDA)"
    if kind.window:
        return "sliding-window layers: the local spec's core attention has no window"
    if DType(dtype) is not DType.BF16:
        return f"{DType(dtype).value}: FP8 and fp16 run through Transformer Engine here, which needs CUDA; use bf16"
    if model.activation not in ACTIVATIONS:
        return f"activation {model.activation.value}: the probe builds SwiGLU and GeLU layers"
    if model.qk_norm:
        return "QK norm: not in the local spec's attention"
    if kind.moe and ep > 1:
        return "expert parallelism above 1: the dispatchers size their buffers from the other ranks' counts"
    if kind.moe and _moe_layer_flops(model) > REAL_RUN_LIMIT_FLOP:
        return (f"an MoE layer runs for real on the CPU (its dispatcher picks tokens by value, which fake tensors "
                f"cannot size): this one needs ~{_moe_layer_flops(model):.1e} FLOPs, above the "
                f"{REAL_RUN_LIMIT_FLOP:.0e} this waits for; try a shorter --seq-length or a smaller model")
    return None


def _moe_layer_flops(model: ModelSpec, mbs: int = 1) -> float:
    """About what one MoE layer's forward and backward compute: 6 x tokens x (attention projections + the
    routed and shared experts' weights a token meets) + the attention scores."""
    moe, h, tokens = model.moe, model.hidden_size, model.seq_length * mbs
    assert moe is not None
    per_expert = (3 if model.activation.gated else 2) * h * moe.expert_ffn_hidden_size
    weights = 4 * h * h + (moe.top_k + moe.num_shared_experts) * per_expert
    return 6.0 * tokens * weights + 12.0 * tokens * model.seq_length * h


def _request(model: ModelSpec, kind: LayerKind, tp: int, mbs: int, recompute: Recompute,
             modules: tuple[str, ...]) -> dict[str, Any]:
    gated, act = ACTIVATIONS[model.activation]
    req = {"hidden": model.hidden_size, "heads": model.num_attention_heads, "kv_heads": model.kv_heads,
           "ffn": model.ffn_size, "seq": model.seq_length, "mbs": mbs, "gated": gated, "activation": act,
           "norm": "RMSNorm" if model.norm is Norm.RMSNORM else "LayerNorm", "bias": model.has_bias,
           "rotary": model.position_embedding is PositionEmbedding.ROTARY, "tp": tp,
           "recompute": recompute.value, "recompute_modules": list(modules)}
    if kind.moe and model.moe is not None:
        req.update(experts=model.moe.num_experts, topk=model.moe.top_k, moe_ffn=model.moe.expert_ffn_hidden_size,
                   shared_ffn=model.moe.shared_ffn if model.moe.num_shared_experts else None, real=True)
    return req


def trace_with_megatron_core(model: ModelSpec, *, tp: int, micro_batch_size: int, recompute: Recompute,
                             stack: SoftwareSpec, kind: LayerKind = DENSE, cache: TraceCache | None = None,
                             sequence_parallel: bool = False, dtype: DType = DType.BF16, ep: int = 1) -> LayerTrace:
    """The layer of ``kind`` traced through Megatron-Core (from ``cache`` when it holds it); ``stack`` gives the
    recompute modules of ``--recompute selective``. Raises SpecError naming what cannot be traced."""
    reason = why_not(model, kind, sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype, ep=ep)
    if reason is not None:
        raise SpecError("--source", "megatron-core", reason)
    modules = tuple(m.value for m in stack.recompute_modules) if recompute is Recompute.SELECTIVE else ()
    key = make_key(model, StageKind.BLOCK, tp=tp, sequence_parallel=False, micro_batch_size=micro_batch_size,
                   dtype=DType.BF16, recompute=recompute, version=code_version(), kind=kind,
                   software=f"megatron-core={megatron_core_version()};local-spec;rc={','.join(modules) or '-'}")
    if cache is not None:
        hit = cache.get(key)
        if hit is not None:
            return hit
    req = _request(model, kind, tp, micro_batch_size, recompute, modules)
    try:
        proc = subprocess.run([sys.executable, "-m", "echo_plan.interop.megatron_core_layer", json.dumps(req)],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EchoPlanError(f"--source megatron-core: the layer did not finish in {TIMEOUT_S} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise EchoPlanError(f"--source megatron-core: Megatron-Core's layer failed: {last}")
    got = json.loads(lines[-1])
    trace = trace_from_dict({**got, "key": key_to_dict(key)})
    if cache is not None:
        cache.put(trace)
    return trace


def conformance_stack(stack: SoftwareSpec) -> SoftwareSpec:
    """``stack`` with the kernels Megatron-Core's local spec runs on the CPU, for the built-in trace it is
    compared with: unfused attention (its own core attention), no dropout, no TP overlap (userbuffers are
    Transformer Engine's), the all-gather MoE dispatcher with one GEMM per expert and unfused permutation."""
    return stack.replace(attention="unfused", attention_library="cudnn", hidden_dropout=0.0, attention_dropout=0.0,
                         tp_comm_overlap=False, moe_dispatcher="allgather", moe_grouped_gemm=False,
                         moe_permute_fusion=False)


def _gemms(trace: LayerTrace) -> tuple[int, float]:
    gemms = [op for op in trace.ops if op.kind is OpKind.GEMM]
    return len(gemms), sum(op.flops for op in gemms)


def compare_traces(theirs: LayerTrace, ours: LayerTrace) -> list[dict[str, Any]]:
    """Megatron-Core's trace beside the built-in one, figure by figure: what is compared, both values, and
    whether they agree (exactly, or the relative difference)."""
    def row(what: str, a: Any, b: Any, exact: bool = True) -> dict[str, Any]:
        if exact:
            same = a == b
            diff = None
        else:
            diff = (b - a) / a if a else None
            same = diff == 0
        return {"figure": what, "megatron_core": a, "echo_plan": b, "equal": same, "relative_difference": diff}

    (n_a, f_a), (n_b, f_b) = _gemms(theirs), _gemms(ours)
    colls = [sorted((op.phase.value, op.collective.kind.value, op.collective.nbytes) for op in t.collectives)
             for t in (theirs, ours)]
    rows = [row("GEMMs", n_a, n_b), row("GEMM FLOPs", f_a, f_b), row("parameters on this rank", theirs.param_count,
                                                                    ours.param_count),
            row("collectives (phase, kind, bytes)", colls[0], colls[1]),
            row("all FLOPs", theirs.total_flops, ours.total_flops, exact=False),
            row("bytes read", sum(op.bytes_read for op in theirs.ops), sum(op.bytes_read for op in ours.ops), False),
            row("saved for backward", theirs.saved_bytes, ours.saved_bytes, exact=False)]
    for mode in sorted(set(theirs.saved_bytes_by_mode) & set(ours.saved_bytes_by_mode) - {theirs.key.recompute}):
        rows.append(row(f"saved for backward, recompute {mode}", theirs.saved_bytes_by_mode[mode],
                        ours.saved_bytes_by_mode[mode], exact=False))
    return rows


# -- the child process ------------------------------------------------------------------------------

def _stand_ins(torch: Any) -> None:
    """Megatron-Core's CUDA-only calls answered on the CPU (``STAND_INS``)."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.dot_product_attention as dot_product_attention
    import megatron.core.transformer.moe.moe_utils as moe_utils

    class NoTracker:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    class NoFp8:
        is_fp8_enabled = staticmethod(lambda: False)
        get_fp8_recipe = staticmethod(lambda: None)

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker = lambda *a, **k: NoTracker()
    dot_product_attention.tensor_parallel.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *a, **k: None
    tp_random.FP8GlobalStateManager = NoFp8
    for name in ("activation_recompute_forward", "fp8_autocast"):
        if not hasattr(tp_random, name):
            setattr(tp_random, name, lambda **k: contextlib.nullcontext())
    moe_utils.te_general_gemm = None


def build_layer(req: dict[str, Any], modules: list[str] | None = None, full: bool = False):  # noqa: ANN201
    """Megatron-Core's layer for ``req`` (the process group and parallel state already set up); ``full``: the
    layer inside a one-layer ``TransformerBlock`` that recomputes it whole (where Megatron-Core's full
    recompute lives), without the block's final norm."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    modules = req.get("recompute_modules") if modules is None else modules
    experts = int(req.get("experts", 0))
    moe = dict(num_moe_experts=experts, moe_router_topk=int(req["topk"]), moe_ffn_hidden_size=req["moe_ffn"],
               moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=req.get("shared_ffn")) if experts else {}
    recompute = dict(recompute_granularity="selective", recompute_modules=list(modules)) if modules else {}
    if full:
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = TransformerConfig(
        num_layers=1, hidden_size=req["hidden"], num_attention_heads=req["heads"], num_query_groups=req["kv_heads"],
        ffn_hidden_size=req["ffn"], bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        perform_initialization=bool(req.get("real")), add_bias_linear=bool(req["bias"]), gated_linear_unit=bool(req["gated"]),
        activation_func=F.silu if req["activation"] == "silu" else F.gelu, normalization=req["norm"],
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, tensor_model_parallel_size=int(req["tp"]),
        gradient_accumulation_fusion=False, **moe, **recompute)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False, normalization=req["norm"])
    if full:
        from megatron.core.transformer.transformer_block import TransformerBlock  # beside the imports above

        return TransformerBlock(config, spec, post_layer_norm=False)
    return build_module(spec, config=config, layer_number=1)


def _run(req: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from echo_plan.trace.capture import SavedBytesMeter  # torch: in the child process only
    from echo_plan.trace.recorder import Recorder  # torch: in the child process only

    torch.cuda.current_device = lambda: torch.device("cpu")
    tp = int(req["tp"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    from megatron.core import parallel_state
    import megatron.core.tensor_parallel.random as tp_random

    _stand_ins(torch)
    parallel_state.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    recorder = Recorder(tp)
    fork = tp_random._fork_rng

    @contextlib.contextmanager
    def recomputing():  # Megatron-Core re-runs a checkpointed region inside _fork_rng: label it RECOMPUTE
        with fork(), recorder.recomputing():
            yield

    tp_random._fork_rng = recomputing
    saved: dict[str, int] = {}
    real = bool(req.get("real"))
    with contextlib.nullcontext() if real else FakeTensorMode():
        target = req["recompute"]  # none, selective or full: the mode recorded; "none" is measured beside it
        for mode in dict.fromkeys(("none", target)):
            layer = build_layer(req, req["recompute_modules"] if mode == "selective" else [], full=mode == "full")
            fixed = {t.untyped_storage()._cdata for t in list(layer.parameters()) + list(layer.buffers())}
            meter = SavedBytesMeter(fixed)
            shape = (req["seq"], req["mbs"], req["hidden"])
            x = (torch.randn(shape, dtype=torch.bfloat16) if real else torch.empty(shape, dtype=torch.bfloat16))
            x.requires_grad_(True)
            if mode != target:  # the other mode's saved bytes: forward only, unrecorded
                with meter.measuring():
                    layer(x, attention_mask=None)
                saved[mode] = meter.total
                continue
            recorder.phase = Phase.FORWARD
            with meter.measuring(), recorder:
                out = layer(x, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out  # a layer returns (hidden, context), a block hidden
            saved[mode] = meter.total
            recorder.phase = Phase.BACKWARD
            with recorder:
                out.backward(torch.ones_like(out) if real else torch.empty_like(out))
            params = sum(p.numel() for p in layer.parameters())
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    trace = LayerTrace(key=_placeholder_key(), ops=tuple(recorder.ops), saved_bytes=saved[target],
                       saved_bytes_by_mode=saved, param_count=params)
    return trace_to_dict(trace)


def _placeholder_key() -> TraceKey:
    """A key the parent replaces with the real one (it knows the model and the versions)."""
    return TraceKey(StageKind.BLOCK, "", 1, False, 1, 1, "bf16", "none", "")


if __name__ == "__main__":
    print(json.dumps(_run(json.loads(sys.argv[1]))))
