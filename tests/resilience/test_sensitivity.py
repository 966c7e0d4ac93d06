"""Fault sensitivity: the whatif command and the report section."""

from __future__ import annotations

import json

from echo_plan.cli import main
from echo_plan.specs import ModelSpec

MODEL = ModelSpec(name="gpt-sens", num_layers=8, hidden_size=1024, num_attention_heads=16, vocab_size=8192,
                  seq_length=512)


def test_whatif_sensitivity_losses_grow_with_severity(tmp_path, capsys):
    model = tmp_path / "m.json"
    model.write_text(MODEL.model_dump_json())
    code = main(["whatif", "sensitivity", "--model", str(model), "--gpus", "32", "--tp", "2", "--pp", "4",
                 "--sequence-parallel", "--json", "--cache-dir", str(tmp_path / "c")])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["healthy_step_time_s"] > 0
    by_kind: dict = {}
    for r in out["rows"]:
        assert 0 <= r["best_loss"] <= r["worst_loss"] < 1
        by_kind.setdefault(r["kind"], []).append(r)
    assert set(by_kind) == {"straggler", "link", "nvlink", "node"}
    for kind, rows in by_kind.items():
        severe = sorted(rows, key=lambda r: r["severity"], reverse=kind in ("link", "nvlink"))
        losses = [r["worst_loss"] for r in severe]
        assert losses == sorted(losses), kind

