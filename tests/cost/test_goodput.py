"""The goodput model against published figures, and its properties."""

from __future__ import annotations

import pytest

from echo_plan.cost.goodput import FailureModel, ettr


def test_llama3_effective_training_time_is_about_90_percent():
    # Llama 3 405B on 16,384 H100: 419 interruptions in 54 days (the default rate); checkpoint of
    # 405e9 params x (2 B weights + 12 B optimizer states) at the cluster's 2 TB/s (the default);
    # detection 5 min and restart 10 min (the stated judgements). Published: "> 90%".
    ratio, mtbf, _, _ = ettr(16_384, 405e9 * 14, FailureModel())
    assert mtbf == pytest.approx(54 * 24 * 60 / 419, rel=1e-6)
    assert ratio == pytest.approx(0.90, abs=0.03)


def test_byterobust_ettr_is_about_97_percent():
    # ByteRobust, 9,600 GPUs, three months: 97% ETTR (Wan et al., SOSP 2025). ASSUMED inputs: the
    # Llama 3 interruption rate per GPU-day, near-zero checkpoint blocking (its I/O overlaps training),
    # 2 min detection (hot stack-trace diagnosis) and 5 min restart (warm standby machines).
    ratio, _, _, _ = ettr(9_600, 405e9 * 14, FailureModel(detect_min=2, restart_min=5, checkpoint_GBps_per_gpu=10))
    assert ratio == pytest.approx(0.97, abs=0.02)


def test_more_gpus_and_more_failures_never_raise_ettr():
    model = FailureModel()
    ratios = [ettr(n, 175e9 * 14, model)[0] for n in (256, 1024, 4096, 16_384)]
    assert ratios == sorted(ratios, reverse=True)
    worse = FailureModel(interruptions_per_gpu_day=model.interruptions_per_gpu_day * 4)
    assert ettr(4096, 175e9 * 14, worse)[0] < ettr(4096, 175e9 * 14, model)[0]
    assert ettr(4096, 175e9 * 14, FailureModel(interruptions_per_gpu_day=0))[0] == 1.0
