"""Options and helpers shared by the CLI commands."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import typer

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


def write_atomic(path: str | Path, text: str) -> Path:
    """Write a whole file or nothing: a temporary file in the same folder, then a rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()
