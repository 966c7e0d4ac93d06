"""MosaicML's MPT runs on A100 80GB and 40GB (mpt_llm_foundry_a100*.csv): the files read as their headers say, the
Triton FlashAttention's fitted rate names rows of the 80 GB suite, leave-one-suite-out refits it on rows of the 40 GB
one, and the runs that sat at the edge of memory (MosaicML chose the largest micro-batch that fits) are predicted to
fit, on both cards."""

from __future__ import annotations

import pytest

from echo_plan.calibrate.loso import _triton_prior
from echo_plan.cost.compute import load_compute_constants
from echo_plan.specs import load_cluster, load_stack
from echo_plan.specs.software_kinds import AttentionLibrary
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite
from echo_plan.validation.suites import fitted_rows

SUITE = training_suite(validation_dir() / "mpt_llm_foundry_a100.csv")
ROWS = training_rows(SUITE)


def test_rows_carry_the_mpt_configs_and_the_published_throughput():
    assert len(ROWS) == 61 and len({r.label for r in ROWS}) == 61 and not any(r.not_modelled for r in ROWS)
    assert SUITE.stack == "llm-foundry" and SUITE.cluster == "dgx-a100"
    for r in ROWS:  # MPT: no biases, tied output embedding, learned positions sized to the run's sequence
        assert r.model.bias is False and r.model.tied_embeddings and r.model.vocab_size == 50368
        assert r.model.ffn_size == 4 * r.model.hidden_size and r.plan["tp"] == r.plan["pp"] == 1
    seven = [r for r in ROWS if r.model.hidden_size == 4096]
    assert {r.model.seq_length for r in seven} == {1024, 2048, 4096, 8192, 16384, 32768, 65536}
    pure = [r for r in ROWS if r.model.num_layers == 80]  # the two MPT-70B rows: FSDP mixed precision PURE
    assert len(pure) == 2 and all(r.stack_overrides["grad_reduce_dtype"] == "bf16" for r in pure)
    row = next(r for r in seven if r.model.seq_length == 2048)  # 96 x 2048 tokens at 37,130 tokens/s
    assert row.measured == pytest.approx(96 * 2048 / 37130, rel=1e-4) and row.plan["recompute"] == "none"


def test_the_triton_rate_is_fitted_on_named_rows_of_this_suite_only():
    named = load_compute_constants().triton_attention_fitted_on
    assert set(named) == {"mpt_llm_foundry_a100"}
    labels = {r.label for r in ROWS}
    assert set(named["mpt_llm_foundry_a100"]) <= labels and len(named["mpt_llm_foundry_a100"]) <= 3
    assert set(named["mpt_llm_foundry_a100"]) <= fitted_rows(load_cluster("dgx-a100"), "mpt_llm_foundry_a100")
    assert not fitted_rows(load_cluster("dgx-a100"), "fsdp_torchtitan_a100") & labels


def test_leave_one_suite_out_refits_the_rate_on_the_other_suite_of_the_stack():
    """Left out, the suite is predicted with the rate fitted on its stand-in (the longest sequences of the 40 GB
    runs), which agrees with the shipped one; with no stand-in it would be FlashAttention-2's rate."""
    from echo_plan.calibrate.triton_attention_fit import fit_rate

    constants = load_compute_constants()
    stand_in = dict(constants.triton_attention_stand_in)
    assert set(stand_in) == {"mpt_llm_foundry_a100_40gb"} and SUITE.name not in stand_in
    other = training_rows(training_suite(validation_dir() / "mpt_llm_foundry_a100_40gb.csv"))
    assert set(stand_in["mpt_llm_foundry_a100_40gb"]) <= {r.label for r in other}
    rate, _ = fit_rate(validation_dir(), stand_in)
    assert rate == pytest.approx(constants.triton_attention_rate, rel=0.10)
    lf = load_stack("llm-foundry")
    assert lf.attention_library is AttentionLibrary.FLASH_ATTN_TRITON
    prior = _triton_prior(lf)
    assert prior.attention_library is AttentionLibrary.FLASH_ATTN_2 and prior.name == lf.name
    assert _triton_prior(load_stack("torchtitan")) == load_stack("torchtitan")
    row = next(r for r in ROWS if r.label in constants.triton_attention_fitted_on[SUITE.name])
    fitted = RowSimulator(SUITE.cluster, SUITE.stack).predict(row)
    unfitted = RowSimulator(SUITE.cluster, SUITE.stack, stack_transform=_triton_prior).predict(row)
    assert unfitted.step_s < fitted.step_s  # the Triton kernel is slower than FlashAttention-2


def test_the_runs_at_the_edge_of_memory_are_predicted_to_fit():
    """MPT-3B without checkpointing at micro-batch 3 x 8,192 and MPT-30B at 8,192 tokens ran on 80 GB."""
    sim = RowSimulator(SUITE.cluster, SUITE.stack)
    edge = [r for r in ROWS if r.model.seq_length == 8192 and r.model.hidden_size in (2560, 7168)]
    assert len(edge) == 2
    for row in edge:
        p = sim.predict(row)
        assert p.memory is not None and p.fits, (row.label, p.memory)
        assert p.memory.peak_gib > 70  # close to the card: the rows bound the default headroom (memory.yaml)


def test_the_40gb_runs_read_and_fit_their_cards():
    suite = training_suite(validation_dir() / "mpt_llm_foundry_a100_40gb.csv")
    rows = training_rows(suite)
    assert len(rows) == 78 and suite.cluster == "dgx-a100-40gb" and suite.stack == "llm-foundry"
    assert load_cluster("dgx-a100-40gb").gpu.hbm_GiB == 40 and max(r.gpus for r in rows) == 128
    assert all(r.stack_overrides["grad_reduce_dtype"] == "bf16" for r in rows)  # FSDP mixed precision PURE
    assert not fitted_rows(load_cluster("dgx-a100-40gb"), suite.name) & {r.label for r in rows}  # all held out
    sim = RowSimulator(suite.cluster, suite.stack)
    tight = [r for r in rows if r.label in ("mpt-1b bf16 32 GPUs", "mpt-3b bf16 32 GPUs")]
    assert len(tight) == 2
    for row in tight:  # within 2 GiB of the card, as MosaicML's micro-batch choice suggests
        p = sim.predict(row)
        assert p.fits and 37.0 < p.memory.peak_gib < 40.0, (row.label, p.memory)
