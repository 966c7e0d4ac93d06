"""The searches whose plans the launch tests (and ``benchmarks/launch_conformance.py``) export: the
README's main search, an MoE, a long-context and an FP8 one; every valid plan of each."""

from __future__ import annotations

from echo_plan.search.config import prune_for
from echo_plan.search.space import default_space_path_for, load_space
from echo_plan.search.study import SearchConfig
from echo_plan.specs import load_cluster, load_model, load_stack

STACK = load_stack("megatron-core")


def _search_plans(model: str, gpus: int, gbs: int, dtype: str = "bf16", seq: int | None = None):
    m = load_model(model)
    if seq:
        m = m.replace(seq_length=seq)
    cluster = load_cluster("h800", gpus=gpus)
    space = load_space(default_space_path_for(m)).with_values({"dtype": (dtype,)})
    config = SearchConfig(model=m, cluster=cluster, global_batch_size=gbs, space=space, stack=STACK)
    return m, cluster, [v.plan for v in prune_for(config).valid]


SEARCHES = {
    "readme-gpt3": ("gpt3-175b", 96, 1536, "bf16", None),  # the README's main search
    "moe-qwen3": ("qwen3-30b-a3b", 64, 256, "bf16", None),
    "long-context": ("llama3-8b", 64, 64, "bf16", 65536),
    "fp8-llama": ("llama3-70b", 64, 128, "fp8", None),
}


