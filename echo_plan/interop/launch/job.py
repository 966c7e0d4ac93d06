"""What a launch config holds (a model, a plan, a software stack, a GPU count) and the errors of
turning one into the other.

An export that the target framework cannot run as simulated is refused with one line naming the
knob and why (:class:`CannotExpress`); an import that reads a setting echo-plan cannot model is
refused the same way (:class:`CannotImport`), so nothing else is ever simulated in its place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

from echo_plan.errors import EchoPlanError
from echo_plan.specs import ModelSpec, PlanSpec, SoftwareSpec, load_model, model_names
from echo_plan.specs.software import CudaAllocator


class LaunchFormat(str, Enum):
    MEGATRON_LM = "megatron-lm"  # pretrain_gpt.py command-line arguments, under torchrun
    MEGATRON_BRIDGE = "megatron-bridge"  # ConfigContainer overrides of a Megatron-Bridge recipe (YAML)
    TORCHTITAN = "torchtitan"  # a torchtitan job config (TOML, torchtitan 0.1-0.2's --job.config_file)

    @property
    def suffix(self) -> str:
        return {LaunchFormat.MEGATRON_LM: ".sh", LaunchFormat.MEGATRON_BRIDGE: ".yaml",
                LaunchFormat.TORCHTITAN: ".toml"}[self]


FORMAT_NAMES = ", ".join(f.value for f in LaunchFormat)


def launch_format(name: str, option: str = "--format") -> LaunchFormat:
    try:
        return LaunchFormat(str(name).strip().lower())
    except ValueError:
        raise EchoPlanError(f"{option} {name!r}: one of {FORMAT_NAMES}") from None


class CannotExpress(EchoPlanError):
    """The target framework has no setting for a knob of the plan (or the stack) as simulated."""

    def __init__(self, fmt: LaunchFormat, knob: str, value: Any, why: str) -> None:
        self.fmt, self.knob, self.value, self.why = fmt, knob, value, why
        super().__init__(f"{fmt.value} cannot run this plan as simulated: {knob} {value}: {why}")


class CannotImport(EchoPlanError):
    """A launch config sets something echo-plan cannot model: nothing is simulated in its place."""

    def __init__(self, source: str, setting: str, value: Any, why: str) -> None:
        self.source, self.setting, self.value, self.why = source, setting, value, why
        shown = "" if value is None else f" {value}"
        super().__init__(f"{source}: {setting}{shown}: {why}; nothing simulated")


@dataclass(frozen=True)
class LaunchJob:
    """A job read from a launch config (or about to be written to one)."""

    model: ModelSpec
    plan: PlanSpec
    stack: SoftwareSpec
    gpus: int  # the job's world size
    gpus_per_node: int | None = None  # when the config says (torchrun --nproc-per-node, trainer.devices)
    source: str = ""
    notes: tuple[str, ...] = ()  # read but not modelled (data paths, logging...), or assumptions made


# PyTorch's caching-allocator setting, as a launch's environment gives it (a stack's cuda_allocator)
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_NEW = "PYTORCH_ALLOC_CONF"  # PyTorch 2.9's name for it; both are read
EXPANDABLE = "expandable_segments:True"


def allocator_of(env: Mapping[str, str]) -> CudaAllocator | None:
    """The caching-allocator setting a launch's environment names (either variable), or None when it names none
    (set elsewhere, or PyTorch's default)."""
    value = env.get(ALLOC_CONF, env.get(ALLOC_CONF_NEW))
    if value is None:
        return None
    options = {k.strip(): v.strip() for k, _, v in (part.partition(":") for part in value.split(","))}
    expandable = options.get("expandable_segments", "False").lower() == "true"
    return CudaAllocator.EXPANDABLE_SEGMENTS if expandable else CudaAllocator.DEFAULT


@dataclass(frozen=True)
class LaunchExport:
    """The text of a launch config, the environment it relies on, and what it leaves to the user."""

    fmt: LaunchFormat
    text: str
    env: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def virtual_split(plan: PlanSpec, model: ModelSpec) -> tuple[int, ...]:
    """Transformer layers per virtual stage, in model order (pp x vpp entries)."""
    return tuple(plan.virtual_layers(model.num_layers))


def even_split(plan: PlanSpec, model: ModelSpec) -> bool:
    """The plan's layers are spread evenly (what a framework does without a layer-split setting)."""
    chunks = plan.pp * plan.virtual_stages
    return model.num_layers % chunks == 0 and set(virtual_split(plan, model)) == {model.num_layers // chunks}


def canonical_plan(plan: PlanSpec, model: ModelSpec) -> PlanSpec:
    """The plan as a launch config gives it back: no split when even, one entry per virtual stage
    otherwise (per pipeline stage without interleaving), etp explicit, modelling assumptions
    (expert imbalance) at their defaults, no parameter all-gather to overlap without the
    distributed optimizer (as the search's canonical plans)."""
    split = None if even_split(plan, model) else virtual_split(plan, model)
    return plan.replace(layer_split=split, expert_imbalance=1.0, etp=plan.expert_tp,
                        overlap_param_gather=plan.overlap_param_gather and plan.distributed_optimizer)


def preset_of_shape(model: ModelSpec, among: Iterable[str] | None = None, ignore: tuple[str, ...] = ()) -> str | None:
    """The first model preset (of ``among``, default all) with ``model``'s shape: every field but the name,
    the source, the sequence length and ``ignore``; None when none has it."""
    skip = {"name", "source", "seq_length", *ignore}
    shape = model.model_dump(exclude=skip)
    return next((p for p in (model_names() if among is None else among)
                 if load_model(p).model_dump(exclude=skip) == shape), None)


def named_like_preset(model: ModelSpec, name: str) -> ModelSpec:
    """``model`` named after the model preset of the same shape (at its own sequence length), else ``name``."""
    preset = preset_of_shape(model)
    return load_model(preset).replace(seq_length=model.seq_length) if preset else model.replace(name=name)
