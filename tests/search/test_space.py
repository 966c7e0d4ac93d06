"""Search-space files: the shipped ones load, and every kind of mistake gets a precise error."""

from __future__ import annotations

import pytest

from echo_plan.errors import FileFormatError, SpecError
from echo_plan.search.space import Knob, load_space, space_from_mapping, spaces_dir


def test_shipped_spaces_load_and_enumerate_their_size():
    for name in ("default", "narrow-example", "moe", "long-context", "fsdp", "fsdp-long-context"):
        space = load_space(spaces_dir() / f"{name}.yaml")
        combos = list(space.combos())
        assert len(combos) == space.size
        assert len({tuple(c.values()) for c in combos}) == space.size  # no repeats
        assert all(set(c) == {k.value for k in Knob} for c in combos)


def test_the_default_space_follows_the_model_the_sequence_and_the_stack():
    """A stack that shards parameters gets the FSDP spaces, with context parallelism above 16K tokens; its plans
    shard parameters there too (the long-context space is Megatron's)."""
    from echo_plan.search.space import default_space_path_for
    from echo_plan.specs import load_model, load_stack

    dense, tt, mc = load_model("llama3-8b"), load_stack("torchtitan"), load_stack("megatron-core")
    long = dense.replace(seq_length=65536)
    picked = {(m.seq_length, s.name): default_space_path_for(m, s).stem for m in (dense, long) for s in (tt, mc)}
    assert picked == {(8192, "torchtitan"): "fsdp", (8192, "megatron-core"): "default",
                      (65536, "torchtitan"): "fsdp-long-context", (65536, "megatron-core"): "long-context"}
    assert default_space_path_for(load_model("mixtral-8x7b"), tt).stem == "moe"
    space = load_space(spaces_dir() / "fsdp-long-context.yaml")
    assert space.values(Knob.SHARDING) == ("parameters",) and len(space.values(Knob.CP)) > 1


def test_narrow_example_is_inside_the_default_space():
    default, narrow = load_space(), load_space(spaces_dir() / "narrow-example.yaml")
    for knob, values in narrow.knobs:
        assert set(values) <= set(default.values(knob)), knob


def test_bare_name_finds_a_shipped_space():
    assert load_space("narrow-example").name == "narrow-example"


def test_digest_ignores_name_and_follows_content():
    a = space_from_mapping({"name": "a", "knobs": {"tp": [1, 2]}})
    b = space_from_mapping({"name": "b", "knobs": {"tp": [1, 2]}})
    c = space_from_mapping({"name": "a", "knobs": {"tp": [1, 4]}})
    assert a.digest() == b.digest() != c.digest()


@pytest.mark.parametrize("data, field, words", [
    ({"knobs": {"tensor_parallel": [1, 2]}}, "knobs.tensor_parallel", "valid knobs: tp, pp"),
    ({"knobs": {"tp": []}}, "knobs.tp", "non-empty"),
    ({"knobs": {"tp": [0, 2]}}, "knobs.tp", "positive integers"),
    ({"knobs": {"pp": [1.5]}}, "knobs.pp", "positive integers"),
    ({"knobs": {"recompute": ["partial"]}}, "knobs.recompute", "none, selective, full"),
    ({"knobs": {"schedule": ["zero-bubble"]}}, "knobs.schedule", "gpipe, 1f1b, interleaved"),
    ({"knobs": {"sequence_parallel": ["yes please"]}}, "knobs.sequence_parallel", "true or false"),
    ({"knobs": {"dp": [1, 2]}}, "knobs.dp", "implied"),
    ({"fixed": {"global_batch_size": 8}}, "fixed.global_batch_size", "--gbs"),
    ({"knobs": {"tp": [1]}, "fixed": {"tp": 2}}, "fixed.tp", "one place"),
    ({"fixed": {"dtype": "fp32"}}, "fixed.dtype", "bf16, fp16, fp8"),
    ({"knobs": {"dtype": ["bf16", "int8"]}}, "knobs.dtype", "bf16, fp16, fp8"),
    ({"constraints": {"tp_within_rack": True}}, "constraints.tp_within_rack", "tp_within_node"),
])
def test_bad_spaces_name_the_knob_and_what_is_valid(data, field, words):
    with pytest.raises(SpecError) as err:
        space_from_mapping(data, source="s.yaml")
    assert err.value.field == field
    assert words in str(err.value)
    assert "s.yaml" in str(err.value)


def test_unknown_top_level_key_is_a_file_error():
    with pytest.raises(FileFormatError, match="unknown top-level key 'knob'"):
        space_from_mapping({"knob": {"tp": [1]}}, source="s.yaml")


def test_malformed_yaml_reports_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("knobs:\n  tp: [1, 2\n  pp: [1]\n")
    with pytest.raises(FileFormatError) as err:
        load_space(p)
    assert err.value.line is not None and err.value.line >= 2


def test_missing_knobs_take_plan_defaults():
    space = space_from_mapping({"knobs": {"tp": [1, 2]}})
    assert space.values(Knob.PP) == (1,)
    assert space.values(Knob.OVERLAP_GRAD_REDUCE) == (True,)
    assert space.varying == (Knob.TP,)
