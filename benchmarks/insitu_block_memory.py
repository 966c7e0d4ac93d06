"""Ex-situ against in-situ: the activation bytes the tracer counts for a transformer layer, and what the
same module code holds on a real GPU (needs CUDA for the figures; prints a table).

The tracer builds a layer under FakeTensorMode and counts the bytes autograd saves for backward
(``trace/capture.py``). Here the same ``TransformerBlock`` (tensor parallelism 1, so no collectives) is
built with real tensors on the GPU and run forward and backward on one micro-batch: the caching
allocator's figures say what the layer really held. For each stack and recompute mode:

- traced: the trace's saved bytes (``trace_stage(...).saved_bytes``, made on the CPU under fake tensors);
- in situ: allocated bytes after the forward, less those before it and less the layer's output (which
  the next layer would own), plus the layer's input (allocated before, and saved by every recompute mode:
  by the first norm, or by the checkpoint);
- forward peak and backward peak over the bytes allocated before the forward.

The tracer's own fused kernels run their reference implementations here (the same outputs and saved
tensors; their transient work buffers are not the fused kernels'), so the peaks are an upper bound of a
fused run's; the held-after-forward bytes are what the comparison is about.

    python benchmarks/insitu_block_memory.py                  # on a machine with an NVIDIA GPU
    python benchmarks/insitu_block_memory.py --device cpu --tiny   # checks the code path on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_plan.specs import DType, ModelSpec, Recompute, load_model, load_stack  # noqa: E402
from echo_plan.trace.records import StageKind  # noqa: E402
from echo_plan.trace.tracer import trace_stage  # noqa: E402

MiB = 2**20
TINY = {"name": "tiny", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2,
        "vocab_size": 128, "seq_length": 32, "activation": "swiglu", "norm": "rmsnorm",
        "position_embedding": "rotary", "tied_embeddings": False}
CASES = [("megatron-core", "none"), ("megatron-core", "selective"), ("megatron-core", "full"),
         ("torchtitan", "none"), ("torchtitan", "full")]


def layer_kind(model: ModelSpec) -> tuple:
    """The layer traced: an MoE model's MoE layer with every expert local (ep 1), else the dense layer."""
    from echo_plan.specs.moe import DENSE, ExpertLayout, LayerKind

    if model.moe is None:
        return DENSE, None
    return LayerKind(moe=True), ExpertLayout(ep=1, etp=1)


def _active_blocks(snapshot: dict) -> dict[int, dict]:
    return {b["address"]: b for seg in snapshot["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"}


def _where(block: dict) -> str:
    """The innermost echo_plan frame that allocated a block (the memory history's stack)."""
    for f in block.get("frames", []):
        if "echo_plan" in f.get("filename", ""):
            return f"{f['filename'].split('echo_plan/')[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def in_situ(model: ModelSpec, stack_name: str, recompute: Recompute, device: str, mbs: int,
            explain: bool = False) -> dict:
    import torch

    from echo_plan.trace.moe import MoELayer

    stack = load_stack(stack_name)
    kind, layout = layer_kind(model)

    copies = MoELayer._copies  # the tracer routes with index tensors whose values it never reads (balanced routing
    if kind.moe:  # by shape); real tensors need real indices: the copies spread evenly over the rows, while measured
        MoELayer._copies = lambda self, like, n: torch.arange(n, device=like.device) % max(1, like.shape[0])
    try:
        return _run_layer(model, stack, stack_name, recompute, device, mbs, explain, kind, layout)
    finally:
        MoELayer._copies = copies


