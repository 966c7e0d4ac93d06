"""A dispatch mode that writes down every aten op a traced stage runs, as OpRecords.

It sits above FakeTensorMode, so it sees the ops the module code issues in forward and (because
autograd runs them through the same dispatcher) in backward, collectives included. Dependencies
are found through storages: an op depends on the last op that wrote a storage it reads.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from echo_plan.trace.fp8_kernels import ONCE_PER_STEP as FP8_ONCE_PER_STEP
from echo_plan.trace.mx_kernels import ONCE_PER_STEP as MX_ONCE_PER_STEP
from echo_plan.trace.opinfo import base_name, collective_kind, op_bytes, op_flops, op_kind
from echo_plan.trace.records import (
    CollectiveInfo, CommGroup, CollectiveKind, GroupKind, OpKind, OpRecord, Phase, Stream, TensorMeta,
)

ONCE_PER_STEP = FP8_ONCE_PER_STEP | MX_ONCE_PER_STEP  # weight casts: the step phase, not every micro-batch

def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _written_in_place(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors one of our kernels (namespace echo_plan) writes in place without returning them (its schema marks
    them ``Tensor(a!)``: Transformer Engine's cross entropy stores the gradient over the logits). Written bytes
    and the next reader's dependency then count them; aten's in-place ops return what they write already."""
    if func.namespace != "echo_plan":
        return []
    out = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
            out.append(value)
    return out


class Recorder(TorchDispatchMode):
    """Records ops into ``self.ops``; ``phase`` and ``module`` label what is recorded next."""

    def __init__(self, tp_size: int, groups: dict[str, CommGroup] | None = None) -> None:
        super().__init__()
        self._groups = dict(groups or {})  # c10d group name -> placement; unnamed: the TP group
        self.ops: list[OpRecord] = []
        self.phase = Phase.FORWARD
        self.module = ""
        self._tp_group = CommGroup(GroupKind.TP, size=tp_size, stride=1)
        self._writer: dict[int, int] = {}  # storage -> index of the op that last wrote it
        self._alive: list = []  # keeps storages alive so their keys stay unique

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Label ops run inside this block (checkpointed forward re-run in backward) RECOMPUTE."""
        saved = self.phase
        self.phase = Phase.RECOMPUTE
        try:
            yield
        finally:
            self.phase = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace != "prim":
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))  # out= is written, not read
        outputs = _tensors(out) + _written_in_place(func, args, kwargs)
        kind = op_kind(func)
        index = len(self.ops)
        deps = sorted({self._writer[k] for k in map(_storage_key, inputs) if k in self._writer})
        collective = None
        stream = Stream.COMPUTE
        ckind = collective_kind(func)
        if ckind is not None:
            stream = Stream.TP_COMM
            source = outputs if ckind is CollectiveKind.ALL_GATHER else inputs[:1]
            nbytes = sum(t.numel() * t.element_size() for t in source)
            if ckind is CollectiveKind.REDUCE_SCATTER:  # the input, all ranks' parts (the in-place form's 2nd arg)
                nbytes = max(t.numel() * t.element_size() for t in inputs)
            if ckind is CollectiveKind.ALL_TO_ALL:  # a rank that receives more than it sends waits for that
                nbytes = max(nbytes, sum(t.numel() * t.element_size() for t in outputs))
            name = next((a for a in reversed(args) if isinstance(a, str)), "")
            collective = CollectiveInfo(ckind, nbytes, self._groups.get(name, self._tp_group))
            if collective.group.kind is GroupKind.CP:  # Megatron-Core / TE run the CP ring on a stream of its own
                stream = Stream.CP_COMM
        flops = 0.0 if kind is OpKind.VIEW else op_flops(func, args, kwargs, out)
        read, written = op_bytes(func, kind, inputs, outputs)
        phase = Phase.STEP if func.namespace == "echo_plan" and base_name(func) in ONCE_PER_STEP else self.phase
        self.ops.append(OpRecord(
            index=index, name=str(func), kind=kind, phase=phase, stream=stream,
            inputs=tuple(_meta(t) for t in inputs), outputs=tuple(_meta(t) for t in outputs),
            flops=flops, bytes_read=read, bytes_written=written, deps=tuple(deps),
            collective=collective, module=self.module,
        ))
        for t in outputs:
            key = _storage_key(t)
            if kind is not OpKind.VIEW:
                self._writer[key] = index
            elif func.namespace == "_c10d_functional" and deps and key not in self._writer:
                self._writer[key] = deps[-1]  # wait_tensor hands back the collective's result
            elif func.namespace == "echo_plan" and key not in self._writer:
                self._writer[key] = index  # a buffer several kernels filled: readers wait for all of them
            # Hold the storage (not the tensor, which would stop autograd from stealing gradients)
            self._alive.append(t.untyped_storage())
