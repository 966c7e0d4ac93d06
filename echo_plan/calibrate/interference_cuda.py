"""The CUDA side of interference measurement: kernels, stream timing, and NCCL worker processes.

``measure_to_csv`` is what ``calibrate interference measure`` runs: it measures on the local CUDA
GPU(s) and writes the CSV. torch is imported only inside the functions that time kernels, so importing
this module (or ``echo-plan --help``) does not load it. The protocol itself (what is timed against
what) lives in ``interference_measure.run_protocol``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
import math
import tempfile
from pathlib import Path

from echo_plan.calibrate.interference_measure import (Kernel, MeasureConfig, MeasureMode, Row, rows_to_csv,
                                                     run_protocol)
from echo_plan.errors import EchoPlanError
from echo_plan.files import write_atomic
from echo_plan.replay.interference import load_interference
from echo_plan.replay.kinds import TaskKind

WARMUP = 3
COVER = 3.0  # the background loop is sized to last this many times the timed window (doubled on retry)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def measure(config: MeasureConfig) -> tuple[list[Row], str]:
    """Rows for every pair, and a sentence saying what the communication kernel was."""
    import torch

    gpus = torch.cuda.device_count()
    use_nccl = config.mode is MeasureMode.NCCL or (config.mode is MeasureMode.AUTO and gpus > 1)
    if use_nccl:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()):
            raise EchoPlanError("this PyTorch build has no NCCL; use --mode standin")
        return _spawn(config, gpus), f"real NCCL all-reduce among {gpus} local GPU(s), one process per GPU"
    backend = CudaBackend(config, nccl=False)
    how = ("one GPU: communication stand-ins on a second stream (device-to-device copy in place of an "
           "all-gather, elementwise a+b->c in place of an all-reduce), not real collectives")
    return run_protocol(backend, config.iters), how


class CudaBackend:
    """Times kernels on two CUDA streams of one GPU with CUDA events (see ``Backend``)."""

    def __init__(self, config: MeasureConfig, nccl: bool, rank: int = 0, world: int = 1) -> None:
        import torch

        self.torch = torch
        self.config = config
        self.nccl = nccl
        self.world = world
        self.dev = torch.device("cuda", rank)
        torch.cuda.set_device(self.dev)
        self.main = torch.cuda.Stream(device=self.dev)
        self.side = torch.cuda.Stream(device=self.dev)
        props = torch.cuda.get_device_properties(self.dev)
        self.device = f"{props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, CUDA {torch.version.cuda}"

    # -- kernels ---------------------------------------------------------------------------------
    def _bf16(self, *shape: int):
        return self.torch.randn(*shape, device=self.dev, dtype=self.torch.bfloat16)

    def compute_kernels(self) -> list[Kernel]:
        torch, cfg = self.torch, self.config
        n = cfg.gemm_n
        a, b, c = self._bf16(n, n), self._bf16(n, n), self._bf16(n, n)
        bsz, heads, seq, hd = cfg.attn_shape
        q, k, v = self._bf16(bsz, heads, seq, hd), self._bf16(bsz, heads, seq, hd), self._bf16(bsz, heads, seq, hd)
        numel = cfg.mem_mib * 2**20 // 2
        x, y, z = self._bf16(numel), self._bf16(numel), self._bf16(numel)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def gemm(stream) -> None:
            with torch.cuda.stream(stream):
                torch.matmul(a, b, out=c)

        def attention(stream) -> None:
            with torch.cuda.stream(stream):
                sdpa(q, k, v, is_causal=True)

        def memory(stream) -> None:
            with torch.cuda.stream(stream):
                torch.add(x, y, out=z)

        return [
            Kernel(TaskKind.GEMM, f"bf16 matmul {n}x{n}x{n}", gemm),
            Kernel(TaskKind.ATTENTION, f"causal SDPA bf16 b{bsz} h{heads} s{seq} d{hd}", attention),
            Kernel(TaskKind.MEMORY, f"elementwise add bf16 {cfg.mem_mib} MiB operands", memory),
        ]

    def comm_kernels(self) -> list[Kernel]:
        torch, cfg = self.torch, self.config
        numel = cfg.comm_mib * 2**20 // 2
        if self.nccl:
            import torch.distributed as dist

            buf = self._bf16(numel)

            def all_reduce(stream) -> None:
                with torch.cuda.stream(stream):
                    dist.all_reduce(buf)

            return [Kernel(TaskKind.ALL_REDUCE, f"NCCL all-reduce bf16 {cfg.comm_mib} MiB among {self.world} GPU(s)",
                           all_reduce)]
        src, dst, other = self._bf16(numel), self._bf16(numel), self._bf16(numel)

        def copy(stream) -> None:
            with torch.cuda.stream(stream):
                dst.copy_(src)

        def reduce(stream) -> None:
            with torch.cuda.stream(stream):
                torch.add(src, other, out=dst)

        return [
            Kernel(TaskKind.ALL_GATHER, f"STAND-IN for all_gather: device-to-device copy {cfg.comm_mib} MiB", copy),
            Kernel(TaskKind.ALL_REDUCE, f"STAND-IN for all_reduce: elementwise a+b->c {cfg.comm_mib} MiB", reduce),
        ]

    # -- timing ----------------------------------------------------------------------------------
    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def alone(self, k: Kernel, iters: int) -> float:
        torch = self.torch
        for _ in range(WARMUP):
            k.launch(self.main)
        torch.cuda.synchronize(self.dev)
        e0, e1 = self._event(), self._event()
        e0.record(self.main)
        for _ in range(iters):
            k.launch(self.main)
        e1.record(self.main)
        torch.cuda.synchronize(self.dev)
        return e0.elapsed_time(e1) * 1000.0 / iters

    def beside(self, k: Kernel, other: Kernel, iters: int, k_us: float, other_us: float) -> float:
        torch = self.torch
        cover = COVER
        for _ in range(4):
            n_other = self._agree(max(2, math.ceil(cover * iters * k_us / max(other_us, 1e-3)) + 2))
            torch.cuda.synchronize(self.dev)
            s1, e0, e1 = self._event(), self._event(), self._event()
            for _ in range(n_other):  # the background loop first, so it is running when timing starts
                other.launch(self.side)
            s1.record(self.side)
            e0.record(self.main)
            for _ in range(iters):
                k.launch(self.main)
            e1.record(self.main)
            torch.cuda.synchronize(self.dev)
            covered = e1.elapsed_time(s1) >= 0.0  # the background loop outlasted the timed window
            if self._agree(int(covered), low=True):
                return e0.elapsed_time(e1) * 1000.0 / iters
            cover *= 2.0
        raise EchoPlanError(f"could not keep {other.label} running for the whole of {k.label}'s timing")

    def _agree(self, value: int, low: bool = False) -> int:
        """The same number on every rank (NCCL mode): the max, or the min with ``low``."""
        if not self.nccl:
            return value
        import torch.distributed as dist

        t = self.torch.tensor([value], device=self.dev, dtype=self.torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if low else dist.ReduceOp.MAX)
        return int(t.item())


def _spawn(config: MeasureConfig, world: int) -> list[Row]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="echo-plan-interference-") as tmp:
        init, out = Path(tmp) / "init", Path(tmp) / "rows.json"
        mp.spawn(_worker, args=(world, str(init), str(out), config), nprocs=world, join=True)
        data = json.loads(out.read_text(encoding="utf-8"))
    return [Row(TaskKind(r[0]), TaskKind(r[1]), r[2], r[3], r[4], r[5]) for r in data]


def _worker(rank: int, world: int, init: str, out: str, config: MeasureConfig) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        rows = run_protocol(CudaBackend(config, nccl=True, rank=rank, world=world), config.iters)
        if rank == 0:
            data = [[r.compute_kind.value, r.comm_kind.value, r.isolated_us, r.overlapped_us, r.slowed, r.source]
                    for r in rows]
            write_atomic(out, json.dumps(data))
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class MeasureOutcome:
    measured: bool
    message: str  # what was done (or why nothing was), for the user
    path: Path | None = None
    rows: tuple[Row, ...] = ()


def measure_to_csv(out: str | Path, config: MeasureConfig = MeasureConfig()) -> MeasureOutcome:
    """Measure on the local CUDA GPU(s) and write the CSV atomically. Without CUDA, write nothing
    and say that the default factors stay."""
    if not cuda_available():
        src = load_interference(None).source
        return MeasureOutcome(False, "no CUDA GPU here: nothing measured. The replay keeps the default "
                                     f"interference factors ({src}).")
    rows, how = measure(config)
    note = (f"Measured by `echo-plan calibrate interference measure` ({how}).\n"
            "Fit with: echo-plan calibrate interference fit THIS.csv -o interference.yaml")
    path = write_atomic(out, rows_to_csv(rows, note))
    return MeasureOutcome(True, f"measured {len(rows)} rows ({how}); wrote {path}", path, tuple(rows))
