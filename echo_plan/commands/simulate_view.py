"""The human-readable view of a StepResult: key figures, the breakdown, memory per stage."""

from __future__ import annotations

from echo_plan.replay.results import GiB, StepResult
from echo_plan.specs.plan import PlanSpec


def print_result(result: StepResult, trace_path: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    plan = result.plan
    cp, ep, etp = int(plan.get("cp") or 1), int(plan.get("ep") or 1), plan.get("etp")
    label = (f"tp{plan['tp']}{f' cp{cp}' if cp > 1 else ''} pp{plan['pp']} dp{plan['dp']}"
             f"{f' ep{ep}' if ep > 1 else ''}{f' etp{etp}' if ep > 1 and etp is not None else ''} "
             f"mbs{plan['micro_batch_size']} "
             f"gbs{plan['global_batch_size']} vpp{plan['virtual_stages']} {plan['schedule']} "
             f"recompute={plan['recompute']}{' sp' if plan['sequence_parallel'] else ''}"
             f"{_sharding_words(plan)} {plan['dtype']}"
             + (f" {plan['dp_comm']}@{plan['density']:g}" if plan.get("dp_comm", "dense") != "dense" else ""))
    console.print(f"[bold]{result.model}[/bold] on [bold]{result.cluster}[/bold] ({result.num_gpus} GPUs): {label}"
                  + (f", stack {result.stack}" if result.stack else ""))

    head = Table(show_header=False, box=None, padding=(0, 2))
    rng, trng = result.step_time_range_s, result.tokens_per_s_range
    cov = f"{result.range_coverage:.0%} range " if result.range_coverage else "range "
    head.add_row("step time", f"{result.step_time_s:.4f} s" +
                 (f"   ({cov}{rng[0]:.3f} - {rng[1]:.3f} s)" if rng else ""))
    head.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s" +
                 (f"   ({trng[0]:,.0f} - {trng[1]:,.0f})" if trng else ""))
    if result.goodput:
        g = result.goodput
        head.add_row("goodput under failures", f"{g['goodput_tokens_per_s']:,.0f} tokens/s   (effective training "
                     f"time {g['effective_training_time_ratio']:.1%}; job MTBF {g['mtbf_min'] / 60:.1f} h, checkpoint "
                     f"every {g['checkpoint_interval_min']:.0f} min)")
    head.add_row("model TFLOP/s per GPU", f"{result.model_tflops_per_gpu:.1f}")
    head.add_row("hardware TFLOP/s per GPU", f"{result.hardware_tflops_per_gpu:.1f}")
    head.add_row("MFU", f"{result.mfu * 100:.1f} %")
    peak = max(result.memory, key=lambda m: m.total_bytes) if result.memory else None
    head.add_row("peak memory", f"{result.memory_peak_gib:.1f} GiB" + (
        f" of {peak.capacity_bytes / GiB:.0f} GiB ({peak.free_bytes / GiB:.1f} GiB free; a plan must keep "
        f"{peak.headroom_bytes / GiB:.1f} GiB headroom)" if peak else ""))
    over = result.overflow
    head.add_row("fits", "yes" if over is None else
                 f"[red]NO[/red]: stage {over[0]} over the usable memory by {over[1]:.1f} GiB")
    console.print(head)
    if result.range_basis:
        console.print(f"range: {result.range_basis}")

    bd = Table(title="Breakdown (rank that finishes last)", title_justify="left")
    bd.add_column("part")
    bd.add_column("seconds", justify="right")
    bd.add_column("share", justify="right")
    total = result.breakdown.total_s or 1.0
    for name, sec in result.breakdown.as_json().items():
        bd.add_row(name, f"{sec:.4f}", f"{sec / total * 100:.1f} %")
    bd.add_row("[bold]total[/bold]", f"{result.breakdown.total_s:.4f}", "100.0 %")
    console.print(bd)
    ex = result.dp_exchange
    if ex:
        dx = Table(title=f"Sparse data-parallel exchange per step: {ex['method']} at density {ex['density']:g} "
                         "(busiest pipeline rank; inside dp_comm_exposed)", title_justify="left")
        dx.add_column("part")
        dx.add_column("seconds", justify="right")
        dx.add_column("moved", justify="right")
        dx.add_row("selection (compute)", f"{ex['select_s']:.4f}", f"{ex['selected']:,} selected")
        dx.add_row("index exchange", f"{ex['index_exchange_s']:.4f}", f"{ex['index_bytes'] / 2**20:,.1f} MiB")
        dx.add_row("value exchange", f"{ex['value_exchange_s']:.4f}",
                   f"{ex['value_bytes'] / 2**20:,.1f} MiB ({ex['exchanged_values']:,} values)")
        dx.add_row("error feedback + combine", f"{ex['error_feedback_s']:.4f}", "")
        console.print(dx)

    fl = result.faults
    if fl:
        ft = Table(title=f"Faults: {result.step_time_s:.4f} s against {fl['healthy_step_time_s']:.4f} s healthy "
                         f"({fl['slowdown']:+.1%}); who waits", title_justify="left")
        for col in ("stage", "faults on it", "compute x", "network bw", "NVLink bw", "busy s", "waiting s"):
            ft.add_column(col, justify="right" if col != "faults on it" else "left")
        for st in fl["stages"]:
            ft.add_row(str(st["stage"]), ", ".join(st["causes"]) or "-", f"{st['compute_scale']:g}",
                       f"{st['network_bw']:g}", f"{st['nvlink_bw']:g}", f"{st['busy_s']:.3f}", f"{st['wait_s']:.3f}")
        console.print(ft)
        for f in fl["applied"]:
            if f["note"]:
                console.print(f"note: fault {f['kind']} {f['note']}")

    if result.traffic:
        from echo_plan.cost.traffic import traffic_table  # deferred: loads numpy

        console.print(traffic_table(result.traffic))

    mem = Table(title="Memory per pipeline stage (GiB)", title_justify="left")
    for col in ("stage", "weights", "grads", "optimizer", "activations", "buffers", "total", "usable", "fits"):
        mem.add_column(col, justify="right")
    for m in result.memory:
        mem.add_row(str(m.stage), *(f"{b / GiB:.2f}" for b in (
            m.weights_bytes, m.gradients_bytes, m.optimizer_bytes, m.activations_bytes, m.buffers_bytes,
            m.total_bytes, m.usable_bytes)),
            "yes" if m.fits else f"[red]no (+{m.overflow_bytes / GiB:.2f})[/red]" if m.overflow_bytes
            else "[red]no (host)[/red]")
    console.print(mem)
    for note in result.notes:
        console.print(f"note: {note}")
    if trace_path:
        console.print(f"timeline written to {trace_path} (open it in ui.perfetto.dev or chrome://tracing)")


def _sharding_words(plan: dict) -> str:
    """The plan's data-parallel sharding as the header shows it (PlanSpec's words; the level the stack gives
    is in the notes), and its layers recomputed whole."""
    spec = PlanSpec.model_validate(plan)
    words = "".join(f" {p}" for p in spec.sharding_parts())
    return words + (f" recompute{spec.recompute_layers}L" if spec.recompute_layers else "")
