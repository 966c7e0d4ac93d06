"""Rebuilding a runnable call of a traced op from its record.

A trace records an op's name and its tensor inputs and outputs (shape, dtype), not its other
arguments. To run the op for real, the arguments are rebuilt from the op's schema: tensor slots
take the recorded inputs in order, and the non-tensor arguments are inferred from the shapes
(a reduction's dims from the input and output shapes, a factory's size from the output, a cast's
dtype from the output's) or set to values that do not change the work (scalars, eps). The caller
checks the rebuilt call's outputs against the recorded ones and skips the op when they differ.

Fused attention is timed through ``torch.nn.functional.scaled_dot_product_attention`` (forward,
and autograd for the backward) so that the device's own fused kernel runs: a trace made on CPU
records the CPU variant's name, which a CUDA device does not implement.
"""

from __future__ import annotations

from typing import Any, Callable

from echo_plan.trace.records import OpKind, OpRecord, TensorMeta
import echo_plan.trace as pkg


class CannotRun(Exception):
    """The op cannot be rebuilt into a call on this device; the message says why."""


def resolve_op(name: str) -> Any:
    """``aten.mm.default`` -> ``torch.ops.aten.mm.default``; an op of echo-plan's own namespaces is found
    once the trace modules that register them are imported (``_import_trace_modules``)."""
    import torch

    parts = name.split(".")
    if len(parts) != 3:
        raise CannotRun(f"op name {name!r} is not namespace.op.overload")
    ns, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except (AttributeError, RuntimeError):
        _import_trace_modules()
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (AttributeError, RuntimeError):
            raise CannotRun(f"no operator {name} in this torch build") from None


def _import_trace_modules() -> None:
    import importlib
    import pkgutil

    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"echo_plan.trace.{info.name}")
        except Exception:  # a module that fails to import registers nothing; the op is then skipped
            continue


def torch_dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CannotRun(f"unknown dtype {name!r}")
    return dt


def make_tensor(meta: TensorMeta, device: str) -> Any:
    """A real tensor of the recorded shape: small random floats, zero indices and masks."""
    import torch

    dt = torch_dtype(meta.dtype)
    if dt.is_floating_point:
        return (torch.randn(meta.shape, dtype=torch.float32, device=device) * 0.1).to(dt)
    return torch.zeros(meta.shape, dtype=dt, device=device)


def build_call(op: OpRecord, device: str) -> Callable[[], Any]:
    """A zero-argument function that runs ``op`` once on ``device`` with fresh tensors."""
    if op.kind is OpKind.ATTENTION:
        return _attention_call(op, device)
    name = op.name
    if name.startswith("echo_plan."):
        # The tracer's fused kernels have CPU reference implementations only: timing those would
        # time several unfused kernels. The analytical model costs them.
        raise CannotRun(f"{name}: a fused kernel with no device implementation here")
    if name.startswith("aten.") and name.endswith(".out"):
        name = name[: -len("out")] + "default"  # the same kernel writing into a given buffer
    fn = resolve_op(name)
    args, kwargs = _schema_args(fn, op, device)
    if name in _LOOKUPS and len(args) > 1:
        # an embedding's token ids spread over its rows, as a batch's are: all-zero ids make every
        # token update one row (seen on an H100: the backward ran 1.2-1.4x slower than with spread ids)
        args[1] = _spread_ids(args[1], op.outputs[0].shape[0] if name.endswith("backward.default") else args[0].shape[0])
    if name in _COLUMN_MAJOR_B and len(args) > 1:
        # cuBLASLt's FP8 GEMMs take B column-major (the TN layout Transformer Engine runs); the trace
        # records shapes, not strides, so B is laid out the way the kernel needs it
        args[1] = args[1].transpose(-2, -1).contiguous().transpose(-2, -1)
    return lambda: fn(*args, **kwargs)


_COLUMN_MAJOR_B = frozenset({"aten._scaled_mm.default", "aten._scaled_grouped_mm.default"})
_LOOKUPS = frozenset({"aten.embedding.default", "aten.embedding_dense_backward.default"})


def _spread_ids(ids: Any, rows: int) -> Any:
    """Token ids of ``ids``' shape and dtype drawn from ``rows`` rows (seeded: the same ids each run)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.randint(0, max(1, rows), tuple(ids.shape), generator=gen, dtype=ids.dtype).to(ids.device)


def outputs_match(result: Any, op: OpRecord) -> bool:
    """Whether a call's tensor outputs have the recorded shapes and dtypes, in order."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(result)
    got = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in leaves if isinstance(t, torch.Tensor)]
    want = [(tuple(t.shape), t.dtype) for t in op.outputs]
    if op.kind is OpKind.ATTENTION:  # the public SDPA call returns the main outputs, not the kernel's extras
        n = min(len(got), len(want))
        return n > 0 and got[:n] == want[:n]
    return got == want


# -- schema-driven arguments --------------------------------------------------------------------

