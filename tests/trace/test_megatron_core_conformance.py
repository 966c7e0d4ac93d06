"""The traced layer beside Megatron-Core's own (issue 36, a first slice): a dense GPT/Llama layer on
tensor-parallel rank 0 of TP 1, 2 and 4 (no sequence parallelism: Megatron-Core's local spec uses torch's
norm, which refuses it), built from Megatron-Core's local spec and run on CPU under PyTorch's fake
process group (``mcore_layer_probe.py``: three CUDA-only calls replaced, listed there), against
``trace_stage`` of the same shape with the same kernels (unfused attention, no dropout, no recompute).
Exact: GEMM count and FLOPs (forward and backward), the rank's parameters, and its collectives (kind
and bytes). Runs where megatron-core is installed (the ``frameworks`` extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from echo_plan.cost.memory import layer_params_per_rank
from echo_plan.specs import ModelSpec, load_stack
from echo_plan.specs.cluster import DType
from echo_plan.specs.plan import Recompute
from echo_plan.trace.records import OpKind, StageKind
from echo_plan.trace.tracer import trace_stage

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[frameworks]')")

PROBE = Path(__file__).with_name("mcore_layer_probe.py")
SHAPES = {
    "llama-like": dict(hidden=1024, heads=16, kv_heads=4, ffn=2816, seq=512, mbs=2, gated=True, norm="RMSNorm",
                       bias=False),
    "gpt-like": dict(hidden=768, heads=12, kv_heads=None, ffn=3072, seq=256, mbs=4, gated=False, norm="LayerNorm",
                     bias=True),
}


def _ours(s: dict, tp: int):
    model = ModelSpec(name="probe", num_layers=1, hidden_size=s["hidden"], num_attention_heads=s["heads"],
                      num_kv_heads=s["kv_heads"], ffn_hidden_size=s["ffn"], vocab_size=1024, seq_length=s["seq"],
                      activation="swiglu" if s["gated"] else "gelu",
                      norm="rmsnorm" if s["norm"] == "RMSNorm" else "layernorm",
                      position_embedding="rotary" if s["gated"] else "learned", bias=s["bias"])
    stack = load_stack("megatron-core").replace(attention="unfused", hidden_dropout=0.0, attention_dropout=0.0)
    stack = stack.replace(tp_comm_overlap=False)
    trace = trace_stage(model, StageKind.BLOCK, tp=tp, sequence_parallel=False, micro_batch_size=s["mbs"],
                        dtype=DType.BF16, recompute=Recompute.NONE, stack=stack)
    collectives = sorted((op.collective.kind.value, op.collective.nbytes) for op in trace.ops if op.collective)
    return model, [op for op in trace.ops if op.kind is OpKind.GEMM], collectives


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_gemms_parameters_and_collectives_equal_megatron_cores_own_layer(name, tp):
    s = SHAPES[name]
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps({**s, "tp": tp})], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    model, gemms, collectives = _ours(s, tp)
    assert len(gemms) == theirs["gemm_ops"]
    assert sum(op.flops for op in gemms) == theirs["gemm_flops"]  # exact: the same matrix shapes
    assert layer_params_per_rank(model, tp) == theirs["params"]
    assert collectives == [tuple(c) for c in theirs["collectives"]]  # TP all-reduces: kind and bytes
