"""The plan flags every command that takes a plan shares, and the one builder from them to (model,
cluster, stack, plan).

``@plan_options`` adds the same options (:data:`PLAN_OPTIONS`: the model and cluster, the parallel
degrees, batch, schedule, recompute, precision, overlaps, experts, data-parallel exchange, layer split)
to a command and hands it one :class:`PlanFlags`; ``build_plan(flags)`` checks and resolves them the
same way for every command. A command that cannot use a flag names it in ``refuse`` with the reason,
and a user who sets it gets one line saying so, never a silently ignored flag.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

import typer

from echo_plan.commands.common import (
    ClusterOpt, CpOpt, DensityOpt, DpCommOpt, DTypeHelp, EpOpt, EtpOpt, Fp8ParamGatherOpt, Fp8RecipeOpt, GpusOpt,
    ImbalanceOpt, ModelOpt, NodesOpt, SeqOpt, StackOpt, check_tp_pp, data_parallel, dp_comm_fields, expert_fields,
    fp8_stack, resolve_specs, resolve_stack,
)
from echo_plan.errors import SpecError
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec, SoftwareSpec
from echo_plan.specs.plan import balanced_split

# (field, type, option): the flags of a plan, in the order --help lists them.
PLAN_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("model", str, ModelOpt),
    ("cluster", str, ClusterOpt),
    ("nodes", Optional[int], NodesOpt),
    ("gpus", Optional[int], GpusOpt),
    ("stack", Optional[str], StackOpt),
    ("seq_length", Optional[int], SeqOpt),
    ("tp", int, typer.Option(1, "--tp", help="tensor-parallel degree")),
    ("pp", int, typer.Option(1, "--pp", help="pipeline-parallel degree")),
    ("cp", int, CpOpt),
    ("dp", Optional[int], typer.Option(None, "--dp", help="data-parallel degree (default: GPUs / (tp x cp x pp))")),
    ("mbs", int, typer.Option(1, "--mbs", help="micro-batch size")),
    ("gbs", Optional[int], typer.Option(None, "--gbs", help="global batch size (default: mbs x dp)")),
    ("vpp", int, typer.Option(1, "--vpp", help="virtual pipeline stages per rank; above 1 implies interleaved")),
    ("schedule", Optional[str], typer.Option(None, "--schedule", help="gpipe | 1f1b | interleaved | zb-h1 | zb-v | "
                                                                       "dualpipe (docs/schedules.md)")),
    ("recompute", str, typer.Option("none", "--recompute", help="none | selective | full")),
    ("recompute_layers", int, typer.Option(
        0, "--recompute-layers", help="full recompute of the first N layers of each model chunk, the others as "
                                      "--recompute says (Megatron's --recompute-num-layers N, block method)")),
    ("sequence_parallel", bool, typer.Option(False, "--sequence-parallel", help="Megatron-LM sequence parallelism")),
    ("distributed_optimizer", bool, typer.Option(False, "--distributed-optimizer",
                                                 help="shard optimizer states over DP (reduce-scatter + all-gather)")),
    ("sharding", Optional[str], typer.Option(
        None, "--sharding", help="none | optimizer | gradients | parameters: what data parallelism shards (ZeRO "
                                 "0-3; parameters = FSDP full shard; default: none, or the stack's level with "
                                 "--distributed-optimizer)")),
    ("shard_degree", Optional[int], typer.Option(
        None, "--shard-degree", help="HSDP: shard within groups of N ranks, replicate across dp x cp / N "
                                     "(default: the whole data-parallel group)")),
    ("reshard_after_forward", Optional[bool], typer.Option(
        None, "--reshard-after-forward/--keep-after-forward",
        help="--sharding parameters: gather each block again for its backward (default: yes without a pipeline, "
             "no with one, as torchtitan)")),
    ("offload_optimizer", bool, typer.Option(
        False, "--offload-optimizer", help="keep the optimizer states in CPU memory and step on the CPU (Megatron-Core's "
                                           "--optimizer-cpu-offload, DeepSpeed's offload_optimizer); needs a sharded "
                                           "optimizer and a cluster with host figures")),
    ("offload_fraction", Optional[float], typer.Option(
        None, "--offload-fraction", help="with --offload-optimizer: the share of each rank's optimizer moved to the "
                                         "CPU, in (0, 1]; the rest steps on the GPU meanwhile (default 1)")),
    ("dtype", str, typer.Option("bf16", "--dtype", help=DTypeHelp)),
    ("fp8_recipe", Optional[str], Fp8RecipeOpt),
    ("fp8_param_gather", Optional[bool], Fp8ParamGatherOpt),
    ("no_overlap_grad_reduce", bool, typer.Option(False, "--no-overlap-grad-reduce",
                                                  help="reduce gradients after the backward pass, not during it")),
    ("no_overlap_param_gather", bool, typer.Option(False, "--no-overlap-param-gather",
                                                   help="gather parameters after the optimizer, not during the forward")),
    ("dp_comm", str, DpCommOpt),
    ("density", Optional[float], DensityOpt),
    ("ep", int, EpOpt),
    ("etp", Optional[int], EtpOpt),
    ("expert_imbalance", float, ImbalanceOpt),
    ("layer_split", Optional[str], typer.Option(
        None, "--layer-split", help="layers per stage, e.g. 13,12,12,11 (with --vpp: one per stage or one per "
                                    "virtual stage), or auto (as even as possible, fewer on the first and last stage)")),
)


@dataclass(frozen=True)
class PlanFlags:
    """The values of :data:`PLAN_OPTIONS` as the user gave them (None: not given)."""

    model: str
    cluster: str
    nodes: Optional[int]
    gpus: Optional[int]
    stack: Optional[str]
    seq_length: Optional[int]
    tp: int
    pp: int
    cp: int
    dp: Optional[int]
    mbs: int
    gbs: Optional[int]
    vpp: int
    schedule: Optional[str]
    recompute: str
    recompute_layers: int
    sequence_parallel: bool
    distributed_optimizer: bool
    sharding: Optional[str]
    shard_degree: Optional[int]
    reshard_after_forward: Optional[bool]
    offload_optimizer: bool
    offload_fraction: Optional[float]
    dtype: str
    fp8_recipe: Optional[str]
    fp8_param_gather: Optional[bool]
    no_overlap_grad_reduce: bool
    no_overlap_param_gather: bool
    dp_comm: str
    density: Optional[float]
    ep: int
    etp: Optional[int]
    expert_imbalance: float
    layer_split: Optional[str]


FIELDS = tuple(name for name, _, _ in PLAN_OPTIONS)
DEFAULTS: Mapping[str, Any] = MappingProxyType({name: opt.default for name, _, opt in PLAN_OPTIONS})
FLAG_NAMES: Mapping[str, str] = MappingProxyType({name: opt.param_decls[0].split("/")[0]
                                                  for name, _, opt in PLAN_OPTIONS})


def plan_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``command`` (which takes ``flags: PlanFlags`` and its own options) every plan option."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "flags"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=kind)
             for name, kind, opt in PLAN_OPTIONS]
    clash = {p.name for p in own} & set(FIELDS)
    if clash:
        raise TypeError(f"{command.__name__} declares plan options itself: {sorted(clash)}")

    @functools.wraps(command)
    def run(**kwargs: Any) -> Any:
        flags = PlanFlags(**{name: kwargs.pop(name) for name in FIELDS})
        return command(flags=flags, **kwargs)

    positional = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
    run.__signature__ = inspect.Signature(added + positional)  # type: ignore[attr-defined]
    return run


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    cluster: ClusterSpec
    stack: SoftwareSpec
    plan: PlanSpec


def refuse_flags(flags: PlanFlags, refuse: Mapping[str, str]) -> None:
    """One line for a flag the command cannot use, when the user set it: ``refuse`` maps a field to why."""
    for name, why in refuse.items():
        value = getattr(flags, name)
        if value != DEFAULTS[name]:
            raise SpecError(FLAG_NAMES[name], value, why)


def build_plan(flags: PlanFlags, *, refuse: Mapping[str, str] = MappingProxyType({}), routing: Optional[str] = None,
               flows_per_connection: Optional[int] = None) -> PlanInputs:
    """The model, cluster, stack and plan the flags name, each checked (one-line errors naming the flag)."""
    refuse_flags(flags, refuse)
    check_tp_pp(flags.tp, flags.pp)
    model, cluster = resolve_specs(flags.model, flags.cluster, flags.nodes, flags.gpus, seq_length=flags.seq_length,
                                   routing=routing, flows_per_connection=flows_per_connection)
    stack = fp8_stack(resolve_stack(flags.stack), flags.dtype, flags.fp8_recipe, flags.fp8_param_gather)
    dp = data_parallel(cluster.num_gpus, flags.tp, flags.pp, flags.dp, flags.cp)
    plan_fields: dict[str, Any] = dict(
        tp=flags.tp, cp=flags.cp, pp=flags.pp, dp=dp, micro_batch_size=flags.mbs,
        global_batch_size=flags.gbs if flags.gbs is not None else flags.mbs * dp,
        virtual_stages=flags.vpp, recompute=flags.recompute, recompute_layers=flags.recompute_layers,
        sequence_parallel=flags.sequence_parallel,
        distributed_optimizer=flags.distributed_optimizer, dtype=flags.dtype,
        overlap_grad_reduce=not flags.no_overlap_grad_reduce, overlap_param_gather=not flags.no_overlap_param_gather,
    )
    plan_fields.update(sharding_fields(flags))
    if flags.schedule is not None:
        plan_fields["schedule"] = flags.schedule
    elif flags.vpp > 1:
        plan_fields["schedule"] = "interleaved"
    split = layer_split(flags, model)
    if split is not None:
        plan_fields["layer_split"] = split
    plan_fields.update(expert_fields(flags.ep, flags.etp, flags.expert_imbalance))
    plan_fields.update(dp_comm_fields(flags.dp_comm, flags.density))
    return PlanInputs(model, cluster, stack, PlanSpec.build(plan_fields, context="plan"))


SHARDING_CHOICES = ("none", "optimizer", "gradients", "parameters")


def sharding_fields(flags: PlanFlags) -> dict[str, Any]:
    """The plan's sharding fields from --sharding, --shard-degree and --reshard-after-forward (one-line
    errors for a value that is not one, or a combination that contradicts itself)."""
    out: dict[str, Any] = {}
    if flags.sharding is not None:
        if flags.sharding not in SHARDING_CHOICES:
            raise SpecError("--sharding", flags.sharding, f"one of {', '.join(SHARDING_CHOICES)}")
        if flags.sharding == "none" and flags.distributed_optimizer:
            raise SpecError("--sharding", "none", "contradicts --distributed-optimizer (the name of --sharding "
                            "optimizer): give one of them")
        out["sharding"] = flags.sharding
    sharded = flags.distributed_optimizer or flags.sharding not in (None, "none")
    if flags.shard_degree is not None:
        if not sharded:
            raise SpecError("--shard-degree", flags.shard_degree, "needs --sharding optimizer, gradients or "
                            "parameters (or --distributed-optimizer)")
        out["shard_degree"] = flags.shard_degree
    if flags.reshard_after_forward is not None:
        if flags.sharding != "parameters":
            raise SpecError("--reshard-after-forward" if flags.reshard_after_forward else "--keep-after-forward",
                            True, "applies to --sharding parameters only")
        out["reshard_after_forward"] = flags.reshard_after_forward
    if flags.offload_optimizer:
        if not sharded:
            raise SpecError("--offload-optimizer", True, "needs a sharded optimizer: --distributed-optimizer or "
                            "--sharding optimizer, gradients or parameters (Megatron-Core and DeepSpeed offload only "
                            "a sharded optimizer)")
        out["offload_optimizer"] = True
    if flags.offload_fraction is not None:
        if not flags.offload_optimizer:
            raise SpecError("--offload-fraction", flags.offload_fraction, "needs --offload-optimizer")
        if not 0.0 < flags.offload_fraction <= 1.0:  # NaN fails too
            raise SpecError("--offload-fraction", flags.offload_fraction, "a share in (0, 1], e.g. 0.5")
        out["offload_fraction"] = flags.offload_fraction
    return out


def layer_split(flags: PlanFlags, model: ModelSpec) -> tuple[int, ...] | None:
    if flags.layer_split is None or flags.layer_split == "":
        return None
    if flags.layer_split == "auto":
        chunks = 2 if flags.schedule == "zb-v" and flags.vpp == 1 else flags.vpp  # ZB-V is two chunks per rank
        return balanced_split(model.num_layers, flags.pp * chunks)  # per virtual stage
    try:
        return tuple(int(x) for x in flags.layer_split.split(","))
    except ValueError:
        raise SpecError("--layer-split", flags.layer_split, "comma-separated layer counts, e.g. 13,12,12,11") from None
