"""The kernel model's constants: ``echo_plan/data/compute.yaml`` read into frozen tables (GEMM tiles, the
per-generation efficiencies, the attention and memory-bound figures), and the GEMM shape efficiency the
per-generation asymptotes are fitted through. ``compute.py`` times ops with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from echo_plan.cost.attention_cost import triton_attention_entry
from echo_plan.errors import FileFormatError
from echo_plan.files import safe_load
from echo_plan.trace.records import OpKind

@dataclass(frozen=True, slots=True)
class Tile:
    m: int
    n: int
    rel_eff: float


@dataclass(frozen=True, slots=True)
class ArchParams:
    asymptotic_eff: float  # fraction of peak of a perfectly quantised, long-K GEMM
    max_eff: float  # the measured best fraction of peak (MAMF): no shape does better
    attention_forward_eff: float
    attention_backward_eff: float
    stream_k_eff: float | None = None  # Hopper+: a partial last wave can run as stream-K at this tile rate
    fp8_asymptotic_eff: float | None = None  # FP8 GEMMs: their own curve (None: no FP8 tensor cores)
    fp8_max_eff: float | None = None
    fp4_asymptotic_eff: float | None = None  # NVFP4 GEMMs (the FP8 measurement with the FP4 pipeline fill)
    fp4_max_eff: float | None = None
    fa2_forward_eff: float | None = None  # FlashAttention-2's kernels (None: the same as the default library's)
    fa2_backward_eff: float | None = None
    fa2_causal_ratio: float = 1.0  # what FlashAttention-2's causal kernels reach of its unmasked rate
    fa3_forward_eff: float | None = None  # FlashAttention-3's kernels (None: this GPU runs none; the default's)
    fa3_backward_eff: float | None = None
    fa3_causal_ratio: float = 1.0


@dataclass(frozen=True)
class ComputeConstants:
    launch_overhead_s: float
    tiles: tuple[Tile, ...]
    k_overhead: int
    min_split_k: int
    max_split: int
    arch: Mapping[int, ArchParams]
    attention_block_rows: int
    attention_seq_half: float
    causal_work_fraction: float
    hbm_efficiency: Mapping[OpKind, float]
    attention_dropout_eff: float = 1.0
    fp8_k_overhead: int = 32  # the FP8 GEMM's pipeline fill in units of K
    fp8_blockwise_eff: float = 1.0  # blockwise-scaled FP8 GEMMs relative to per-tensor scaled ones
    fp8_mx_eff: float = 1.0  # MXFP8 GEMMs relative to per-tensor scaled FP8 ones
    fp4_k_overhead: int = 32  # the NVFP4 GEMM's pipeline fill in units of K
    attention_head_dim_half: float = 0.0  # 0: no head-dim dependence
    triton_attention_rate: float = 1.0  # flash-attn 1.x's Triton kernel relative to FlashAttention-2 (fitted)
    triton_attention_fitted_on: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    triton_attention_stand_in: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def arch_note(self, gpu_name: str, sm_arch: int) -> str | None:
        """One line when ``sm_arch`` has no measured entry of its own and another generation's stands in."""
        if sm_arch in self.arch:
            return None
        older = [a for a in sorted(self.arch) if a <= sm_arch]
        used = older[-1] if older else min(self.arch)
        return (f"the kernel model has no measured GEMM and attention efficiencies for {gpu_name} (sm{sm_arch}): "
                f"sm{used}'s are used (compute.yaml), a judgement until runs on this GPU calibrate it")

    def arch_params(self, sm_arch: int) -> ArchParams:
        """The newest generation in the table that is not newer than ``sm_arch`` (else the oldest)."""
        known = sorted(self.arch)
        older = [a for a in known if a <= sm_arch]
        return self.arch[older[-1] if older else known[0]]


