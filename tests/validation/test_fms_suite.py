"""IBM and PyTorch's fms-fsdp runs on 128 A100 and 96 H100 (fms_fsdp_*.csv): the files read as their header says (the
Llama 2 shapes, HSDP for the 7B, the 13B's derived checkpointing share, the rows whose share is unpublished listed
as not modelled), the fms-fsdp stack is FSDP1 (no FSDP2 copy kernels) reducing in bf16, the 800 Gb/s H100 preset
carries the H100's calibration, and every run that ran is predicted to fit."""

from __future__ import annotations

import pytest

from echo_plan.specs import load_cluster, load_stack
from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite

SUITES = {name: training_suite(validation_dir() / f"{name}.csv") for name in ("fms_fsdp_a100", "fms_fsdp_h100")}


@pytest.mark.parametrize("name,gpus,cluster", [("fms_fsdp_a100", 128, "jean-zay-a100"),
                                               ("fms_fsdp_h100", 96, "h100-800g")])
def test_rows_carry_the_tables_settings(name, gpus, cluster):
    suite = SUITES[name]
    rows = training_rows(suite)
    assert suite.stack == "fms-fsdp" and suite.cluster == cluster and len(rows) == 8
    modelled = [r for r in rows if not r.not_modelled]
    assert len(modelled) == 5 and all("not published" in r.not_modelled for r in rows if r.not_modelled)
    for r in modelled:  # batch 2 per GPU, no accumulation, FSDP over every GPU (HSDP within a server for the 7B)
        assert r.gpus == gpus and r.plan["micro_batch_size"] == 2 and r.plan["global_batch_size"] == 2 * gpus
        assert r.model.vocab_size == 32000 and r.model.seq_length == 4096 and r.plan["sharding"] == "parameters"
        assert (r.plan.get("shard_degree") == 8) == (r.model.hidden_size == 4096)
    thirteen = next(r for r in modelled if r.model.hidden_size == 5120)  # p = 1/2 of 40 blocks
    assert thirteen.plan["recompute_layers"] == 20 and thirteen.plan["recompute"] == "none"
    assert {r.plan["recompute"] for r in modelled if r.model.hidden_size == 8192} == {"full"}


def test_the_stack_is_fsdp1_reducing_in_bf16_and_the_h100_preset_is_calibrated():
    stack = load_stack("fms-fsdp")
    assert not stack.fsdp_copy_kernels and stack.grad_reduce_dtype.value == "bf16"
    assert not (stack.tensor_parallel or stack.pipeline_parallel or stack.context_parallel)
    h100, dgx = load_cluster("h100-800g"), load_cluster("dgx-h100")
    assert h100.network.nics_per_node * h100.network.nic_bw_Gbps == 800
    assert h100.gpu == dgx.gpu  # the same die: the H100's compute figures, written by recipe compute-sm90
    assert h100.calibration["compute"] == dgx.calibration["compute"]


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_run_that_ran_is_predicted_to_fit(name):
    suite = SUITES[name]
    sim = RowSimulator(suite.cluster, suite.stack, model_settings=suite.model_settings)
    for r in training_rows(suite):
        if not r.not_modelled:
            assert sim.predict(r).fits, r.label
