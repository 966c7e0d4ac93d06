"""BigScience's Megatron-DeepSpeed runs on Jean Zay (bloom_jean_zay_a100.csv): the file reads as its header says,
and the three layouts of its source that ran out of memory are predicted not to fit."""

from __future__ import annotations

from echo_plan.validation.megatron import validation_dir
from echo_plan.validation.predict import RowSimulator
from echo_plan.validation.registry import training_rows, training_suite
from echo_plan.validation.rows import read_step_times

SUITE = training_suite(validation_dir() / "bloom_jean_zay_a100.csv")


def test_rows_carry_the_bigscience_layouts():
    rows = training_rows(SUITE)
    assert len(rows) == 19 and all(r.gpus == 384 for r in rows)
    launch = [r for r in rows if r.source == "BigScience tr11 2022-03-18"]
    assert len(launch) == 1 and launch[0].measured == 105.22
    plan = launch[0].plan  # 70 layers over 12 stages, the tied embedding in the first and last stages' slots
    assert (plan["tp"], plan["pp"], plan["dp"], plan["micro_batch_size"]) == (4, 12, 8, 2)
    assert plan["layer_split"] == (5,) + (6,) * 10 + (5,)
    assert launch[0].model.num_attention_heads == 112 and launch[0].model.tied_embeddings
    assert sum(r.measured_peak_gib is not None for r in rows) == 17


def test_the_layouts_that_ran_out_of_memory_do_not_fit(tmp_path):
    """chronicles-prequel.md, "Rebalancing layers": OOM for 184B at DP 16 / TP 4 / PP 6 with micro-batch 2 and 1.
    (Its third, 206B at TP 4 / PP 12 with 128 heads, is predicted to fit: docs/validation.md says so.)"""
    header = [line for line in SUITE.path.read_text().splitlines() if line.startswith("model,")][0]
    cells = "{name},oom,{layers},{h},{ffn},{a},{a},250880,2048,gelu,layernorm,none,true,0.1,384,{tp},{pp},{mbs},2048," \
            "bf16,full,auto,true,,100"
    oom = [dict(name="bloom-184b", layers=100, h=12288, a=64, tp=4, pp=6, mbs=2),
           dict(name="bloom-184b", layers=100, h=12288, a=64, tp=4, pp=6, mbs=1)]
    path = tmp_path / "oom.csv"
    path.write_text("\n".join([header] + [cells.format(ffn=4 * c["h"], **c) for c in oom]) + "\n")
    sim = RowSimulator(SUITE.cluster, SUITE.stack)
    for row in read_step_times(path):
        prediction = sim.predict(row)
        assert prediction.memory is not None and not prediction.fits, row.label


def test_validate_shows_the_device_figure_it_compares_with_nvidia_smis():
    from echo_plan.commands.validate_cmd import memory_words
    from echo_plan.validation.predict import RowMemory
    from echo_plan.validation.results import RowResult

    cached = RowMemory(peak_gib=51.8, usable_gib=74.4, capacity_gib=80.0, reserved_gib=60.5, device_gib=62.2)
    row = RowResult("r", 1.0, 1.0, True, memory=cached, published_peak_gib=59.0)
    assert memory_words(row) == "51.8/74 GiB (published 59, device 62.2, +5%)"
    plain = RowMemory(peak_gib=51.8, usable_gib=74.4, capacity_gib=80.0, reserved_gib=50.0)
    assert memory_words(RowResult("r", 1.0, 1.0, True, memory=plain, published_peak_gib=59.0)) == \
        "51.8/74 GiB (published 59, -12%)"
