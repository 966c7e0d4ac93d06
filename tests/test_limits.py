"""Bounds on users' numbers: every field has a ceiling, and crossing it names the value."""

from __future__ import annotations

import pytest

from echo_plan import limits
from echo_plan.errors import SpecError
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster


def test_check_int_names_field_value_and_range():
    assert limits.check_int("--tp", 8, 1, 64) == 8
    for bad in (0, 65, True, 2.0, "8", 2**80):
        with pytest.raises(SpecError) as err:
            limits.check_int("--tp", bad, 1, 64, "tensor-parallel degree")
        assert "--tp" in str(err.value) and "1 to 64" in str(err.value)


def test_structure_problem_is_iterative():
    deep: list = []
    node = deep
    for _ in range(100_000):  # far past Python's recursion limit
        node.append([])
        node = node[0]
    assert "nested more than" in limits.structure_problem(deep)
    loop: list = []
    loop.append(loop)
    assert "nested more than" in limits.structure_problem(loop)
    assert limits.structure_problem({"a": [1, 2, {"b": 3}]}) is None


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 2**40), ("num_layers", 10**9), ("vocab_size", 10**12), ("seq_length", 2**30),
    ("num_attention_heads", 2**20),
])
def test_model_dimensions_have_ceilings(field, value):
    base = dict(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=16)
    with pytest.raises(SpecError, match=field):
        ModelSpec.build({**base, field: value})


def test_non_finite_hardware_figures_are_refused():
    cluster = load_cluster("h800")
    data = cluster.model_dump(mode="json")
    data["gpu"]["peak_bf16_tflops"] = float("inf")
    with pytest.raises(SpecError, match="finite"):
        type(cluster).build(data)


def test_plans_cannot_loop_without_limit():
    with pytest.raises(SpecError, match="micro-batches per step"):
        PlanSpec.build(dict(dp=1, micro_batch_size=1, global_batch_size=limits.MAX_MICROBATCHES + 1))
    with pytest.raises(SpecError, match="1 to 1,048,576"):
        load_cluster("h800", gpus=2**21)
