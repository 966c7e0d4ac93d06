"""The "Run the plan" card: the recommended plan as each framework's launch config, ready to copy,
or the one line that says why a framework cannot run it as simulated."""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.errors import EchoPlanError
from echo_plan.interop.launch import LaunchFormat, first_exportable
from echo_plan.search.results import SearchOutcome
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec, load_stack

TITLES = {LaunchFormat.MEGATRON_LM: "Megatron-LM (pretrain_gpt.py)",
          LaunchFormat.MEGATRON_BRIDGE: "Megatron-Bridge (recipe overrides, YAML)",
          LaunchFormat.TORCHTITAN: "torchtitan (job config, TOML)"}


@dataclass(frozen=True, slots=True)
class LaunchSnippet:
    fmt: str
    title: str
    text: str  # the config, or "" when refused
    refusal: str  # why the framework cannot run the plan as simulated ("" when it can)
    rank: int = 1  # which ranked plan the config runs (the fastest the framework can)
    passed_over: str = ""  # why the faster plans were not exported


def launch_snippets(outcome: SearchOutcome) -> tuple[LaunchSnippet, ...]:
    """One snippet per launch format: the recommended plan, or the fastest plan the framework can run as
    simulated and why the faster ones could not (none without a recommended plan)."""
    best = outcome.best
    if best is None:
        return ()
    try:
        model = ModelSpec.build(outcome.model, context="the search's model")
        cluster = ClusterSpec.build(outcome.cluster, context="the search's cluster").resized(gpus=best.num_gpus)
        stack = SoftwareSpec.build(outcome.stack, context="the search's stack") if outcome.stack else load_stack(None)
        plans = [PlanSpec.build(r.plan, context="a ranked plan") for r in outcome.ranked]
    except EchoPlanError:
        return ()  # an outcome saved by an older release without what the export needs
    out = []
    for fmt in LaunchFormat:
        try:
            rank, _, export, skipped = first_exportable(fmt, model, plans, stack, cluster)
        except EchoPlanError as exc:
            out.append(LaunchSnippet(fmt.value, TITLES[fmt], "", str(exc)))
            continue
        passed = "" if rank == 1 else (f"Plan {rank} of the ranking, the fastest {fmt.value} runs as simulated; "
                                       f"the faster ones need what it lacks: " + "; ".join(skipped[:3])
                                       + (" ..." if len(skipped) > 3 else ""))
        out.append(LaunchSnippet(fmt.value, TITLES[fmt], export.text, "", rank, passed))
    return tuple(out)