def _schema_args(fn: Any, op: OpRecord, device: str) -> tuple[list[Any], dict[str, Any]]:
    schema = fn._schema
    metas = list(op.inputs)
    tensors = [make_tensor(m, device) for m in metas]
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pos = 0
    arguments = list(schema.arguments)
    for i, arg in enumerate(arguments):
        type_s = str(arg.type)
        if type_s in ("Tensor", "Tensor?", "Optional[Tensor]"):
            if pos < len(tensors):
                value: Any = tensors[pos]
                pos += 1
            elif type_s == "Tensor" and pos > 0:
                value = 1  # the traced call passed a Python number here (torch wrapped it)
            elif type_s == "Tensor":
                raise CannotRun(f"{op.name}: fewer recorded inputs than tensor arguments")
            else:
                value = None
        elif "Tensor" in type_s and ("List" in type_s or "[]" in type_s):
            after = sum(1 for a in arguments[i + 1:] if str(a.type) == "Tensor")
            take = max(0, len(tensors) - pos - after)
            value = tensors[pos: pos + take]
            pos += take
        else:
            value = _scalar_arg(arg, type_s, op, metas, device)
            if value is _DEFAULT:
                continue
        if arg.kwarg_only:
            kwargs[arg.name] = value
        else:
            args.append(value)
    if pos < len(tensors):
        raise CannotRun(f"{op.name}: {len(tensors) - pos} recorded inputs have no tensor argument")
    return args, kwargs


_DEFAULT = object()


def _scalar_arg(arg: Any, type_s: str, op: OpRecord, metas: list[TensorMeta], device: str) -> Any:
    name = arg.name
    first = metas[0].shape if metas else ()
    out = op.outputs[0] if op.outputs else None
    if name in ("dim", "keepdim") and out is not None and metas:
        dims, keep = _reduced_dims(first, out.shape)
        if name == "keepdim":
            return keep
        if type_s.startswith(("List", "int[]", "Optional[List")) or "[]" in type_s:
            return dims
        return dims[0] if dims else -1
    if name in ("dtype", "out_dtype") and out is not None:  # out_dtype: the FP8 GEMMs' bf16 output
        return torch_dtype(out.dtype)
    if name == "input_dtype" and metas:
        return torch_dtype(metas[0].dtype)
    if name == "device":
        return device
    if name in ("size", "input_sizes") and out is not None:
        return list(out.shape)
    if name in ("start", "end", "step") and out is not None and metas and op.name.startswith("aten.slice_backward"):
        dim = _reduced_dims(first, out.shape)[0][0]
        return {"start": 0, "end": first[dim], "step": 1}[name]
    if name == "end" and out is not None:
        return out.numel if out.shape else 1
    if name == "k" and out is not None and op.name.startswith("aten.topk"):
        return out.shape[-1]  # top-k along the last dim (the default)
    if name == "num_weights" and out is not None:
        return out.shape[0]
    if name == "padding_idx":
        return -1
    if name == "normalized_shape":
        return _normalized_shape(op, metas)
    if name == "output_mask":
        return [True] * min(3, len(op.outputs)) + [False] * (3 - min(3, len(op.outputs)))
    if name in ("eps",):
        return 1e-5
    if name in ("dropout_p", "p"):
        return 0.0
    if name == "is_causal":
        return True
    if arg.has_default_value():
        return _DEFAULT
    if type_s in ("Scalar", "number", "float", "int", "SymInt"):
        return 1
    if type_s == "bool":
        return False
    raise CannotRun(f"{op.name}: no rule for argument {name}: {type_s}")


def _reduced_dims(inp: tuple[int, ...], out: tuple[int, ...]) -> tuple[list[int], bool]:
    """The dims a reduction (or concatenation) changed, and whether it kept them."""
    if len(out) == len(inp):
        changed = [i for i, (a, b) in enumerate(zip(inp, out)) if a != b]
        return (changed or [len(inp) - 1]), True
    kept, j = [], 0
    for i, d in enumerate(inp):  # align the output's dims greedily with the input's
        if j < len(out) and out[j] == d:
            j += 1
        else:
            kept.append(i)
    if j != len(out):
        raise CannotRun(f"cannot tell which dims of {inp} reduce to {out}")
    return kept, False


def _normalized_shape(op: OpRecord, metas: list[TensorMeta]) -> list[int]:
    if "backward" in op.name and len(metas) >= 3:  # grad_out, input, mean, rstd, weight?, bias?
        if len(metas) >= 5:
            return list(metas[4].shape)
        inp, stat = metas[1].shape, metas[2].shape
        k = 0
        while k < len(inp) and stat[-1 - k] == 1 and inp[-1 - k] != 1:
            k += 1
        return list(inp[len(inp) - max(1, k):])
    if len(metas) >= 2:  # input, weight, bias
        return list(metas[1].shape)
    return [metas[0].shape[-1]]


# -- fused attention ----------------------------------------------------------------------------

def _attention_call(op: OpRecord, device: str) -> Callable[[], Any]:
    import torch
    import torch.nn.functional as F

    from echo_plan.trace.kernels import windowed_attention  # deferred: loads numpy, torch

    if windowed_attention(op):  # SDPA takes no window: it would time the full launch under this op's key
        raise CannotRun(f"{op.name}: sliding-window attention (SDPA has no window argument; the analytical "
                        "model costs it)")

    four = [m for m in op.inputs if len(m.shape) == 4]
    backward = "backward" in op.name
    qkv = four[1:4] if backward else four[:3]
    if len(qkv) < 3:
        raise CannotRun(f"{op.name}: expected query, key and value of rank 4")
    q, k, v = (make_tensor(m, device) for m in qkv)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if "dropout" in op.name:  # the dropout variant of the fused kernel (trace/kernels.py): dropout 0.1
        gqa["dropout_p"] = 0.1
    # ModelSpec models are decoder-only: causal attention, as the analytical model assumes, except the
    # unmasked kernels (``*_noncausal``: a context-parallel rank's queries over an earlier chunk's keys).
    # SDPA's is_causal with fewer queries than keys masks from the top left, which would skip most of
    # that work (seen on an H100: such launches timed 1.8-3.9x faster than the unmasked kernel).
    causal = "noncausal" not in op.name
    if not backward:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
    grad = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
