"""AI2's OLMo-core runs on H100 (olmo_core_h100.csv): the file reads as its header says (the models of each commit,
their QK norm, the loss each release ran), a bad qk_norm value is named, every run is predicted to fit, and the
prediction runs FSDP2's copy kernels (the olmo-core stack's runtime)."""

from __future__ import annotations

import pytest

from echo_plan.errors import FileFormatError
from echo_plan.simulate import simulate
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite
from echo_plan.validation.rows import read_step_times

SUITE = training_suite(validation_dir() / "olmo_core_h100.csv")
ROWS = training_rows(SUITE)


def test_rows_carry_the_scripts_settings_and_the_published_throughput():
    assert SUITE.stack == "olmo-core" and SUITE.cluster == "dgx-h100"
    assert len(ROWS) == 13 and len({r.label for r in ROWS}) == 13 and not any(r.not_modelled for r in ROWS)
    for r in ROWS:  # FSDP full shard over one server's 8 GPUs, untied output, the padded dolma2 vocabulary
        assert r.gpus == 8 and r.plan["sharding"] == "parameters" and r.plan["recompute"] == "none"
        assert r.model.vocab_size == 100352 and not r.model.tied_embeddings and r.model.bias is False
        assert r.model.qk_norm == r.model.name.startswith("olmo-")  # OLMo 2's QK norm; the Llama-like ones lack it
    compiled = [r for r in ROWS if r.stack_overrides.get("cross_entropy") == "torch_compiled"]
    assert {r.plan["micro_batch_size"] for r in compiled} == {8} and len(compiled) == 2  # e27ba7455's 1B
    eight = next(r for r in ROWS if r.model.name == "llama3-8b" and r.plan["dtype"] == "bf16")
    assert eight.model.kv_heads == 8 and eight.model.ffn_size == 14336
    assert eight.measured == pytest.approx(1024 * 4096 / (9500 * 8), rel=1e-4)  # 9,500 tokens/s per GPU


def test_a_bad_qk_norm_value_is_named(tmp_path):
    text = (validation_dir() / "olmo_core_h100.csv").read_text().splitlines()
    body = [ln for ln in text if not ln.startswith("#")]
    p = tmp_path / "runs.csv"
    p.write_text("\n".join([body[0], body[4].replace(",true,bf16,", ",maybe,bf16,", 1)]) + "\n")
    with pytest.raises(FileFormatError, match="qk_norm"):
        read_step_times(p)


@pytest.fixture(scope="module")
def sim():
    return RowSimulator(SUITE.cluster, SUITE.stack, model_settings=SUITE.model_settings)


def test_every_run_is_predicted_to_fit(sim):
    for r in ROWS:
        assert sim.predict(r).fits, r.label


def test_the_prediction_runs_fsdp2_copies(sim):
    """The 13B at micro-batch 1: every micro-batch gathers and reduce-scatters 13 billion parameters, whose
    copy-out and copy-in take the compute stream; without them the step would be shorter."""
    row = next(r for r in ROWS if r.model.name == "olmo-13b" and r.plan["dtype"] == "bf16")
    model, cluster, plan, stack = sim.model_for(row), sim.cluster_for(row), sim.plan_for(row), sim.stack_for(row)
    assert stack.fsdp_copy_kernels
    with_ = simulate(model, cluster, plan, stack=stack, memo=sim.memo)
    without = simulate(model, cluster, plan, stack=stack.replace(fsdp_copy_kernels=False), memo=sim.memo)
    assert with_.step_time_s > 1.03 * without.step_time_s
