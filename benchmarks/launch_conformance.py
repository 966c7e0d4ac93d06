"""Megatron-LM's own argument parser on the commands ``export launch --format megatron-lm`` writes.

Megatron-LM's ``megatron/training`` is not on the package index (Megatron-Core's wheel lacks it), so
the test suite checks exports with Megatron-Core's config classes; this script runs the real parser
(``parse_args`` and ``validate_args``) where a Megatron-LM checkout is at hand:

    git clone --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /path/to/Megatron-LM
    pip install six regex sentencepiece tiktoken einops   # what megatron/training imports
    python benchmarks/launch_conformance.py --megatron-lm /path/to/Megatron-LM

It exports every Megatron-runnable plan of the test suite's four searches (the README's GPT-3, an
MoE, a long-context and an FP8 one; ``--every N`` samples one in N) and DeepSeek-V3's recipe, sets
the environment each export names, parses and validates, and prints how many Megatron-LM accepted
and the first refusals. The GPU queries ``validate_args`` makes (device capability) are answered as
an H800's; nothing else is changed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def exported_commands(every: int) -> list[tuple[str, str, object]]:
    sys.path.insert(0, str(ROOT))
    from tests.interop.launch_searches import SEARCHES, STACK, _search_plans  # the test suite's searches

    from echo_plan.interop.launch import CannotExpress, LaunchFormat, export_launch
    from echo_plan.specs import PlanSpec, load_cluster, load_model, load_stack

    out = []
    for name in sorted(SEARCHES):
        model, cluster, plans = _search_plans(*SEARCHES[name])
        for plan in plans[::every]:
            try:
                out.append((f"{name}: {plan.short()}",
                            export_launch(LaunchFormat.MEGATRON_LM, model, plan, STACK, cluster).text, plan))
            except CannotExpress:
                pass
    deepseek = PlanSpec(pp=16, dp=128, ep=64, global_batch_size=15360, distributed_optimizer=True, recompute="selective",
                        layer_split=(3,) + (4,) * 14 + (2,), dtype="fp8")
    stack = load_stack("deepseek-v3").replace(moe_act_input_fp8=False)
    out.append(("deepseek-v3 recipe", export_launch(LaunchFormat.MEGATRON_LM, load_model("deepseek-v3"), deepseek,
                                                    stack, load_cluster("h800", gpus=2048)).text, deepseek))
    return out


def check(label: str, text: str, plan, parse_args, validate_args) -> str | None:  # noqa: ANN001
    """None when Megatron-LM parses and validates the command into the plan's own settings, else what differs."""
    joined = text.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if "pretrain_gpt.py" in ln)
    launcher, _, rest = line.partition("pretrain_gpt.py")
    words = shlex.split(launcher)
    nodes, per_node = int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc-per-node") + 1])
    env = dict(ln[len("export "):].split("=", 1) for ln in joined.splitlines() if ln.startswith("export "))
    os.environ.update(env, WORLD_SIZE=str(nodes * per_node), RANK="0", LOCAL_RANK="0")
    sys.argv = ["pretrain_gpt.py"] + shlex.split(rest)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse_args()
            validate_args(args, {})
    except BaseException as exc:  # argparse exits on an unknown flag
        return f"{label}: {type(exc).__name__}: {str(exc)[:200]}"
    want = {"tensor_model_parallel_size": plan.tp, "pipeline_model_parallel_size": plan.pp,
            "context_parallel_size": plan.cp, "data_parallel_size": plan.dp,
            "micro_batch_size": plan.micro_batch_size, "global_batch_size": plan.global_batch_size,
            "sequence_parallel": plan.sequence_parallel, "use_distributed_optimizer": plan.distributed_optimizer,
            "recompute_granularity": None if plan.recompute.value == "none" else plan.recompute.value,
            "expert_model_parallel_size": plan.ep}
    if plan.virtual_stages > 1:
        want["virtual_pipeline_model_parallel_size"] = plan.virtual_stages
    got = {k: getattr(args, k, "(missing)") for k in want}
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    return f"{label}: parsed (got, planned) {wrong}" if wrong else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (the folder holding megatron/)")
    ap.add_argument("--every", type=int, default=1, help="check one plan in N of each search")
    args = ap.parse_args()
    if not (Path(args.megatron_lm) / "megatron" / "training" / "arguments.py").is_file():
        print(f"{args.megatron_lm}: no megatron/training/arguments.py (a Megatron-LM checkout is needed)")
        return 2
    commands = exported_commands(max(1, args.every))
    sys.path.insert(0, str(Path(args.megatron_lm).resolve()))
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # validate_args asks the GPU: an H800's answers
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="H800")
    try:
        from megatron.training.arguments import parse_args, validate_args
    except ImportError as exc:
        print(f"cannot import Megatron-LM's arguments: {exc} (pip install what it names)")
        return 2
    refusals = [r for label, text, plan in commands if (r := check(label, text, plan, parse_args, validate_args))]
    print(f"{len(commands)} exported commands, {len(commands) - len(refusals)} accepted by Megatron-LM's "
          f"parse_args + validate_args with the plan's own settings, {len(refusals)} refused or parsed otherwise")
    for r in refusals[:10]:
        print("  " + r)
    return 0 if not refusals else 1


if __name__ == "__main__":
    sys.exit(main())
