"""What the memory headroom is made of, measured on the GPU at hand (needs CUDA; prints a table).

``echo_plan/data/memory.yaml`` budgets memory that is neither model state nor activations: the CUDA
context with its cuBLAS/cuDNN workspaces (``cuda_context_GiB``) and the caching allocator's
fragmentation (``fragmentation_fraction``, a share of the activation memory). This script measures
both on one GPU:

- context: device memory in use (``torch.cuda.mem_get_info``) that PyTorch's allocator does not hold,
  after CUDA starts, after the first bf16 GEMM (cuBLAS handle and workspace) and after a fused
  attention forward and backward (SDPA);
- fragmentation: a Llama-style decoder (RMSNorm, GQA attention through SDPA, SwiGLU MLP; bf16) trains
  a few steps with AdamW; at the peak of a step, reserved minus allocated bytes over the step's
  activation bytes (the peak allocated minus what is allocated before the forward), with PyTorch's
  default allocator and with ``expandable_segments:True`` (each in a fresh process, as the setting
  must precede CUDA's start).

    python benchmarks/cuda_memory_probe.py            # on a machine with an NVIDIA GPU
    python benchmarks/cuda_memory_probe.py --json out.json

The decoder here is written for this probe (plain PyTorch modules, not the tracer's): it measures the
allocator, not echo-plan's activation model. ``--device cpu --tiny`` runs the model code on the CPU
to check it (no memory figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

GiB = 2**30

# (name, hidden, heads, kv heads, ffn, layers, seq, micro-batch): Llama 3 8B's layer shapes
CONFIGS = {
    "llama3-8b-4L-s8192-b1": (4096, 32, 8, 14336, 4, 8192, 1),
    "llama3-8b-6L-s4096-b2": (4096, 32, 8, 14336, 6, 4096, 2),
}
TINY = (64, 4, 2, 128, 2, 32, 2)


def _decoder(torch, hidden: int, heads: int, kv: int, ffn: int, layers: int, device: str):
    nn = torch.nn
    F = torch.nn.functional
    head_dim = hidden // heads

    class RMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def forward(self, x):
            var = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(var + 1e-5)).to(x.dtype) * self.weight

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = RMSNorm(), RMSNorm()
            self.qkv = nn.Linear(hidden, (heads + 2 * kv) * head_dim, bias=False)
            self.proj = nn.Linear(heads * head_dim, hidden, bias=False)
            self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
            self.fc2 = nn.Linear(ffn, hidden, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([heads * head_dim, kv * head_dim, kv * head_dim], dim=-1)
            q = q.view(b, s, heads, head_dim).transpose(1, 2)
            k = k.view(b, s, kv, head_dim).transpose(1, 2)
            v = v.view(b, s, kv, head_dim).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, heads * head_dim))
            gate, up = self.fc1(self.n2(x)).chunk(2, dim=-1)
            return x + self.fc2(F.silu(gate) * up)

    return nn.Sequential(*[Layer() for _ in range(layers)]).to(device=device, dtype=torch.bfloat16)


def fragmentation(config: tuple, device: str, steps: int = 4) -> dict:
    """Train the decoder ``steps`` steps; the last step's peak figures (bytes)."""
    import torch

    hidden, heads, kv, ffn, layers, seq, mbs = config
    torch.manual_seed(0)
    model = _decoder(torch, hidden, heads, kv, ffn, layers, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    x = torch.randn(mbs, seq, hidden, device=device, dtype=torch.bfloat16)
    out: dict = {}
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            peak_alloc = stats["allocated_bytes.all.peak"]
            peak_res = stats["reserved_bytes.all.peak"]
            out = {"before_forward": before, "peak_allocated": peak_alloc, "peak_reserved": peak_res,
                   "activations": peak_alloc - before, "reserved_minus_allocated": peak_res - peak_alloc,
                   "fragmentation_fraction": (peak_res - peak_alloc) / max(1, peak_alloc - before)}
        opt.step()
        opt.zero_grad(set_to_none=True)
    if not out:
        out = {"loss": float(loss)}
    return out


def context() -> dict:
    """Device memory in use outside PyTorch's allocator at three points (bytes)."""
    import torch
    import torch.nn.functional as F

    def outside() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) - torch.cuda.memory_reserved()

    torch.zeros(1, device="cuda")
    got = {"after_init": outside()}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    got["after_first_gemm"] = outside()
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    o.sum().backward()
    got["after_attention"] = outside()
    got["device"] = torch.cuda.get_device_name(0)
    got["torch"] = torch.__version__
    got["cuda"] = torch.version.cuda
    return got


def _child(name: str) -> None:
    config = CONFIGS[name]
    print(json.dumps(fragmentation(config, "cuda")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny decoder (checks the code on the CPU)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    import torch

    if args.device == "cpu":
        print(json.dumps(fragmentation(TINY, "cpu", steps=2)))
        return 0
    if not torch.cuda.is_available():
        print("cuda_memory_probe: no CUDA GPU on this machine; nothing measured", file=sys.stderr)
        return 0
    result: dict = {"context": context(), "fragmentation": {}}
    for name in CONFIGS:
        for alloc in ("default", "expandable_segments:True"):
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            if alloc != "default":
                env["PYTORCH_CUDA_ALLOC_CONF"] = alloc
            run = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True,
                                 text=True, timeout=300)
            if run.returncode != 0:
                result["fragmentation"][f"{name} {alloc}"] = {"error": run.stderr.strip().splitlines()[-1:]}
                continue
            result["fragmentation"][f"{name} {alloc}"] = json.loads(run.stdout.strip().splitlines()[-1])
    ctx = result["context"]
    print(f"{ctx['device']}  torch {ctx['torch']}  CUDA {ctx['cuda']}")
    print("memory outside the caching allocator (GiB): "
          + ", ".join(f"{k} {v / GiB:.3f}" for k, v in ctx.items() if isinstance(v, int)))
    print(f"{'decoder, allocator':48s} {'activ GiB':>9s} {'peak GiB':>9s} {'resv GiB':>9s} {'frag':>6s}")
    for key, f in result["fragmentation"].items():
        if "error" in f:
            print(f"{key:48s} error: {f['error']}")
            continue
        print(f"{key:48s} {f['activations'] / GiB:9.2f} {f['peak_allocated'] / GiB:9.2f} "
              f"{f['peak_reserved'] / GiB:9.2f} {f['fragmentation_fraction']:6.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
