"""``echo-plan presets``: list the model and cluster presets with their key figures."""

from __future__ import annotations

import typer

from echo_plan.commands.common import JsonOpt, print_json
from echo_plan.specs import cluster_names, load_cluster, load_model, load_stack, model_names, stack_names
from echo_plan.specs.presets import CLUSTER_ALIASES


def register(app: typer.Typer) -> None:
    @app.command("presets")
    def presets(as_json: bool = JsonOpt) -> None:
        """List the model, cluster and software-stack presets."""
        models = [load_model(n) for n in model_names()]
        clusters = [load_cluster(n) for n in cluster_names()]
        stacks = [load_stack(n) for n in stack_names()]
        if as_json:
            print_json({
                "models": [m.model_dump(mode="json") | {"num_params": m.num_params} for m in models],
                "clusters": [c.model_dump(mode="json") for c in clusters],
                "stacks": [s.model_dump(mode="json") for s in stacks],
            })
            return
        typer.echo("Models:")
        width = max(len(m.name) for m in models)
        for m in models:
            typer.echo(f"  {m.name:<{width}} {m.num_params / 1e9:7.1f}B  layers={m.num_layers} hidden={m.hidden_size} "
                       f"heads={m.num_attention_heads}/{m.kv_heads} seq={m.seq_length} {m.activation.value}")
        typer.echo("Clusters:")
        width = max(len(n) for n in [c.name for c in clusters] + list(CLUSTER_ALIASES))
        for c in clusters:
            calibrated = "calibrated: " + ", ".join(calibrated_parts(c.calibration)) if c.calibration else \
                "not calibrated"
            typer.echo(f"  {c.name:<{width}} {c.num_nodes} x {c.gpus_per_node} {c.gpu.name}, "
                       f"{c.network.nics_per_node} x {c.network.nic_bw_Gbps:g} Gb/s per node"
                       + (f", NVLink domain {c.domain_gpus} GPUs" if c.domain_gpus > c.gpus_per_node else "")
                       + (f", host {c.host.memory_GiB:g} GiB" if c.host is not None else "")
                       + f" ({calibrated})")
        for alias, target in sorted(CLUSTER_ALIASES.items()):
            typer.echo(f"  {alias:<{width}} another name for {target}")
        typer.echo("Software stacks (--stack; a YAML file with base: NAME changes some settings):")
        width = max(len(s.name) for s in stacks)
        for s in stacks:
            typer.echo(f"  {s.name:<{width}} {s.description}")


def calibrated_parts(calibration: dict) -> list[str]:
    """The calibrated parts of a cluster, saying when its NCCL figures are only the MoE all-to-all share
    (the H100/H800 presets: no nccl-tests logs of those clusters are held); ``host`` is the host's issue time of an
    MoE layer's kernels, not the CPU memory of the cluster's ``host:`` section."""
    parts = []
    for name in sorted(calibration):
        if name == "from":  # which preset the inherited sections came from
            continue
        params = set(((calibration.get(name) or {}).get("params") or {})) if name == "nccl" else set()
        parts.append("nccl (MoE all-to-all share only)" if params == {"all_to_all_net_efficiency"}
                     else "host issue time" if name == "host" else name)
    if calibration.get("from"):
        parts.append(f"inherited from {str(calibration['from']).split(' ')[0]}")
    return parts
