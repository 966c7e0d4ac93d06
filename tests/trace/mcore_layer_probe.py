"""Run one transformer layer of Megatron-Core itself on CPU, forward and backward, and print its GEMMs
as JSON (issue 36's conformance check; run by tests/trace/test_megatron_core_conformance.py in a
process of its own, so that Megatron-Core's global state never meets the rest of the suite).

The layer is Megatron-Core's own ``TransformerLayer`` from its local (non-Transformer-Engine) GPT
spec, on tensor-parallel rank 0 of ``tp``: the process group is PyTorch's fake backend (collectives
return at once; their calls and sizes are recorded). Three calls of Megatron-Core 0.16 assume CUDA and
are replaced by CPU stand-ins, each doing what the original does on a GPU (listed in STAND_INS and
printed):

* ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``: the current device
  is answered as the CPU;
* ``transformer.utils.get_default_causal_mask`` builds the causal mask with ``device="cuda"``: the
  same mask on the CPU;
* ``tensor_parallel.get_cuda_rng_tracker().fork()`` switches CUDA RNG states around dropout: a
  tracker whose fork changes nothing (dropout is 0 here);
* MoE: ``moe_utils`` tests ``te_general_gemm``, a name it defines only when Transformer Engine
  imports (a NameError without it): set to None, the router's plain GEMM path. The all-to-all
  dispatcher's constructor makes a ``torch.cuda.Stream``: not run here (the all-gather one is).

Usage: python mcore_layer_probe.py '{"hidden": 1024, "heads": 16, "ffn": 4096, "seq": 512, "mbs": 2,
"gated": true, "norm": "RMSNorm", "bias": false}'
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings

STAND_INS = ("torch.cuda.current_device -> cpu (GlobalMemoryBuffer.get_tensor)",
             "random._get_cuda_rng_state -> the CPU's, random._set_cuda_rng_state -> nothing (recompute's checkpoint)",
             "random.FP8GlobalStateManager -> FP8 off (CheckpointWithoutOutput tests `fp8 is not None`, true for False)",
             "fused_softmax.get_default_causal_mask -> the same mask on the CPU",
             "tensor_parallel.get_cuda_rng_tracker -> a tracker whose fork() changes nothing",
             "moe_utils.te_general_gemm -> None (0.16's router names it only when Transformer Engine imports)")


def main(cfg: dict) -> dict:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.current_device = lambda: torch.device("cpu")
    tp = int(cfg.get("tp", 1))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)  # rank 0; the fake backend answers for the others
    from megatron.core import parallel_state
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.core.transformer.dot_product_attention as dot_product_attention
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    class NoTracker:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()

        def get_states(self):
            return {}

        def set_states(self, states):
            pass

    # Megatron-Core's checkpoint saves and restores the CUDA RNG state around the recomputed region
    class NoFp8:  # what Transformer Engine's FP8 state says when FP8 is off
        is_fp8_enabled = staticmethod(lambda: False)
        get_fp8_recipe = staticmethod(lambda: None)

    tp_random.FP8GlobalStateManager = NoFp8  # CheckpointWithoutOutput asks it even in bf16 (`fp8 is not None`)
    for name in ("activation_recompute_forward", "fp8_autocast"):  # Transformer Engine's, FP8 off: no context
        if not hasattr(tp_random, name):
            setattr(tp_random, name, lambda **k: contextlib.nullcontext())
    tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda *a, **k: None

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker = lambda *a, **k: NoTracker()
    dot_product_attention.tensor_parallel.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(tp, 1, create_gloo_process_groups=False)
    gated = bool(cfg["gated"])
    modules = cfg.get("recompute_modules")
    recompute = dict(recompute_granularity="selective", recompute_modules=list(modules)) if modules else {}
    experts = int(cfg.get("experts", 0))
    moe = dict(num_moe_experts=experts, moe_router_topk=int(cfg["topk"]), moe_ffn_hidden_size=cfg["ffn"],
               moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
               moe_aux_loss_coeff=0.0) if experts else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=cfg["hidden"], num_attention_heads=cfg["heads"],
        num_query_groups=cfg.get("kv_heads"), ffn_hidden_size=cfg["ffn"], bf16=True,
        params_dtype=torch.bfloat16, use_cpu_initialization=True, add_bias_linear=bool(cfg["bias"]),
        gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu, normalization=cfg["norm"],
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, tensor_model_parallel_size=tp,
        gradient_accumulation_fusion=False, **moe, **recompute)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False, normalization=cfg["norm"])
    layer = build_module(spec, config=config, layer_number=1)

    class Gemms(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple[str, int]] = []
            self.collectives: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name, shapes = str(func), [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            if name.startswith("c10d."):  # the buffer in nccl-tests' size convention (see CollectiveInfo)
                flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                        if isinstance(t, torch.Tensor)]
                kind = name.split(".")[1].strip("_").replace("_base", "").replace("allreduce", "all_reduce")
                kind = kind.replace("allgather", "all_gather")
                size = max(t.numel() * t.element_size() for t in flat)
                self.collectives.append((kind, size))
            if name == "aten.mm.default":
                (m, k), (_, n) = shapes[0], shapes[1]
                self.ops.append((name, 2 * m * k * n))
            elif name in ("aten.bmm.default", "aten.baddbmm.default"):
                (b, m, k), (_, _, n) = shapes[-2], shapes[-1]
                self.ops.append((name, 2 * b * m * k * n))
            return func(*args, **(kwargs or {}))

    x = torch.randn(cfg["seq"], cfg["mbs"], cfg["hidden"], dtype=torch.bfloat16, requires_grad=True)
    rec = Gemms()
    fixed = {t.untyped_storage()._cdata for t in list(layer.parameters()) + list(layer.buffers())}
    saved: dict[int, int] = {}  # the distinct storages autograd keeps for backward (parameters aside)

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in fixed:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with rec:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = layer(x, attention_mask=None)
        out.float().sum().backward()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"params": sum(p.numel() for p in layer.parameters()), "gemm_ops": len(rec.ops),
            "gemm_flops": sum(f for _, f in rec.ops), "collectives": sorted(rec.collectives),
            "saved_bytes": sum(saved.values()),
            "stand_ins": list(STAND_INS)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
