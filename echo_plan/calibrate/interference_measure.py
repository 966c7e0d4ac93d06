"""Measure interference on this machine's GPU and write the measurement CSV that ``fit`` reads.

The protocol, for every communication kernel C and compute kernel K available:

1. time C alone and K alone (``iters`` back-to-back launches on one stream, CUDA events);
2. time K while C loops on a second stream for longer than K's whole timed window -> the compute
   slowdown row (``slowed=compute``);
3. time C while K loops on a second stream -> the collective slowdown row (``slowed=comm``).

Compute kernels: a square bf16 matrix multiply (GEMM), causal scaled-dot-product attention
(flash attention where PyTorch has it), and an elementwise add of large tensors (memory-bound).
Communication kernels: with several CUDA GPUs (or ``mode="nccl"``), a real NCCL all-reduce among
all of them (one process per GPU, symmetric work, rank 0 records); with one GPU a *stand-in* -
a device-to-device copy loop (in place of an all-gather) and an elementwise a+b->c reduction
loop (in place of an all-reduce's reduce-copy) on the second stream. The stand-ins compete for
HBM bandwidth and SMs like a collective does but are not collectives: every row says which was
used in its ``source`` column, and so does the command's output.

The protocol (``run_protocol``) is independent of CUDA: it drives a ``Backend`` (alone/beside
timings), which ``interference_cuda.py`` implements with PyTorch.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol, Sequence

from echo_plan.replay.kinds import TaskKind


@dataclass(frozen=True)
class Kernel:
    """A kernel to time: ``launch(stream)`` enqueues one launch on ``stream`` (backend-specific)."""

    kind: TaskKind
    label: str  # what it is, with sizes, e.g. "bf16 matmul 8192x8192x8192"
    launch: Callable[[object], None]


class Backend(Protocol):
    device: str  # e.g. "NVIDIA H100 80GB HBM3, torch 2.5, CUDA 12.4"

    def compute_kernels(self) -> Sequence[Kernel]: ...

    def comm_kernels(self) -> Sequence[Kernel]: ...

    def alone(self, k: Kernel, iters: int) -> float:
        """Microseconds per launch of ``k`` alone."""
        ...

    def beside(self, k: Kernel, other: Kernel, iters: int, k_us: float, other_us: float) -> float:
        """Microseconds per launch of ``k`` while ``other`` loops on another stream throughout."""
        ...


@dataclass(frozen=True, slots=True)
class Row:
    compute_kind: TaskKind
    comm_kind: TaskKind
    isolated_us: float
    overlapped_us: float
    slowed: str  # "compute" | "comm"
    source: str


class MeasureMode(str, Enum):
    AUTO = "auto"  # a real NCCL all-reduce when this machine has several CUDA GPUs, else stand-ins
    NCCL = "nccl"  # a real NCCL all-reduce among all local GPUs (also with one: a 1-rank all-reduce)
    STANDIN = "standin"  # single-GPU stand-ins for the collective


@dataclass(frozen=True, slots=True)
class MeasureConfig:
    gemm_n: int = 8192  # square bf16 matmul: ~1.1 ms on an H100 at ~1000 TFLOP/s
    mem_mib: int = 512  # each operand of the memory-bound add
    attn_shape: tuple[int, int, int, int] = (4, 32, 4096, 128)  # batch, heads, sequence, head dim
    comm_mib: int = 256  # collective / stand-in buffer
    iters: int = 20
    mode: MeasureMode = MeasureMode.AUTO


def run_protocol(backend: Backend, iters: int) -> list[Row]:
    """All rows for every (communication kernel, compute kernel) pair (see the module docstring)."""
    rows: list[Row] = []
    computes = list(backend.compute_kernels())
    alone_compute = {k.label: backend.alone(k, iters) for k in computes}
    for c in backend.comm_kernels():
        c_us = backend.alone(c, iters)
        for k in computes:
            k_us = alone_compute[k.label]
            k_over = backend.beside(k, c, iters, k_us, c_us)
            c_over = backend.beside(c, k, iters, c_us, k_us)
            where = f"{backend.device}: {k.label} | {c.label}"
            rows.append(Row(k.kind, c.kind, k_us, k_over, "compute", where))
            rows.append(Row(k.kind, c.kind, c_us, c_over, "comm", where))
    return rows


def rows_to_csv(rows: Sequence[Row], note: str) -> str:
    buf = io.StringIO()
    for line in note.splitlines():
        buf.write(f"# {line}\n")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["compute_kind", "comm_kind", "isolated_us", "overlapped_us", "slowed", "source"])
    for r in rows:
        w.writerow([r.compute_kind.value, r.comm_kind.value, f"{r.isolated_us:.3f}", f"{r.overlapped_us:.3f}",
                    r.slowed, r.source])
    return buf.getvalue()