def _run_layer(model, stack, stack_name, recompute, device, mbs, explain, kind, layout) -> dict:
    import torch

    from echo_plan.trace.capture import SavedBytesMeter, _build, _fixed_storages
    from echo_plan.trace.fake_pg import fake_groups

    cuda = device == "cuda"
    torch.manual_seed(0)
    with torch.device(device), fake_groups(1) as groups:
        meter = SavedBytesMeter(set())
        block = _build(StageKind.BLOCK, model, groups, False, torch.bfloat16, recompute, stack, nullcontext, meter,
                       kind, layout)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        x = (torch.randn(model.seq_length, mbs, model.hidden_size, dtype=torch.bfloat16) * 0.1).requires_grad_(True)
        meter.exclude |= _fixed_storages(block)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        explaining = explain and cuda
        if explaining:  # which blocks the forward leaves allocated that no saved tensor owns
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            before = set(_active_blocks(torch.cuda.memory._snapshot()))
            saved_ptrs: set[int] = set()
            pack = meter._pack
            meter._pack = lambda t: (saved_ptrs.add(t.untyped_storage().data_ptr()), pack(t))[1]
        with meter.measuring():
            out = block(x)
        out_bytes = out.numel() * out.element_size()
        got = {"stack": stack_name, "recompute": recompute.value, "meter_bytes": meter.total}
        if explaining:
            after = _active_blocks(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
            owned = saved_ptrs | {out.untyped_storage().data_ptr()}
            got["unsaved_blocks"] = [{"bytes": b["size"], "allocated_at": _where(b)} for a, b in sorted(after.items())
                                     if a not in before and a not in owned]
        if cuda:
            torch.cuda.synchronize()
            got["held_after_forward"] = torch.cuda.memory_allocated() - base - out_bytes
            got["in_situ_bytes"] = got["held_after_forward"] + x.numel() * x.element_size()
            got["forward_peak"] = torch.cuda.max_memory_allocated() - base
            torch.cuda.reset_peak_memory_stats()
        out.backward(torch.randn_like(out) * 0.01)
        if cuda:
            torch.cuda.synchronize()
            got["backward_peak"] = torch.cuda.max_memory_allocated() - base
        del block, out, x
        if cuda:
            torch.cuda.empty_cache()
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the code path)")
    parser.add_argument("--tiny-moe", action="store_true", help="a tiny mixture-of-experts model (checks the code path)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--explain", action="store_true",
                        help="list the blocks the forward leaves allocated that no saved tensor owns (CUDA)")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("insitu_block_memory: no CUDA GPU on this machine; nothing measured", file=sys.stderr)
        return 0
    model = (ModelSpec.build(TINY) if args.tiny else
             ModelSpec.build({**TINY, "name": "tiny-moe", "moe": {"num_experts": 4, "top_k": 2,
                                                                 "expert_ffn_hidden_size": 32}}) if args.tiny_moe
             else load_model(args.model))
    if args.device == "cuda":  # cuBLAS takes its workspace (32 MiB on an H100) from the caching allocator at the
        a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)  # process's first GEMM: before, not inside,
        (a @ a).sum().item()  # the first layer measured (seen: "32.0 MiB ... owned by no saved tensor: linear")
    rows = []
    for stack_name, mode in CASES:
        recompute = Recompute(mode)
        kind, layout = layer_kind(model)
        traced = trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=args.mbs,
                             dtype=DType.BF16, recompute=recompute, stack=load_stack(stack_name), kind=kind,
                             layout=layout)
        got = in_situ(model, stack_name, recompute, args.device, args.mbs, args.explain)
        got["traced_bytes"] = traced.saved_bytes
        rows.append(got)
        print(json.dumps(got), file=sys.stderr)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"{model.name} layer, seq {model.seq_length}, mbs {args.mbs}, tp 1, bf16 on {device} (torch {torch.__version__})")
    print(f"{'stack':14s} {'recompute':10s} {'traced MiB':>10s} {'in situ':>9s} {'situ/traced':>11s} "
          f"{'fwd peak':>9s} {'bwd peak':>9s}")
    for r in rows:
        held = r.get("in_situ_bytes")
        ratio = f"{held / r['traced_bytes']:11.3f}" if held is not None and r["traced_bytes"] else f"{'-':>11s}"
        cells = [f"{r[k] / MiB:9.1f}" if k in r else f"{'-':>9s}" for k in ("in_situ_bytes", "forward_peak",
                                                                              "backward_peak")]
        print(f"{r['stack']:14s} {r['recompute']:10s} {r['traced_bytes'] / MiB:10.1f} {cells[0]} {ratio} {cells[1]} {cells[2]}")
    for r in rows:
        for b in r.get("unsaved_blocks", []):
            print(f"  {r['stack']} {r['recompute']}: {b['bytes'] / MiB:.1f} MiB allocated in the forward, owned by no "
                  f"saved tensor: {b['allocated_at']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "torch": torch.__version__, "model": model.name,
                                               "mbs": args.mbs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
