"""The "Run the plan" card: the recommended plan as each framework's launch config, ready to copy,
or the one line that says why a framework cannot run it as simulated."""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.errors import EchoPlanError
from echo_plan.interop.launch import LaunchFormat, export_launch
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


def launch_snippets(outcome: SearchOutcome) -> tuple[LaunchSnippet, ...]:
    """One snippet per launch format for the recommended plan (none without one)."""
    best = outcome.best
    if best is None:
        return ()
    try:
        model = ModelSpec.build(outcome.model, context="the search's model")
        cluster = ClusterSpec.build(outcome.cluster, context="the search's cluster").resized(gpus=best.num_gpus)
        stack = SoftwareSpec.build(outcome.stack, context="the search's stack") if outcome.stack else load_stack(None)
        plan = PlanSpec.build(best.plan, context="the recommended plan")
    except EchoPlanError:
        return ()  # an outcome saved by an older release without what the export needs
    out = []
    for fmt in LaunchFormat:
        try:
            text, refusal = export_launch(fmt, model, plan, stack, cluster).text, ""
        except EchoPlanError as exc:
            text, refusal = "", str(exc)
        out.append(LaunchSnippet(fmt.value, TITLES[fmt], text, refusal))
    return tuple(out)
