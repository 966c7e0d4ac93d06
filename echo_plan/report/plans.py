"""Plans as people read them: short labels, sentences, and which knobs differ between plans.

A plan is the ``PlanSpec.model_dump(mode="json")`` mapping stored in every StepResult and trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from echo_plan.specs.plan import PlanSpec

# The knobs in the order a reader expects them, with a column header and a formatter.
_ON_OFF = {True: "on", False: "off"}


@dataclass(frozen=True, slots=True)
class Knob:
    key: str
    header: str  # short column header
    fmt: Callable[[Any], str]
    title: str = ""  # the full name, shown on hover

    @property
    def long(self) -> str:
        return self.title or self.header


def _plain(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return _ON_OFF[v]
    if isinstance(v, (list, tuple)):
        return "/".join(str(x) for x in v)
    return str(v)


def _shard_group(v: Any) -> str:
    return "all" if v is None else str(v)


KNOBS: tuple[Knob, ...] = (
    Knob("tp", "TP", _plain, "tensor-parallel degree"),
    Knob("cp", "CP", _plain, "context-parallel degree (sequence chunks over GPUs)"),
    Knob("pp", "PP", _plain, "pipeline stages"),
    Knob("dp", "DP", _plain, "data-parallel degree"),
    Knob("micro_batch_size", "mbs", _plain, "micro-batch size"),
    Knob("global_batch_size", "gbs", _plain, "global batch size"),
    Knob("virtual_stages", "vpp", _plain, "model chunks per pipeline stage (interleaving)"),
    Knob("schedule", "schedule", _plain, "pipeline schedule"),
    Knob("recompute", "recompute", _plain, "activation recomputation"),
    Knob("sequence_parallel", "SP", _plain, "sequence parallelism"),
    Knob("recompute_layers", "recompute layers", _plain, "layers of each chunk recomputed whole"),
    Knob("distributed_optimizer", "dist-opt", _plain, "distributed (sharded) optimizer"),
    Knob("sharding", "sharding", _plain, "what data parallelism shards (ZeRO 0-3; parameters: FSDP)"),
    Knob("shard_degree", "shard group", _shard_group, "ranks per HSDP shard group"),
    Knob("reshard_after_forward", "reshard", _plain, "FSDP gathers each block again for its backward"),
    Knob("overlap_grad_reduce", "grad overlap", _plain, "gradient reduction overlapped with backward"),
    Knob("overlap_param_gather", "param overlap", _plain, "parameter all-gather overlapped with forward"),
    Knob("dtype", "dtype", _plain, "training data type"),
    Knob("layer_split", "layers/stage", _plain, "layers per pipeline stage"),
)
_KNOWN = {k.key for k in KNOBS}


def knobs_of(plans: Sequence[dict[str, Any]]) -> list[Knob]:
    """The known knobs, then any other key the plans carry (a newer PlanSpec field), sorted."""
    extra = sorted({key for p in plans for key in p} - _KNOWN)
    return list(KNOBS) + [Knob(key, key.replace("_", " "), _plain) for key in extra]


# knobs that mean nothing without expert parallelism (a dense model's plan carries etp = tp all the same)
_EXPERT_KNOBS = frozenset({"ep", "etp", "expert_imbalance"})


def _applies(plan: dict[str, Any], key: str) -> bool:
    """Whether a knob means anything for this plan (a dense model's plan carries etp = tp all the same, an FSDP
    plan distributed_optimizer, the name of every sharding level, beside its sharding)."""
    if key in _EXPERT_KNOBS:
        return int(plan.get("ep") or 1) > 1
    if key == "distributed_optimizer":
        return plan.get("sharding") is None
    if key == "shard_degree":
        return bool(plan.get("distributed_optimizer"))
    if key == "reshard_after_forward":
        return plan.get("sharding") == "parameters"
    if key == "offload_fraction":
        return bool(plan.get("offload_optimizer"))
    if key == "density":
        return plan.get("dp_comm") not in (None, "dense")
    return True


def knob_value(plan: dict[str, Any], knob: Knob) -> str:
    """The knob's value as a reader sees it; "-" where the knob does not apply to the plan."""
    return knob.fmt(plan.get(knob.key)) if _applies(plan, knob.key) else "-"


def differing_knobs(plans: Sequence[dict[str, Any]]) -> list[Knob]:
    """Knobs whose value is not the same in every plan (in KNOBS order)."""
    return [k for k in knobs_of(plans) if len({knob_value(p, k) for p in plans}) > 1]


def constant_knobs(plans: Sequence[dict[str, Any]]) -> list[tuple[Knob, str]]:
    """Knobs that every plan sets the same way, with that value."""
    if not plans:
        return []
    return [(k, knob_value(plans[0], k)) for k in knobs_of(plans)
            if len({knob_value(p, k) for p in plans}) == 1 and plans[0].get(k.key) is not None
            and knob_value(plans[0], k) != "-"]


