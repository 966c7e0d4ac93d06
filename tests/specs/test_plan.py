import pytest

from echo_plan.errors import SpecError
from echo_plan.specs import PlanSpec, Recompute, Schedule, load_cluster, load_model, validate_plan


def plan(**kw):
    base = dict(tp=8, pp=8, dp=16, micro_batch_size=1, global_batch_size=1536)
    base.update(kw)
    return PlanSpec.build(base)


def test_valid_gpt3_plan_on_1024_gpus():
    p = plan()
    validate_plan(p, load_model("gpt3-175b"), load_cluster("h800", gpus=1024))
    assert p.num_microbatches == 96 and p.world_size == 1024


def test_vpp_implies_interleaved():
    assert plan(virtual_stages=2).schedule is Schedule.INTERLEAVED


def test_global_batch_must_divide():
    with pytest.raises(SpecError) as err:
        plan(global_batch_size=1000)
    assert "global_batch_size" in str(err.value) and "16" in str(err.value)


@pytest.mark.parametrize(
    "kw,gpus,needle",
    [
        (dict(tp=5, pp=1, dp=1, global_batch_size=5), 5, "num_attention_heads"),
        (dict(tp=8, pp=8, dp=8), 1024, "1024"),
        (dict(tp=1, pp=128, dp=8, global_batch_size=8), 1024, "num_layers"),
        (dict(tp=8, pp=5, dp=1, global_batch_size=5), 40, "num_layers"),
    ],
)
def test_impossible_plans_name_the_problem(kw, gpus, needle):
    model = load_model("gpt3-175b")
    cluster = load_cluster("h800", gpus=gpus) if gpus >= 8 else load_cluster("h800", gpus=gpus)
    with pytest.raises(SpecError) as err:
        validate_plan(plan(**kw), model, cluster)
    assert needle in str(err.value)


def test_tp_must_divide_kv_heads():
    model = load_model("llama3-70b")  # 64 heads, 8 kv heads
    with pytest.raises(SpecError) as err:
        validate_plan(plan(tp=16, pp=4, dp=16), model, load_cluster("h800", gpus=1024))
    assert "kv" in str(err.value) or "heads" in str(err.value)


def test_layer_split_rules():
    model = load_model("gpt-13b")
    cluster = load_cluster("h800", gpus=16)
    p = plan(tp=8, pp=2, dp=1, global_batch_size=8, layer_split=(19, 21))
    validate_plan(p, model, cluster)
    assert p.stage_layers(40) == (19, 21)
    with pytest.raises(SpecError):
        validate_plan(plan(tp=8, pp=2, dp=1, global_batch_size=8, layer_split=(20, 21)), model, cluster)


def test_interleaving_needs_microbatches_multiple_of_pp():
    with pytest.raises(SpecError) as err:
        validate_plan(plan(pp=8, dp=16, virtual_stages=2, global_batch_size=16 * 12),
                      load_model("gpt3-175b"), load_cluster("h800", gpus=1024))
    assert "micro-batches" in str(err.value)


def test_fields_are_enums_and_frozen():
    p = plan(recompute="selective")
    assert p.recompute is Recompute.SELECTIVE
    with pytest.raises(Exception):
        p.tp = 4  # frozen
