"""``echo-plan presets``: list the model and cluster presets with their key figures."""

from __future__ import annotations

import typer

from echo_plan.commands.common import JsonOpt, print_json


def register(app: typer.Typer) -> None:
    @app.command("presets")
    def presets(as_json: bool = JsonOpt) -> None:
        """List the model and cluster presets."""
        from echo_plan.specs import cluster_names, load_cluster, load_model, model_names

        models = [load_model(n) for n in model_names()]
        clusters = [load_cluster(n) for n in cluster_names()]
        if as_json:
            print_json({
                "models": [m.model_dump(mode="json") | {"num_params": m.num_params} for m in models],
                "clusters": [c.model_dump(mode="json") for c in clusters],
            })
            return
        typer.echo("Models:")
        for m in models:
            typer.echo(f"  {m.name:<12} {m.num_params / 1e9:7.1f}B  layers={m.num_layers} hidden={m.hidden_size} "
                       f"heads={m.num_attention_heads}/{m.kv_heads} seq={m.seq_length} {m.activation.value}")
        typer.echo("Clusters:")
        for c in clusters:
            typer.echo(f"  {c.name:<12} {c.num_nodes} x {c.gpus_per_node} {c.gpu.name}, "
                       f"{c.network.nics_per_node} x {c.network.nic_bw_Gbps:g} Gb/s per node")
