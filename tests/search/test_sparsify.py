"""Sparse data-parallel exchanges through simulate, sparsify and the CLI."""

from __future__ import annotations

import json

import pytest

from echo_plan.cli import main
from echo_plan.search.sparsify import analyse
from echo_plan.simulate import SimulationMemo, simulate
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster
from echo_plan.specs.plan import DpComm

MODEL = ModelSpec(name="gpt-sparse", num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)


@pytest.fixture(scope="module")
def memo():
    return SimulationMemo()


def _step(gpus, memo):
    cluster = load_cluster("h800", gpus=gpus)
    return lambda plan: simulate(MODEL, cluster, plan, memo=memo)


@pytest.mark.parametrize("method", [m for m in DpComm if m.sparse])
def test_a_sparse_step_at_density_one_is_never_faster_than_dense(memo, method):
    step = _step(32, memo)
    dense = step(PlanSpec(dp=32, global_batch_size=32)).step_time_s
    sparse = step(PlanSpec(dp=32, global_batch_size=32, dp_comm=method.value, density=1.0))
    assert sparse.step_time_s >= dense
    ex = sparse.dp_exchange
    assert ex["method"] == method.value and ex["select_s"] > 0 and ex["value_exchange_s"] > 0
    assert sparse.breakdown.total_s == pytest.approx(sparse.step_time_s, rel=1e-9)


def test_topk_break_even_falls_with_workers_and_exdyna_holds(memo):
    be = {}
    for gpus in (16, 128):
        _, curves = analyse(PlanSpec(dp=gpus, global_batch_size=gpus), _step(gpus, memo), (0.01,),
                            methods=(DpComm.TOPK, DpComm.EXDYNA))
        be[gpus] = {c.method: c.break_even_density for c in curves}
    assert be[128][DpComm.TOPK] < be[16][DpComm.TOPK] / 2
    assert be[128][DpComm.EXDYNA] == pytest.approx(be[16][DpComm.EXDYNA], rel=0.5)


def _model_file(tmp_path) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps(MODEL.model_dump(mode="json")))
    return str(path)


def test_sparsify_json_names_every_method(tmp_path, capsys):
    code = main(["sparsify", "--model", _model_file(tmp_path), "--gpus", "16", "--densities", "0.01,0.1", "--json",
                 "--cache-dir", str(tmp_path / "c")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and set(out["methods"]) == {"topk", "cltk", "hard-threshold", "exdyna"}
    for m in out["methods"].values():
        d = m["break_even_density"]
        assert d is None or 0 < d <= 1
        assert [p["density"] for p in m["step_time_s_by_density"]] == [0.01, 0.1]
    assert "convergence" in out["not_modelled"]


@pytest.mark.parametrize("args, says", [
    (["--dp-comm", "topk", "--density", "0"], "density=0.0 is invalid"),
    (["--dp-comm", "topk", "--density", "-0.5"], "density=-0.5 is invalid"),
    (["--dp-comm", "topk", "--density", "1.5"], "density=1.5 is invalid"),
    (["--dp-comm", "gossip", "--density", "0.1"], "--dp-comm='gossip' is invalid: one of dense, topk"),
    (["--dp-comm", "exdyna"], "needs --density"),
    (["--dp-comm", "topk", "--density", "0.1", "--distributed-optimizer"], "distributed optimizer"),
])
def test_bad_sparsification_inputs_are_one_line_errors(tmp_path, capsys, args, says):
    code = main(["simulate", "--model", _model_file(tmp_path), "--gpus", "16", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and "\n" not in err and "Traceback" not in err
