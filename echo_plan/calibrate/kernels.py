"""Measuring traced ops on a real device and writing a kernel database (``kernels/<GPU>.json``).

For every distinct (op, input and output shapes and dtypes) of the traces, real tensors are made
on the device and the op runs ``warmup`` times, then ``iters`` timed times: CUDA events around
each call on a GPU, ``time.perf_counter`` on the CPU. The median goes into the database with the
count and the 10th/90th percentiles. Ops that cannot be rebuilt or run are reported, not guessed.

Fused attention runs through ``torch.nn.functional.scaled_dot_product_attention`` (``op_args.py``), whose backend
PyTorch picks by its own priority unless ``sdpa_backend`` names one (``SdpaBackend``): ``flash`` is PyTorch's
FlashAttention-2 (what torchtitan, fms-fsdp and OLMo-core ran on Hopper: the ``flash-attn-2`` library of
``compute.yaml``), ``cudnn`` cuDNN's fused attention (Transformer Engine's Hopper default), so that a database says
whose kernels it timed. An attention op the named backend cannot run is skipped with that reason.
"""

from __future__ import annotations

import datetime as _dt
import platform
import socket
import statistics
import subprocess
from contextlib import nullcontext
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable

from echo_plan.calibrate.op_args import CannotRun, build_call, outputs_match
from echo_plan.cost.kernel_db import FORMAT, KernelDatabase, KernelKey, kernel_key
from echo_plan.trace.records import OpKind, OpRecord
from echo_plan import __version__ as echo_version


class NoCudaDevice(Exception):
    """``--device cuda`` on a machine without a CUDA GPU."""


class SdpaBackend(str, Enum):
    """Which of SDPA's backends times the attention ops (``torch.nn.attention.SDPBackend``); ``auto``: PyTorch's
    own priority order, whichever runs first on the device (not recorded by PyTorch, so a database says ``auto``)."""

    AUTO = "auto"
    FLASH = "flash"  # FLASH_ATTENTION: PyTorch's FlashAttention-2
    CUDNN = "cudnn"  # CUDNN_ATTENTION
    EFFICIENT = "efficient"  # EFFICIENT_ATTENTION: the memory-efficient (xformers/CUTLASS) kernels
    MATH = "math"  # MATH: unfused matmuls and softmax (the CPU's, or a reference)

    def context(self):  # noqa: ANN201
        """A context manager that restricts SDPA to this backend (nothing for ``auto``)."""
        if self is SdpaBackend.AUTO:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel  # deferred: loads torch

        name = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                "math": "MATH"}[self.value]
        return sdpa_kernel([getattr(SDPBackend, name)])


@dataclass(frozen=True, slots=True)
class Measurement:
    key: KernelKey
    median_us: float
    p10_us: float
    p90_us: float
    count: int


@dataclass(frozen=True, slots=True)
class Skipped:
    key: KernelKey
    reason: str


@dataclass(frozen=True)
class CalibrationRun:
    measured: tuple[Measurement, ...]
    skipped: tuple[Skipped, ...]
    ops_total: int  # distinct non-view, non-collective ops found in the traces


@dataclass
class _Progress:
    callback: Callable[[int, int, str], None] | None = None
    done: int = field(default=0)


def distinct_ops(ops: Iterable[OpRecord]) -> list[OpRecord]:
    """One op per kernel key, in first-seen order; views and collectives are not kernels to time. A
    sliding-window attention launch shares its key with the full launch of its shapes but is not that
    kernel: each is kept (the windowed one is then skipped, and the full one measured)."""
    from echo_plan.trace.kernels import windowed_attention  # deferred: loads numpy, torch

    seen: dict[tuple[KernelKey, bool], OpRecord] = {}
    for op in ops:
        if op.kind in (OpKind.VIEW, OpKind.COLLECTIVE):
            continue
        seen.setdefault((kernel_key(op), op.kind is OpKind.ATTENTION and windowed_attention(op)), op)
    return list(seen.values())


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise NoCudaDevice("no CUDA GPU is present on this machine (torch.cuda.is_available() is False)")


def time_call(call: Callable[[], Any], device: str, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` timed runs after ``warmup`` untimed ones."""
    import time

    import torch

    for _ in range(warmup):
        call()
    samples: list[float] = []
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1e-3 for s, e in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
    return samples


def _percentile(sorted_xs: list[float], q: float) -> float:
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def measure_ops(ops: Iterable[OpRecord], device: str, *, warmup: int = 5, iters: int = 20,
                progress: Callable[[int, int, str], None] | None = None,
                sdpa_backend: SdpaBackend = SdpaBackend.AUTO) -> CalibrationRun:
    """Time every distinct op of ``ops`` on ``device`` (fused attention on ``sdpa_backend``)."""
    import torch

    check_device(device)
    todo = distinct_ops(ops)
    measured: list[Measurement] = []
    skipped: list[Skipped] = []
    for i, op in enumerate(todo):
        if progress is not None:
            progress(i, len(todo), op.name)
        key = kernel_key(op)
        attention = op.kind is OpKind.ATTENTION
        try:
            with torch.no_grad() if not attention else sdpa_backend.context():
                call = build_call(op, device)
                first = call()
                if not outputs_match(first, op):
                    raise CannotRun("rebuilt arguments give other output shapes than the trace")
                samples = sorted(time_call(call, device, warmup, iters))
        except CannotRun as exc:
            skipped.append(Skipped(key, str(exc)))
            continue
        except torch.cuda.OutOfMemoryError:
            skipped.append(Skipped(key, "out of device memory"))
            torch.cuda.empty_cache()
            continue
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if attention and sdpa_backend is not SdpaBackend.AUTO:
                why = f"SDPA backend {sdpa_backend.value} cannot run it on {device} ({why})"
            skipped.append(Skipped(key, why))
            continue
        us = [s * 1e6 for s in samples]
        measured.append(Measurement(key, statistics.median(us), _percentile(us, 0.1), _percentile(us, 0.9), len(us)))
    return CalibrationRun(tuple(measured), tuple(skipped), len(todo))


def device_identity(device: str) -> dict[str, Any]:
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        return {"name": torch.cuda.get_device_name(0), "sm_count": int(props.multi_processor_count),
                "sm_arch": int(props.major * 10 + props.minor),
                "memory_GiB": round(props.total_memory / 2**30, 2)}
    return {"name": f"cpu {platform.processor() or platform.machine()}", "sm_count": None, "sm_arch": None,
            "memory_GiB": None}


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def database_json(run: CalibrationRun, device: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The database file's content (validated by loading it back)."""
    import torch

    def meta_json(metas: tuple) -> list:
        return [[list(shape), dtype] for shape, dtype in metas]

    data = {
        "format": FORMAT,
        "gpu": device_identity(device),
        "provenance": {
            "device": device,
            "driver": _driver_version() if device.startswith("cuda") else None,
            "cuda": torch.version.cuda,
            "torch": torch.__version__,
            "echo_plan": echo_version,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "ops_total": run.ops_total,
            "ops_measured": len(run.measured),
            **settings,
        },
        "entries": [
            {"op": m.key[0], "inputs": meta_json(m.key[1]), "outputs": meta_json(m.key[2]),
             "median_us": m.median_us, "count": m.count, "p10_us": m.p10_us, "p90_us": m.p90_us}
            for m in run.measured
        ],
        "skipped": [
            {"op": s.key[0], "inputs": meta_json(s.key[1]), "reason": s.reason} for s in run.skipped
        ],
    }
    KernelDatabase.from_json(data, "calibration result")  # never write a file that would not load
    return data
