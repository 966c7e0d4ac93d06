"""Bounds on every number a user gives, so that nothing allocates or loops without limit.

Each ceiling is far above anything physically built or published (stated beside it): a value
beyond it is a typo or an attack, and gets a one-line error naming the value and the range
instead of a traceback, a hang or a silently absurd answer.
"""

from __future__ import annotations

from typing import Any

from echo_plan.errors import SpecError

MAX_GPUS = 1 << 20  # 1,048,576 GPUs: the largest clusters announced (2025) have ~10^5
MAX_GPUS_PER_NODE = 1024  # NVL576-class racks are the largest NVLink domains
MAX_MICROBATCHES = 1 << 16  # micro-batches per step: published runs use at most a few thousand
MAX_GLOBAL_BATCH = 1 << 24  # sequences per step (16.7M): published runs use at most ~10^4
MAX_LAYERS = 10_000  # published models have at most a few hundred
MAX_HIDDEN = 1 << 18  # 262,144: the largest published hidden sizes are ~25,600
MAX_HEADS = 1 << 16
MAX_FFN = 1 << 21
MAX_VOCAB = 1 << 24  # 16.7M tokens: published vocabularies are at most ~10^6
MAX_SEQUENCE = 1 << 24  # 16.7M tokens: the longest published training contexts are ~10^6-10^7
MAX_SEED = (1 << 32) - 1  # what numpy's and Optuna's samplers accept
MAX_SPACE_CANDIDATES = 500_000  # plans in a search space: the default has 9,216; checking one takes ~40 us
MAX_COMPARE_SIZES = 64  # cluster sizes in one compare: each is a whole search
MAX_TOKENS = 1e16  # a token budget: the largest published runs train on ~1e13-4e13 tokens
MAX_PRICE_PER_GPU_HOUR = 1e6  # any currency: rented H100s cost ~2-10 an hour
MAX_TRIALS = 1_000_000  # a search simulates ~100 plans; a million takes days
MAX_WORKERS = 4096  # local Ray workers: one per core of the largest servers, with room
MAX_BYTES = 1 << 50  # 1 PiB: no collective or memory figure comes near
MAX_FILE_BYTES = 64 << 20  # a spec, space or suite file larger than 64 MiB is not one a person wrote
MAX_NESTING = 64  # depth of nested mappings/lists in a spec file
MAX_NODES = 5_000_000  # values in one parsed file (a saved 1,000-trial search result holds ~10^5)


def check_int(field: str, value: Any, lo: int, hi: int, what: str = "") -> int:
    """``value`` as an int in [lo, hi], else a SpecError naming the field and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        valid = f"an integer from {lo:,} to {hi:,}" + (f" ({what})" if what else "")
        raise SpecError(field, value, valid)
    return value


def structure_problem(obj: Any, max_depth: int = MAX_NESTING, max_nodes: int = MAX_NODES) -> str | None:
    """Why a parsed file is too deep or too big to be a spec (None when it is fine). Counted
    iteratively, so neither a deep file nor a self-referencing YAML alias can overflow or loop."""
    nodes = 0
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth > max_depth:
                return f"nested more than {max_depth} levels deep; spec files are flat mappings"
            nodes += len(node)
            if nodes > max_nodes:
                return f"holds more than {max_nodes:,} values (YAML aliases count each time they are used)"
            children = node.values() if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return None
