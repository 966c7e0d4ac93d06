"""Options and helpers shared by the CLI commands."""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import typer

from echo_plan.files import write_atomic  # noqa: F401  (commands import it from here)
from echo_plan.specs import DEFAULT_CLUSTER, DEFAULT_MODEL, ClusterSpec, ModelSpec, load_cluster, load_model

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="model preset name or a YAML/JSON/HF config.json file")
ClusterOpt = typer.Option(DEFAULT_CLUSTER, "--cluster", "-c", help="cluster preset name or a YAML file")
NodesOpt = typer.Option(None, "--nodes", help="resize the cluster to N servers")
GpusOpt = typer.Option(None, "--gpus", help="resize the cluster to G GPUs (whole servers)")
JsonOpt = typer.Option(False, "--json", help="print one JSON object instead of a table")
CacheDirOpt = typer.Option(
    None, "--cache-dir", help="trace cache folder (default: $ECHO_PLAN_CACHE_DIR or the user cache dir)"
)


def resolve_specs(model: str, cluster: str, nodes: Optional[int], gpus: Optional[int]) -> tuple[ModelSpec, ClusterSpec]:
    return load_model(model), load_cluster(cluster, nodes=nodes, gpus=gpus)


def print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
