"""Ex-situ tracing against the GPU: the activation bytes a layer's trace counts (made here, on the CPU under
fake tensors) equal what the same module code held on an H100 after its forward (dense layers of Llama 3 8B
and Llama 2 13B, the MoE layers of Qwen3-30B-A3B and Mixtral 8x7B with every expert local)
(``benchmarks/insitu_block_memory.py``, ``data/measured/h100_sxm5/insitu_*.json``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import echo_plan
from echo_plan.specs import DType, Recompute, load_model, load_stack
from echo_plan.specs.moe import ExpertLayout, LayerKind
from echo_plan.trace.records import StageKind
from echo_plan.trace.tracer import trace_stage

MEASURED = Path(echo_plan.__file__).parent / "data" / "measured" / "h100_sxm5"
CASES = [(path.name, row) for path in sorted(MEASURED.glob("insitu_*.json"))
         for row in json.loads(path.read_text())["rows"]]


def test_the_measurements_are_there():
    assert len(CASES) >= 20
    assert {r["recompute"] for _, r in CASES} == {"none", "selective", "full"}


@pytest.mark.parametrize("name,row", CASES, ids=[f"{n}-{r['stack']}-{r['recompute']}" for n, r in CASES])
def test_traced_saved_bytes_equal_what_the_gpu_held(name, row):
    model = load_model(json.loads((MEASURED / name).read_text())["model"])
    moe = {"kind": LayerKind(moe=True), "layout": ExpertLayout(ep=1, etp=1)} if model.is_moe else {}  # every expert local
    traced = trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1,
                         dtype=DType.BF16, recompute=Recompute(row["recompute"]), stack=load_stack(row["stack"]), **moe)
    assert traced.saved_bytes == row["in_situ_bytes"]
