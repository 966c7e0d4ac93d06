"""Options and helpers shared by the CLI commands."""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer

from echo_plan.files import write_atomic  # noqa: F401  (commands import it from here)
from echo_plan.specs import (
    DEFAULT_CLUSTER, DEFAULT_MODEL, DEFAULT_STACK, ClusterSpec, ModelSpec, SoftwareSpec, load_cluster, load_model,
    load_stack,
)
from echo_plan.limits import MAX_SEQUENCE, check_int
from echo_plan.errors import SpecError
from echo_plan.specs import parse_size
from echo_plan.output_paths import check_output_dir
from echo_plan.trace.cache import ENV_VAR, default_cache_root
from echo_plan.limits import MAX_GPUS
from echo_plan.specs.plan import DpComm
from echo_plan.cost.goodput import FailureModel

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="model preset name or a YAML/JSON/HF config.json file")
ClusterOpt = typer.Option(DEFAULT_CLUSTER, "--cluster", "-c", help="cluster preset name or a YAML file")
NodesOpt = typer.Option(None, "--nodes", help="resize the cluster to N servers")
GpusOpt = typer.Option(None, "--gpus", help="resize the cluster to G GPUs (whole servers)")
EpOpt = typer.Option(1, "--ep", help="expert-parallel degree (MoE models)")
CpOpt = typer.Option(1, "--cp", help="context-parallel degree: the sequence in 2 x cp chunks, two per GPU "
                                     "(ring attention; docs/long-context.md)")
SeqOpt = typer.Option(None, "--seq-length", help="train at this sequence length (default: the model's)")
EtpOpt = typer.Option(None, "--etp", help="expert tensor-parallel degree (default: tp, as Megatron-Core)")
ImbalanceOpt = typer.Option(1.0, "--expert-imbalance",
                            help="tokens of the busiest expert over the balanced mean (1: a balanced router)")
DpCommOpt = typer.Option("dense", "--dp-comm", help="dense | topk | cltk | hard-threshold | exdyna "
                         "(data-parallel gradient exchange; docs/sparsification.md)")
DTypeHelp = ("bf16 | fp16 | fp8 | fp4 (fp8: FP8 GEMMs in the layers' linears, bf16 elsewhere, needs FP8 tensor cores: "
             "H100/H800 onwards; fp4: NVFP4 GEMMs, Blackwell; docs/fp8.md)")
Fp8RecipeOpt = typer.Option(None, "--fp8-recipe", help="with --dtype fp8: delayed | current | blockwise | mxfp8 "
                            "(mxfp8: Blackwell; default: the stack's fp8_recipe; docs/fp8.md)")
Fp8ParamGatherOpt = typer.Option(None, "--fp8-param-gather/--no-fp8-param-gather",
                                 help="with --dtype fp8: keep and all-gather the weights in FP8 (default: the stack's)")
DensityOpt = typer.Option(None, "--density", help="share of gradient elements a sparse --dp-comm exchanges, (0, 1]")
FailRateOpt = typer.Option(None, "--failures-per-gpu-day",
                           help="interruptions per GPU-day (default 4.74e-4: Llama 3's 419 in 54 days on 16,384 GPUs)")
CkptBwOpt = typer.Option(None, "--checkpoint-gbps-per-gpu",
                         help="checkpoint write bandwidth per GPU, GB/s (default 0.122: Llama 3's 2 TB/s storage)")
RestartOpt = typer.Option(None, "--restart-min", help="minutes to restart and re-warm after an interruption (default 10)")
DetectOpt = typer.Option(None, "--detect-min", help="minutes to detect and localise a fault (default 5)")
JsonOpt = typer.Option(False, "--json", help="print one JSON object instead of a table")
StackOpt = typer.Option(
    None, "--stack",
    help=f"software stack: a preset (echo-plan presets lists them) or a YAML file (base: PRESET + changes); "
         f"default {DEFAULT_STACK}")
HeadroomOpt = typer.Option(
    None, "--memory-headroom",
    help="memory every GPU must keep free for a plan to fit: a share (10%) or a size (6GiB); "
         "default memory.yaml's share, 7%")
RoutingOpt = typer.Option(
    None, "--routing",
    help="cross-leaf flows: ecmp (hashed onto uplinks, collisions share them) | planned (disjoint uplinks, as "
         "C4P) | none (the leaf/spine layer not modelled; the cluster file's default); docs/traffic.md")
FlowsOpt = typer.Option(None, "--flows-per-connection",
                        help="flows (queue pairs) between two NICs under --routing ecmp (default 1, NCCL's)")
CacheDirOpt = typer.Option(
    None, "--cache-dir", help="trace cache folder (default: $ECHO_PLAN_CACHE_DIR or the user cache dir)"
)


def resolve_specs(model: str, cluster: str, nodes: Optional[int], gpus: Optional[int], *,
                  seq_length: Optional[int] = None, routing: Optional[str] = None,
                  flows_per_connection: Optional[int] = None) -> tuple[ModelSpec, ClusterSpec]:
    """The model (at ``--seq-length`` when given) and the cluster (resized; with --routing /
    --flows-per-connection applied)."""
    spec = load_model(model)
    if seq_length is not None:
        check_int("--seq-length", seq_length, 1, MAX_SEQUENCE, "tokens per sequence")
        spec = spec.replace(seq_length=seq_length)
    return spec, load_cluster(cluster, nodes=nodes, gpus=gpus).with_routing(routing, flows_per_connection)