def load_compute_constants(text: str | None = None, origin: str = "compute.yaml",
                           packaged: bool = False) -> ComputeConstants:
    """Parse the constants file (the packaged default, parsed once, when ``text`` is None)."""
    if text is None:
        return _packaged_constants()
    try:
        raw = safe_load(text, packaged=packaged)
        tiles = tuple(Tile(int(t["m"]), int(t["n"]), float(t["rel_eff"])) for t in raw["gemm_tiles"])
        k0 = int(raw["gemm_k_overhead"])
        arch: dict[int, ArchParams] = {}
        for key, a in raw["arch"].items():
            m, n, k = (int(x) for x in a["mamf_shape"])
            sk = a.get("stream_k_efficiency")
            sk = None if sk is None else float(sk)
            shape_eff = gemm_shape_efficiency(m, n, k, int(a["sm_count"]), tiles, k0,
                                              int(raw["gemm_min_split_k"]), int(raw["gemm_max_split"]), stream_k=sk)
            fp8_asym = fp8_max = fp4_asym = None
            if "fp8_mamf_fraction" in a:
                fm, fn, fk_ = (int(x) for x in a["fp8_mamf_shape"])
                fp8_max = float(a["fp8_mamf_fraction"])
                for k_over, what in ((int(raw["fp8_gemm_k_overhead"]), "fp8"),
                                     (int(raw.get("fp4_gemm_k_overhead", raw["fp8_gemm_k_overhead"])), "fp4")):
                    shape_q = gemm_shape_efficiency(fm, fn, fk_, int(a["sm_count"]), tiles, k_over,
                                                    int(raw["gemm_min_split_k"]), int(raw["gemm_max_split"]), stream_k=sk)
                    if what == "fp8":
                        fp8_asym = min(1.0, fp8_max / shape_q)
                    else:
                        fp4_asym = min(1.0, fp8_max / shape_q)
            arch[int(key)] = ArchParams(
                asymptotic_eff=min(1.0, float(a["mamf_fraction"]) / shape_eff),
                max_eff=float(a["mamf_fraction"]),
                attention_forward_eff=float(a["attention_forward_eff"]),
                attention_backward_eff=float(a["attention_backward_eff"]),
                stream_k_eff=sk, fp8_asymptotic_eff=fp8_asym, fp8_max_eff=fp8_max,
                fp4_asymptotic_eff=fp4_asym, fp4_max_eff=fp8_max,
                fa2_forward_eff=_optional(a, "flash_attn_2_forward_eff"),
                fa2_backward_eff=_optional(a, "flash_attn_2_backward_eff"),
                fa2_causal_ratio=_share(a.get("flash_attn_2_causal_ratio", 1.0), "flash_attn_2_causal_ratio"),
                fa3_forward_eff=_optional(a, "flash_attn_3_forward_eff"),
                fa3_backward_eff=_optional(a, "flash_attn_3_backward_eff"),
                fa3_causal_ratio=_share(a.get("flash_attn_3_causal_ratio", 1.0), "flash_attn_3_causal_ratio"),
            )
        hbm = {OpKind(k): float(v) for k, v in raw["hbm_efficiency"].items()}
        return ComputeConstants(
            launch_overhead_s=float(raw["launch_overhead_us"]) * 1e-6,
            tiles=tiles,
            k_overhead=k0,
            min_split_k=int(raw["gemm_min_split_k"]),
            max_split=int(raw["gemm_max_split"]),
            arch=MappingProxyType(arch),
            attention_block_rows=int(raw["attention_block_rows"]),
            attention_seq_half=float(raw["attention_seq_half"]),
            causal_work_fraction=float(raw["causal_work_fraction"]),
            hbm_efficiency=MappingProxyType(hbm),
            attention_dropout_eff=float(raw.get("attention_dropout_efficiency", 1.0)),
            fp8_k_overhead=int(raw.get("fp8_gemm_k_overhead", k0)),
            fp8_blockwise_eff=float(raw.get("fp8_blockwise_efficiency", 1.0)),
            fp8_mx_eff=float(raw.get("fp8_mx_efficiency", 1.0)),
            fp4_k_overhead=int(raw.get("fp4_gemm_k_overhead", raw.get("fp8_gemm_k_overhead", k0))),
            attention_head_dim_half=float(raw.get("attention_head_dim_half", 0.0)),
            **triton_attention_entry(raw.get("flash_attn_triton") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError, yaml.YAMLError) as exc:
        raise FileFormatError(origin, f"invalid compute-model constants: {exc!r}") from None


def _share(value: Any, key: str) -> float:
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = math.nan
    if not 0.0 < share <= 1.0:  # NaN fails too
        raise ValueError(f"{key} {value!r}: a share of a rate, a number above 0 and at most 1")
    return share


def _optional(mapping: Mapping[str, Any], key: str) -> float | None:
    return None if mapping.get(key) is None else float(mapping[key])


@lru_cache(maxsize=1)
def _packaged_constants() -> ComputeConstants:
    text = (resources.files("echo_plan") / "data" / "compute.yaml").read_text(encoding="utf-8")
    return load_compute_constants(text, "echo_plan/data/compute.yaml", packaged=True)


def gemm_shape_efficiency(m: int, n: int, k: int, sm_count: int, tiles: tuple[Tile, ...],
                          k_overhead: int, min_split_k: int, max_split: int, batch: int = 1,
                          stream_k: float | None = None) -> float:
    """Fraction of the asymptotic GEMM rate a (batch x) M x N x K GEMM reaches: the best tile and
    split, or (``stream_k`` set) a stream-K schedule with no wave quantisation at that tile rate."""
    best = 0.0
    for tile in tiles:
        tm, tn = math.ceil(m / tile.m), math.ceil(n / tile.n)
        tiles_out = tm * tn * batch
        tile_q = (m * n) / (tm * tile.m * tn * tile.n)
        if stream_k is not None and tiles_out >= sm_count:  # every SM gets at least one tile's work
            best = max(best, tile.rel_eff * tile_q * (k / (k + k_overhead)) * stream_k)
        max_s = max(1, min(max_split, k // min_split_k)) if tiles_out < sm_count else 1
        for split in range(1, max_s + 1):
            ctas = tiles_out * split
            waves = math.ceil(ctas / sm_count)
            wave_q = ctas / (waves * sm_count)
            k_split = k / split
            k_eff = k_split / (k_split + k_overhead)
            eff = tile.rel_eff * tile_q * wave_q * k_eff
            if eff > best:
                best = eff
    return best
