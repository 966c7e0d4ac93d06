"""The Triton FlashAttention's fitted rate (calibrate/triton_attention_fit.py): the shipped figure zeroes the named
rows' mean log residual, and --write changes that one number in compute.yaml and nothing else."""

from __future__ import annotations

from importlib import resources

import pytest

from echo_plan.calibrate.triton_attention_fit import suite_residuals, write_rate
from echo_plan.cost.compute import load_compute_constants
from echo_plan.errors import EchoPlanError
from echo_plan.validation.megatron import validation_dir


def test_the_shipped_rate_is_the_fit_of_its_named_rows():
    constants = load_compute_constants()
    (suite,) = constants.triton_attention_fitted_on
    _, fit, residuals = suite_residuals(suite, validation_dir(), constants.triton_attention_fitted_on[suite])
    at = residuals(constants.triton_attention_rate, fit)
    assert abs(sum(at) / len(at)) < 0.01  # bisection to three digits
    slower = residuals(constants.triton_attention_rate * 0.9, fit)
    assert all(s > a for s, a in zip(slower, at))  # a slower kernel never shortens a step


def test_write_changes_only_the_rate(tmp_path):
    text = (resources.files("echo_plan") / "data" / "compute.yaml").read_text(encoding="utf-8")
    path = tmp_path / "compute.yaml"
    path.write_text(text)
    write_rate(path, 0.612)
    new = path.read_text()
    assert load_compute_constants(new).triton_attention_rate == 0.612
    changed = [(a, b) for a, b in zip(text.splitlines(), new.splitlines()) if a != b]
    assert len(new.splitlines()) == len(text.splitlines()) and 1 <= len(changed) <= 2
    assert all("rate_vs_flash_attn_2" in b or b.lstrip().startswith('source: "fitted') for _, b in changed)
    path.write_text(text.replace("rate_vs_flash_attn_2", "rate"))
    with pytest.raises(EchoPlanError, match="rate_vs_flash_attn_2"):
        write_rate(path, 0.5)
    assert path.read_text() == text.replace("rate_vs_flash_attn_2", "rate")  # nothing half-written
