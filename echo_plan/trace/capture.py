"""Build one stage's modules under FakeTensorMode and run a micro-batch forward and backward.

This is the torch-heavy half of the tracer (``tracer.py`` stays light so a cache hit never
imports torch). Activation memory is measured, not computed: every tensor autograd saves for
backward passes a saved-tensors hook, and the distinct storages it keeps alive are summed
(parameters and buffers excluded). A checkpointed region saves only its inputs, so the same
measurement under each recompute mode gives that mode's saved bytes.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from echo_plan.specs import DType, ModelSpec, Recompute, SoftwareSpec
from echo_plan.specs.software import GradientBuffers
from echo_plan.trace.parallel import CAST_COPY
from echo_plan.trace.block import TransformerBlock
from echo_plan.specs.moe import DENSE, ExpertLayout, LayerKind
from echo_plan.trace.fake_pg import TraceGroups, fake_groups
from echo_plan.trace.modtrack import ModuleLabeler
from echo_plan.trace.recorder import Recorder
from echo_plan.trace.records import OpRecord, Phase, StageKind
from echo_plan.trace.stages import EmbeddingStage, OutputStage
from echo_plan.trace.quant_state import Fp8State

TORCH_DTYPES = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}
_DTYPE_OF = {v: k for k, v in TORCH_DTYPES.items()}
# fp8 training keeps bf16 weights, activations and gradients; the linears' GEMMs run in FP8 (trace/fp8.py)
TORCH_DTYPES_FOR = {**TORCH_DTYPES, DType.FP8: torch.bfloat16, DType.FP4: torch.bfloat16}


@dataclass(frozen=True)
class Captured:
    ops: tuple[OpRecord, ...]
    saved_bytes_by_mode: dict[str, int]
    param_count: int


class SavedBytesMeter:
    """Sums the distinct storages autograd saves for backward, leaving out ``exclude``."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.exclude:
            self.storages[key] = storage.nbytes()
        return t

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is already counted as saved."""
        return t.untyped_storage()._cdata in self.storages

    def keep(self, t: torch.Tensor) -> None:
        """``t`` is kept for backward outside autograd's saved tensors (a selective checkpoint's cache)."""
        key = t.untyped_storage()._cdata
        if key not in self.exclude:
            self.storages[key] = t.untyped_storage().nbytes()

    def discard(self, t: torch.Tensor) -> None:
        """``t`` is freed after use and recomputed in backward: it no longer counts as saved."""
        key = t.untyped_storage()._cdata
        self.storages.pop(key, None)
        self.exclude.add(key)

    @contextmanager
    def measuring(self) -> Iterator["SavedBytesMeter"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _build(stage: StageKind, model: ModelSpec, groups: TraceGroups, sp: bool, dtype: torch.dtype,
           recompute: Recompute, stack: SoftwareSpec, recompute_context: Callable,
           meter: SavedBytesMeter, kind: LayerKind = DENSE, layout: ExpertLayout | None = None,
           fp8: DType | None = None) -> nn.Module:
    group = groups.tp
    if stage is StageKind.BLOCK:  # Megatron-Core keeps the embedding and output layer in bf16 under FP8
        state = None
        if fp8 is DType.FP8:
            state = Fp8State(stack.fp8_recipe, stack.fp8_param_gather, stack.fp8_save_original_input, meter,
                             transposes=stack.fp8_transposes is not False, kernels=stack.fp8_kernels,
                             attention_output_e5m6=stack.fp8_attention_output_e5m6)
        elif fp8 is DType.FP4:  # NVFP4: no FP8 recipe
            state = Fp8State(None, stack.fp4_param_gather, stack.fp8_save_original_input, meter)
        module: nn.Module = TransformerBlock(model, group, sp, dtype, recompute, stack, recompute_context, meter.discard,
                                             kind=kind, groups=groups, layout=layout, fp8=state, keep=meter.keep)
    elif stage is StageKind.EMBEDDING:
        module = EmbeddingStage(model, group, sp, dtype, stack)
    else:
        module = OutputStage(model, group, sp, dtype, stack)
    if not stack.gradient_accumulation_fusion:  # the main-grad buffers the DDP hook accumulates into
        grad_dtype = torch.float32 if stack.grad_bytes(_DTYPE_OF[dtype]) == 4 else dtype
        cast = stack.gradient_buffers is GradientBuffers.DEEPSPEED_BF16
        for p in module.parameters():
            if p.dim() == 2:
                p.main_grad = torch.empty(p.shape, dtype=grad_dtype)
                if cast:
                    setattr(p.main_grad, CAST_COPY, True)
    return module


def _inputs(stage: StageKind, model: ModelSpec, tp: int, sp: bool, mbs: int, dtype: torch.dtype,
            cp: int = 1) -> tuple:
    local = model.seq_length // cp  # a CP rank's two chunks
    seq = local // tp if sp else local
    if stage is StageKind.BLOCK:
        return (torch.empty(seq, mbs, model.hidden_size, dtype=dtype, requires_grad=True),)
    ids = torch.empty(mbs, local, dtype=torch.long)
    if stage is StageKind.EMBEDDING:
        return (ids,)
    return (torch.empty(seq, mbs, model.hidden_size, dtype=dtype, requires_grad=True), ids)


def _fixed_storages(module: nn.Module) -> set[int]:
    tensors = list(module.parameters()) + list(module.buffers())
    tensors += [p.main_grad for p in module.parameters() if hasattr(p, "main_grad")]
    return {t.untyped_storage()._cdata for t in tensors}


def _param_count(module: nn.Module) -> int:
    if isinstance(module, OutputStage):
        return module.owned_parameters()
    return sum(p.numel() for p in module.parameters())


def _dtensor_layout(groups: TraceGroups, stack: SoftwareSpec, micro_batch_size: int) -> TraceGroups:
    """The groups with the TP group marked as rearranging (``parallel.py``) where DTensor's batch-first layout
    copies around its collectives: the stack's TP is DTensor's and a micro-batch holds more than one sequence (with
    one, the gathered shards are already in sequence order: a view). Under async TP the same mark gives the fused
    matmul-reduce-scatter's input copy; its all-gathers are ring exchanges, which copy nothing."""
    if groups.tp is None or not stack.copies_tp_layout(micro_batch_size):
        return groups
    return replace(groups, tp=replace(groups.tp, rearranges=True))


