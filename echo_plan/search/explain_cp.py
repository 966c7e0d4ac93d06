"""Why a search chose its context-parallel degree, in one paragraph (CLI and HTML report).

Says how the best plan cuts each sequence, where its CP ring runs (inside a server over NVLink or
across servers), how many candidates without context parallelism were pruned because their
activations did not fit, and how the best fitting plan of every other cp did.
"""

from __future__ import annotations

from typing import Any, Iterable

NEEDS_CP = "out of memory at this sequence length without context parallelism (estimate)"


def cp_choice(best: Any, fitting: Iterable[Any], seq_length: int, gpus_per_node: int,
              pruned_counts: dict[str, int] | None = None) -> str:
    """A paragraph on the CP choice of ``best`` (a StepResult) among the ``fitting`` simulated plans;
    "" when no plan in sight used context parallelism."""
    fitting = list(fitting)
    cp = int(best.plan.get("cp") or 1)
    others: dict[int, Any] = {}
    for r in fitting:
        c = int(r.plan.get("cp") or 1)
        if c != cp and (c not in others or r.step_time_s < others[c].step_time_s):
            others[c] = r
    needs = int((pruned_counts or {}).get(NEEDS_CP, 0))
    if cp == 1 and not others and not needs:
        return ""
    if cp > 1:
        tp = int(best.plan.get("tp") or 1)
        chunk = seq_length // (2 * cp)
        span = cp * tp  # the ring's ranks are tp apart
        unit = "server" if gpus_per_node <= 8 else "NVLink domain"  # an NVL72 rack is one domain of many servers
        where = (f"inside one {unit} (NVLink)" if span <= gpus_per_node
                 else f"across {-(-span // gpus_per_node)} {unit}s (the network)")
        text = (f"Context parallelism {cp}: each {seq_length:,}-token sequence is cut into {2 * cp} chunks of "
                f"{chunk:,} tokens, two per GPU (the first and the last of a mirrored pair, so every GPU has the "
                f"same causal work); K/V chunks go round a ring of {cp} GPUs {where} while attention runs on "
                f"the chunk in hand.")
    else:
        text = "No context parallelism: the sequence fits on each GPU whole."
    if needs:
        text += (f" {needs} candidate{'s' if needs > 1 else ''} without context parallelism "
                 f"{'were' if needs > 1 else 'was'} pruned: {seq_length:,}-token activations do not fit.")
    if others:
        text += " The fastest fitting plan with another cp: " + "; ".join(
            f"cp {c} {r.step_time_s / best.step_time_s - 1:+.1%}" for c, r in sorted(others.items())) + "."
    return text
