"""DeepSeek-V3's published DualPipe chunk pair (issue 32), predicted from the CSV: the targets met today.

Not met yet, so not asserted (docs/validation.md says why): the dispatch kernels (-20% with the first DeepEP
release's shares, which the stack runs: DeepEP's dispatch kernels run longer inside training than in its own
benchmark) and the notify kernels (waits for the other ranks, no kernel in a one-rank replay).

Attention runs as the profile names it, FlashAttention-3 (``attention_library: flash-attn-3``) at its published
H100 rates: forward +6% and backward -11% inside the pair, where every attention kernel of the profile runs beside
a DeepEP kernel on its 20 SMs (+15.1% and +7% with the default library's figures before).

The FP8 casts and transposes are within 15% since the stack traces DeepSeek's own kernels around the GEMMs
(``fp8_kernels: deepseek``: the scale layouts, the weight transposes of each backward, the two casts of a tensor
needed both ways) and its E5M6 copy of the attention output, each counted kernel by kernel in the profile
(stacks/deepseek-v3.yaml, source [3]); nothing fitted.
"""

from __future__ import annotations

import pytest

from echo_plan.validation.chunk_pair import CLASSES, LAYERS, compare, measured, measured_class


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return compare(str(tmp_path_factory.mktemp("traces")))


def test_the_exchanges_are_told_apart_by_direction(pair):
    # the replayed layer's four token exchanges: forward dispatch and combine, then the combine's gradient (sent to
    # the experts, by DeepEP's dispatch kernel) and the dispatch's (sent back, by its combine kernel)
    assert pair.alone_ms["dispatch"] > 0 and pair.alone_ms["combine"] > pair.alone_ms["dispatch"]  # FP8 out, bf16 back
    assert pair.in_pair_ms.get("exchange notify (waits)", 0.0) == 0.0


def test_every_profile_kernel_has_a_class_and_the_profile_is_read_whole():
    by, span = measured()
    assert set(by) == set(CLASSES)
    assert 120.0 < span < 140.0  # the 4-layer pair's span, ms
    assert measured_class("void dpsk::ep::internode::combine<false, 8>") == "combine"
    assert measured_class("void dpsk::ep::internode::dispatch<false, 8>") == "dispatch"
    assert measured_class("void dpsk::ep::internode::cached_notify<false>(int, int)") == "exchange notify (waits)"
    assert measured_class("void flash::compute_attn_ws<Flash_fwd_kernel_traits>") == "attention forward"


def test_the_chunk_pair_is_within_ten_per_cent(pair):
    assert abs(pair.pair_error) <= 0.10, f"{pair.predicted_pair_ms:.1f} ms against {pair.measured_pair_ms:.1f}"


@pytest.mark.parametrize("cls", ["attention forward", "attention backward", "GEMMs", "combine",
                                 "FP8 casts and transposes"])
def test_classes_within_fifteen_per_cent(pair, cls):
    assert abs(pair.error(cls)) <= 0.15, f"{cls}: {pair.in_pair_ms[cls]:.1f} ms against {pair.measured_ms[cls]:.1f}"


def test_inside_the_pair_no_kernel_class_runs_faster_than_alone(pair):
    for cls in CLASSES:
        assert pair.in_pair_ms.get(cls, 0.0) >= pair.alone_ms.get(cls, 0.0) * (1 - 1e-9)
    assert LAYERS == 4  # the profile's chunks


def test_every_attention_kernel_of_the_profile_runs_beside_a_deepep_kernel():
    """Why attention is compared inside the pair: in DeepSeek's profile each FlashAttention-3 kernel (compute
    stream) overlaps a DeepEP kernel on another stream for nearly all of its time, so it ran on the SMs DeepEP left."""
    import csv

    from echo_plan.validation.megatron import validation_dir

    path = validation_dir() / "deepseek_v3_h800" / "train_chunk_pair_kernels.csv"
    rows = list(csv.DictReader(ln for ln in path.read_text().splitlines() if not ln.startswith("#")))
    span = [(float(r["start_us"]), float(r["start_us"]) + float(r["dur_us"]), r) for r in rows]
    exchange = [(s, e) for s, e, r in span if "dpsk::ep::" in r["name"]]
    attention = [(s, e) for s, e, r in span if measured_class(r["name"]).startswith("attention")]
    assert len(attention) == 16  # 4 layers: a forward, and a backward of three kernels each
    for s, e in attention:
        beside = sum(max(0.0, min(e, x1) - max(s, x0)) for x0, x1 in exchange)
        assert beside >= 0.95 * (e - s)
