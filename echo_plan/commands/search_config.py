"""The options search and compare share, and the one builder from them to a SearchConfig: the model and cluster,
the space with the knobs the command line fixes (--cp, --dp-comm, --density, --dtype, --offload-optimizer), the
sampler, budget, storage, workers and the stack. Every bad value is a one-line error naming the flag."""

from __future__ import annotations

from typing import Optional

import typer

from echo_plan import limits as L
from echo_plan.commands.common import dp_comm_fields, fp8_stack, parse_headroom, resolve_specs, resolve_stack
from echo_plan.commands.launch_cmd import job_cluster
from echo_plan.errors import SpecError
from echo_plan.search.space import Knob, default_space_path_for, load_space
from echo_plan.search.storage import check_storage
from echo_plan.search.study import SamplerKind, SearchConfig


DEFAULT_GBS = 1536  # GPT-3 175B's global batch in Brown et al. 2020 (3.2M tokens at seq 2048)
DEFAULT_TOP = 10
GbsOpt = typer.Option(DEFAULT_GBS, "--gbs", help=f"global batch size in sequences (default {DEFAULT_GBS}, GPT-3's)")
SpaceOpt = typer.Option(None, "--space", help="search-space YAML (default search_spaces/default.yaml)")
SamplerOpt = typer.Option("auto", "--sampler",
                          help="auto (grid when the valid plans fit in the budget, else tpe), tpe, nsga2, grid")
TrialsOpt = typer.Option(None, "--trials", help="distinct plans to simulate (default 100)")
SeedOpt = typer.Option(0, "--seed", help="sampler seed; a search is deterministic for a seed")
StorageOpt = typer.Option(None, "--storage", help="Optuna storage URL (default SQLite in the user data dir); "
                                                  "'memory' for none")
StudyOpt = typer.Option(None, "--study-name", help="study name (default: derived from model, cluster, gbs, space)")
WorkersOpt = typer.Option(0, "--workers", help="evaluate on N local Ray workers (started and stopped here)")
RayOpt = typer.Option(None, "--ray-address", help="evaluate on an existing Ray cluster")
ProcessesOpt = typer.Option(None, "--processes", envvar="ECHO_PLAN_PROCESSES",
                            help="local worker processes, no Ray (default: one per CPU, at most 4, for a search of "
                                 "16 plans or more; 1 runs in-process)")
SearchDpCommOpt = typer.Option(None, "--dp-comm", help="fix the data-parallel exchange: dense | topk | cltk | "
                               "hard-threshold | exdyna (default: the space's dp_comm knob)")
ProgressOpt = typer.Option(None, "--progress/--no-progress", help="progress bar on stderr (default: when a TTY)")
ReportOpt = typer.Option(None, "--report", help="also write the HTML recommendation report to this file")
OffloadOpt = typer.Option(None, "--offload-optimizer/--no-offload-optimizer", help="fix the optimizer's place: in "
                          "CPU memory with a sharded optimizer, or on the GPUs (default: the space's offload_optimizer "
                          "knob, off; docs/fsdp.md)")


def build_config(model: str, cluster: str, nodes: Optional[int], gpus: Optional[int], gbs: int, space: Optional[str],
                 sampler: str, trials: Optional[int], seed: int, storage: Optional[str], study_name: Optional[str],
                 workers: int, ray_address: Optional[str], tokens: Optional[float] = None, stack: Optional[str] = None,
                 memory_headroom: Optional[str] = None, dp_comm: Optional[str] = None, density: Optional[float] = None,
                 dtype: Optional[str] = None, fp8_recipe: Optional[str] = None, fp8_param_gather: Optional[bool] = None,
                 processes: Optional[int] = None, seq_length: Optional[int] = None, cp: Optional[int] = None,
                 routing: Optional[str] = None, flows_per_connection: Optional[int] = None, job=None,
                 cache_dir: Optional[str] = None, offload_optimizer: Optional[bool] = None):
    """The SearchConfig a search or compare command line gives (for one cluster), each value checked."""
    try:
        kind = SamplerKind(sampler.lower())
    except ValueError:
        raise SpecError("--sampler", sampler, "one of " + ", ".join(k.value for k in SamplerKind)) from None

    if trials is not None:
        L.check_int("--trials", trials, 1, L.MAX_TRIALS, "distinct plans to simulate")
    L.check_int("--workers", workers, 0, L.MAX_WORKERS, "0 runs in-process, N starts N local Ray workers")
    if processes is not None:
        L.check_int("--processes", processes, 1, L.MAX_WORKERS, "local worker processes; 1 runs in-process")
        if processes > 1 and (workers or ray_address):
            raise SpecError("--processes", processes, "1 (or leave it out) when --workers or --ray-address runs the "
                            "search on Ray")
    L.check_int("--seed", seed, 0, L.MAX_SEED, "the sampler's seed")
    L.check_int("--gbs", gbs, 1, L.MAX_GLOBAL_BATCH, "sequences per step")

    check_storage(storage)
    if job is not None:  # --from-launch: the job's model, GPUs, batch and stack
        m, c = job.model, job_cluster(cluster, nodes, job).with_routing(routing, flows_per_connection)
    else:
        m, c = resolve_specs(model, cluster, nodes, gpus, seq_length=seq_length, routing=routing,
                             flows_per_connection=flows_per_connection)
    space_spec = load_space(space if space is not None else default_space_path_for(
        m, job.stack if job is not None else resolve_stack(stack)))
    if cp is not None:  # --cp fixes the cp knob
        L.check_int("--cp", cp, 1, L.MAX_GPUS, "the context-parallel degree")
        space_spec = space_spec.with_values({"cp": (cp,)})
    if dp_comm is not None or density is not None:  # --dp-comm / --density fix those knobs

        fields = dp_comm_fields(dp_comm or "dense", density)
        space_spec = space_spec.with_values({k: (v,) for k, v in fields.items()})
    if dtype is not None and "," not in dtype:  # --dtype fixes the precision knob (a list: compare per dtype)
        space_spec = space_spec.with_values({"dtype": (dtype,)})
    if offload_optimizer is not None:  # --offload-optimizer fixes that knob (and shards the optimizer it moves)
        fixed = {"offload_optimizer": (offload_optimizer,)}
        space_spec = space_spec.with_values(dict(fixed, distributed_optimizer=(True,)) if offload_optimizer else fixed)

    any_fp8 = "fp8" if "fp8" in space_spec.values(Knob.DTYPE) or "fp8" in str(dtype or "") else str(dtype or "bf16")
    return SearchConfig(model=m, cluster=c, global_batch_size=gbs, space=space_spec, sampler=kind, seed=seed,
                        n_trials=trials, storage=storage, study_name=study_name, workers=workers,
                        ray_address=ray_address, processes=processes, tokens_budget=tokens,
                        stack=fp8_stack(job.stack if job is not None else resolve_stack(stack), any_fp8, fp8_recipe,
                                        fp8_param_gather),
                        memory_headroom_bytes=parse_headroom(memory_headroom, c), cache_dir=cache_dir)