def resolve_stack(stack: Optional[str]) -> SoftwareSpec:
    """The --stack preset or file (default megatron-core)."""
    return load_stack(stack)


def parse_headroom(text: Optional[str], cluster: ClusterSpec) -> Optional[int]:
    """--memory-headroom as bytes: ``10%`` of the GPU's memory or a size such as ``6GiB``; None when
    not given (the memory model's default share)."""
    if text is None:
        return None
    raw = str(text).strip()
    capacity = cluster.gpu.hbm_GiB * 2**30
    valid = f"a share of the GPU's memory in [0%, 100%) such as 10%, or a size below {cluster.gpu.hbm_GiB:g} GiB such as 6GiB"
    if raw.endswith("%"):
        try:
            share = float(raw[:-1])
        except ValueError:
            raise SpecError("--memory-headroom", text, valid) from None
        if not 0.0 <= share < 100.0:
            raise SpecError("--memory-headroom", text, valid)
        return int(share / 100.0 * capacity)
    if raw.replace(".", "", 1).isdigit():
        raise SpecError("--memory-headroom", text, "needs a unit: " + valid)
    try:
        size = parse_size(raw)
    except Exception:
        raise SpecError("--memory-headroom", text, valid) from None
    if size >= capacity:
        raise SpecError("--memory-headroom", text, valid)
    return size


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def check_cache_dir(cache_dir: Optional[str]) -> None:
    """Fail before any work when the trace cache folder (--cache-dir, $ECHO_PLAN_CACHE_DIR or the
    user cache folder) is not a folder where files can be created."""
    import os

    if cache_dir is not None:
        check_output_dir(cache_dir, "--cache-dir")
    else:
        check_output_dir(default_cache_root(), f"${ENV_VAR}" if os.environ.get(ENV_VAR) else "the trace cache folder")


def check_tp_pp(tp: int, pp: int) -> None:
    """--tp and --pp in range, before anything divides by them."""
    check_int("--tp", tp, 1, MAX_GPUS, "the tensor-parallel degree")
    check_int("--pp", pp, 1, MAX_GPUS, "the pipeline-parallel degree")


def data_parallel(num_gpus: int, tp: int, pp: int, dp: Optional[int], cp: int = 1) -> int:
    """--dp, or by default the GPUs left over by tp x cp x pp."""
    check_int("--cp", cp, 1, MAX_GPUS, "the context-parallel degree")
    if dp is not None:
        return dp
    if num_gpus % (tp * cp * pp):
        what = f"tp x cp x pp = {tp * cp * pp}" if cp > 1 else f"tp x pp = {tp * pp}"
        raise SpecError("--dp", None, f"GPUs {num_gpus} are not a multiple of {what}; "
                                      "give --dp or another --tp/--pp" + ("/--cp" if cp > 1 else ""))
    return num_gpus // (tp * cp * pp)


def fp8_stack(stack: SoftwareSpec, dtype: str, recipe: str | None, param_gather: bool | None) -> SoftwareSpec:
    """The stack with the --fp8-recipe / --fp8-param-gather choices; they need --dtype fp8."""
    changes: dict = {}
    if recipe is not None:
        changes["fp8_recipe"] = recipe
    if param_gather is not None:
        changes["fp8_param_gather"] = param_gather
    if not changes:
        return stack
    if str(dtype).lower() != "fp8":
        flag = "--fp8-recipe" if recipe is not None else "--fp8-param-gather"
        raise SpecError(flag, recipe if recipe is not None else param_gather, f"needs --dtype fp8 (not {dtype})")
    return stack.replace(**changes)


def expert_fields(ep: int, etp: int | None, imbalance: float) -> dict:
    """PlanSpec fields of the expert-parallel options (only those the user changed)."""
    out: dict = {}
    if ep != 1:
        out["ep"] = ep
    if etp is not None:
        out["etp"] = etp
    if imbalance != 1.0:
        out["expert_imbalance"] = imbalance
    return out


def dp_comm_fields(dp_comm: str, density: float | None) -> dict:
    """PlanSpec fields of --dp-comm / --density; names the valid methods for an unknown one."""
    valid = [m.value for m in DpComm]
    if dp_comm not in valid:
        raise SpecError("--dp-comm", dp_comm, f"one of {', '.join(valid)}")
    out: dict = {"dp_comm": dp_comm}
    if density is not None:
        out["density"] = density
    elif dp_comm != "dense":
        raise SpecError("--density", None, f"--dp-comm {dp_comm} needs --density D in (0, 1]")
    return out


def failure_model(rate: float | None, ckpt: float | None, restart: float | None, detect: float | None):
    """The goodput model's inputs (cost/goodput.py), defaults where an option is not given."""
    given = {k: v for k, v in (("interruptions_per_gpu_day", rate), ("checkpoint_GBps_per_gpu", ckpt),
                               ("restart_min", restart), ("detect_min", detect)) if v is not None}
    return FailureModel.build(given, context="failure model")