def capture(model: ModelSpec, stage: StageKind, *, tp: int, sequence_parallel: bool,
            micro_batch_size: int, dtype: DType, recompute: Recompute, stack: SoftwareSpec,
            kind: LayerKind = DENSE, layout: ExpertLayout | None = None,
            known_saved: dict[str, int] | None = None, cp: int = 1) -> Captured:
    """Trace one stage on TP rank 0 (a layer of ``kind``; MoE layers with ``layout``) and CP rank 0
    of ``cp`` (its seq / cp tokens): forward then backward of one micro-batch."""
    layout = layout if (kind.moe and layout is not None) else ExpertLayout(etp=1)
    tdtype = TORCH_DTYPES_FOR[dtype]
    fp8 = DType(dtype) if DType(dtype).low_precision else None  # the GEMMs' precision (FP8 or NVFP4)
    modes = list(Recompute) if stage is StageKind.BLOCK else [recompute]
    saved: dict[str, int] = {}  # the other modes' saved bytes, when a trace of this stage under them is known
    other_known = {k: v for k, v in (known_saved or {}).items() if k != recompute.value}
    with FakeTensorMode(), fake_groups(tp, layout.ep, layout.etp, cp) as groups:
        groups = _dtensor_layout(groups, stack, micro_batch_size)
        recorder = Recorder(tp, groups.comm)
        meter = SavedBytesMeter(set())
        module = _build(stage, model, groups, sequence_parallel, tdtype, recompute, stack, recorder.recomputing,
                        meter, kind, layout, fp8)
        inputs = _inputs(stage, model, tp, sequence_parallel, micro_batch_size, tdtype, cp)
        meter.exclude |= _fixed_storages(module)
        ModuleLabeler(module, recorder)  # hooks live as long as the module
        with meter.measuring(), recorder:
            out = module(*inputs)
        saved[recompute.value] = meter.total
        recorder.phase = Phase.BACKWARD
        with recorder:
            if out.dim() == 0:
                out.backward()
            else:
                out.backward(torch.empty_like(out))
        param_count = _param_count(module)
        ops = tuple(recorder.ops)
        saved.update(other_known)
        for mode in modes:  # saved bytes under the other recompute modes: forward only, unrecorded
            if mode.value in saved:
                continue
            other_meter = SavedBytesMeter(set())
            other = _build(stage, model, groups, sequence_parallel, tdtype, mode, stack, nullcontext,
                           other_meter, kind, layout, fp8)
            other_meter.exclude |= _fixed_storages(other)
            other_inputs = _inputs(stage, model, tp, sequence_parallel, micro_batch_size, tdtype, cp)
            with other_meter.measuring():
                other(*other_inputs)
            saved[mode.value] = other_meter.total
    if stage is not StageKind.BLOCK:  # recompute modes apply to transformer layers only
        saved = {mode.value: saved[recompute.value] for mode in Recompute}
    return Captured(ops=ops, saved_bytes_by_mode=saved, param_count=param_count)