def _spec(plan: dict[str, Any]) -> Any:
    """The plan as a PlanSpec, from the fields PlanSpec knows (a result of another version may carry others), or
    None for a mapping that is no plan."""
    try:
        return PlanSpec.model_validate({k: v for k, v in plan.items() if k in PlanSpec.model_fields})
    except (ValidationError, ValueError, TypeError):
        return None


def short_label(plan: dict[str, Any]) -> str:
    """A compact label like ``tp8 pp4 dp3 mbs1 vpp2 sel-recompute sp dist-opt``: PlanSpec.short, the label
    simulate and search print; for a mapping that is no plan, its degrees and micro-batch."""
    spec = _spec(plan)
    if spec is not None:
        return spec.short()
    return " ".join(f"{name}{plan.get(key, 1)}" for name, key in
                    (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mbs", "micro_batch_size")))


def num_microbatches(plan: dict[str, Any]) -> int | None:
    try:
        return int(plan["global_batch_size"]) // (int(plan["dp"]) * int(plan["micro_batch_size"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def plan_in_words(plan: dict[str, Any]) -> str:
    """One sentence that says how the job is laid out."""
    tp, pp, dp = int(plan.get("tp", 1)), int(plan.get("pp", 1)), int(plan.get("dp", 1))
    layout = []
    layout.append(f"{tp}-way tensor parallel" if tp > 1 else "no tensor parallelism")
    cp = int(plan.get("cp") or 1)
    if cp > 1:
        layout.append(f"{cp}-way context parallel")
    if pp > 1:
        vpp = int(plan.get("virtual_stages") or 1)
        sched = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}.get(
            str(plan.get("schedule")), str(plan.get("schedule")))
        chunks = f", {vpp} chunks per stage" if vpp > 1 else ""
        layout.append(f"{pp} pipeline stages ({sched}{chunks})")
    else:
        layout.append("no pipeline")
    layout.append(f"{dp}-way data parallel" if dp > 1 else "no data parallelism")
    text = " × ".join(layout)
    mb = num_microbatches(plan)
    batch = f"micro-batch {plan.get('micro_batch_size', 1)}"
    if mb is not None:
        batch += f", {mb} micro-batches per step (global batch {plan.get('global_batch_size')})"
    extras = []
    recompute = plan.get("recompute", "none")
    words = {"none": "no recomputation", "selective": "selective recomputation",
             "full": "full recomputation"}.get(str(recompute), f"{recompute} recomputation")
    recompute_layers = int(plan.get("recompute_layers") or 0)
    if recompute_layers:  # Megatron-Core's block recompute, torchtitan's layer checkpointing
        words = f"{recompute_layers} layers of each model chunk recomputed whole" + (
            "" if recompute == "none" else f", {words} of the others")
    extras.append(words)
    ep, etp = int(plan.get("ep") or 1), plan.get("etp")
    if ep > 1:
        extras.append(f"{ep}-way expert parallel" + (f" with {etp}-way expert tensor parallel"
                                                     if etp is not None and int(etp) > 1 else ""))
    if plan.get("sequence_parallel"):
        extras.append("sequence parallel")
    extras += _sharding_words(plan)
    if plan.get("dtype"):
        extras.append(str(plan["dtype"]))
    return f"{text}; {batch}; " + ", ".join(extras) + "."


def _sharding_words(plan: dict[str, Any]) -> list[str]:
    """What data parallelism shards, in words (the plan's ``sharding``; older results: distributed_optimizer)."""
    sharding = plan.get("sharding") or ("optimizer" if plan.get("distributed_optimizer") else "none")
    words = {"optimizer": "distributed (sharded) optimizer",
             "gradients": "optimizer states and gradients sharded (ZeRO-2)",
             "parameters": "parameters, gradients and optimizer states sharded (FSDP, ZeRO-3)"}.get(str(sharding))
    if words is None:
        return []
    degree = plan.get("shard_degree")
    if degree is not None and int(degree) != int(plan.get("dp") or 1) * int(plan.get("cp") or 1):
        words += f" within groups of {degree} ranks, replicated across them (HSDP)"
    out = [words]
    if sharding == "parameters" and plan.get("reshard_after_forward") is not None:
        out.append("each block gathered again for its backward" if plan["reshard_after_forward"]
                   else "each block kept gathered from its forward to its backward")
    if plan.get("offload_optimizer"):
        share = float(plan.get("offload_fraction") or 1.0)
        out.append("optimizer states in CPU memory" + (f" ({share:.0%} of them)" if share != 1.0 else ""))
    return out


def knob_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(name, value in a, value in b) for every knob on which two plans differ."""
    return [(k.long, knob_value(a, k), knob_value(b, k)) for k in knobs_of([a, b])
            if knob_value(a, k) != knob_value(b, k)]
