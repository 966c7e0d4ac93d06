"""The report's inputs section: model, cluster (with sources), search space, version, caveats."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from echo_plan.report.chart import fmt_count
from echo_plan.specs import ModelSpec
from echo_plan.specs.calibration import UNCALIBRATED_ERROR

# What the prediction accounts for and what it leaves out (DESIGN.md, stages 2-4).
MODELLED = (
    "The transformer layer's operators and collectives, traced from PyTorch module code sharded as "
    "Megatron-LM shards it (with DTensor's layout copies on a PyTorch-native stack), with their real shapes "
    "(FakeTensorMode, fake process group), running the kernels the software stack runs: dense and "
    "mixture-of-experts layers (router, expert-parallel dispatch and combine), context parallelism, FP8 casts.",
    "Kernel times from a per-GPU roofline model with shape-dependent GEMM and attention efficiency, "
    "or a measured kernel database when one is given.",
    "NCCL collectives analytically: ring, tree and NVLS algorithms, LL/LL128/Simple protocols, NVLink "
    "inside a server and the NICs between servers; with --routing ecmp, this job's own flows colliding "
    "on leaf uplinks.",
    "Slowdown of compute kernels that overlap communication (interference).",
    "The pipeline schedule with its point-to-point transfers and bubbles, data-parallel gradient "
    "reduction overlapped with backward, parameter all-gather, and the optimizer step; with parameters "
    "sharded (FSDP, ZeRO-3, HSDP), each block's all-gather one block ahead of its compute and its "
    "gradients' reduce-scatter after its backward, as PyTorch's FSDP2 runs them (docs/fsdp.md).",
    "Memory per GPU: weights, gradients, optimizer states (with sharding), activations saved for "
    "backward, communication buffers.",
    "Faults you name: a slow GPU, NIC, NVLink domain or server (simulate --fault, whatif sensitivity, "
    "the fault sensitivity section); and goodput under failures, restarts and checkpoint writes at "
    "published average rates (docs/resilience.md).",
)
NOT_MODELLED = (
    "Data loading, evaluation, logging, and offloading activations (or ZeRO-3's parameters) to CPU memory; the "
    "optimizer's offload (--offload-optimizer, FSDP2's CPUOffloadPolicy with it) is costed from the host's spec "
    "figures, unvalidated.",
    "Stragglers and failures nobody names: a predicted step assumes healthy GPUs and links; failures "
    "enter only as an average rate, in goodput.",
    "Other jobs' traffic on the network, and thermal or power throttling.",
    "Memory the framework reserves beyond the modelled buffers (the allocator's fragmentation is modelled "
    "per allocator setting, measured on one H100): keep some headroom below the capacity line.",
    "Differences between library versions and kernel choices at run time: predictions are as good as "
    "the compute and collective calibration for this GPU.",
)


@dataclass(frozen=True, slots=True)
class Inputs:
    model: tuple[tuple[str, str], ...]
    cluster: tuple[tuple[str, str], ...]
    sources: tuple[str, ...]
    space: tuple[tuple[str, str], ...]
    run: tuple[tuple[str, str], ...]
    summary: tuple[tuple[str, str], ...] = ()  # shown open: model, cluster, calibration in a line each
    calibration: tuple[tuple[str, str], ...] = ()  # the cluster's calibration, one fitted figure or record a row
    modelled: tuple[str, ...] = MODELLED
    not_modelled: tuple[str, ...] = NOT_MODELLED


def _value(v: Any) -> str:
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, default=str)
    return str(v)


def model_rows(model: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(k.replace("_", " "), _value(v)) for k, v in model.items() if v not in (None, "")]
    try:  # the parameter count, when the mapping is a valid ModelSpec
        rows.insert(1, ("parameters", fmt_count(ModelSpec.build(dict(model)).num_params)))
    except Exception:  # an older or foreign mapping: show the fields only
        pass
    return rows


def cluster_rows(cluster: dict[str, Any]) -> list[tuple[str, str]]:
    gpu = cluster.get("gpu") or {}
    net = cluster.get("network") or {}
    nodes, per = cluster.get("num_nodes"), cluster.get("gpus_per_node")
    rows = [("name", _value(cluster.get("name", "?")))]
    if isinstance(nodes, int) and isinstance(per, int):
        rows.append(("size", f"{nodes} servers x {per} GPUs = {nodes * per} GPUs"))
    if gpu:
        rows.append(("GPU", f"{gpu.get('name', '?')}: {gpu.get('hbm_GiB', '?')} GiB, "
                            f"{gpu.get('peak_bf16_tflops', '?')} dense BF16 TFLOP/s, "
                            f"{gpu.get('hbm_bw_GBps', '?')} GB/s HBM"))
        rows.append(("NVLink", f"{gpu.get('nvlink_bw_GBps', '?')} GB/s per GPU (both directions), "
                               f"{gpu.get('nvlink_links', '?')} links"))
    if net:
        rows.append(("network", f"{net.get('nics_per_node', '?')} x {net.get('nic_bw_Gbps', '?')} Gb/s NICs "
                                f"per server, {net.get('fabric', '?')}, oversubscription "
                                f"{net.get('oversubscription', '?')}"))
        if net.get("routing", "none") != "none":
            rows.append(("routing", f"{net['routing']} across leaves ({net.get('flows_per_connection', 1)} flow(s) "
                                    f"per connection; {net.get('leaf_radix', '?')}-port leaves): docs/traffic.md"))
    rows.append(("calibration", calibration_summary(cluster.get("calibration"))
                 + (" (table below)" if cluster.get("calibration") else "")))
    return rows


def calibration_summary(calibration: Any) -> str:
    if not isinstance(calibration, dict) or "compute" not in calibration:
        return (f"NONE for this GPU: the kernel model as published ({UNCALIBRATED_ERROR}; calibrate with "
                "`echo-plan calibrate steps`)")
    fitted = "fitted: " + ", ".join(str(k) for k in calibration if k != "from")
    return fitted + (f"; inherited from {calibration['from']}" if calibration.get("from") else "")


def flat_rows(value: Any, path: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """A nested mapping as (path, value) rows: ``compute · gemm efficiency scale`` -> ``0.8228``; a list
    of plain values is one row."""
    here = " · ".join(path)
    if isinstance(value, dict):
        rows: list[tuple[str, str]] = []
        for k, v in value.items():
            rows += flat_rows(v, (*path, str(k).replace("_", " ")))
        return rows or [(here, "none")]
    if isinstance(value, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in value):
            return [(here, "; ".join(str(x) for x in value) or "none")]
        rows = []
        for n, v in enumerate(value, 1):
            rows += flat_rows(v, (*path, f"#{n}"))
        return rows
    return [(here, str(value))]


def _listing(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ", ".join(_listing(x) for x in v)
    if isinstance(v, bool):
        return "on" if v else "off"
    return _value(v)


def space_rows(space: dict[str, Any]) -> list[tuple[str, str]]:
    """The space as rows; a mapping such as its knobs opens into one row per key ("knobs · tp")."""
    rows: list[tuple[str, str]] = []
    for k, v in space.items():
        if isinstance(v, dict) and v:
            rows += [(f"{k} · {k2}".replace("_", " "), _listing(v2)) for k2, v2 in v.items()]
        else:
            rows.append((str(k).replace("_", " "), _listing(v)))
    return rows


def summary_rows(model_rows_: list[tuple[str, str]], cluster: dict[str, Any]) -> list[tuple[str, str]]:
    got = dict(model_rows_)
    model = got.get("name", "?") + (f", {got['parameters']} parameters" if "parameters" in got else "")
    nodes, per, gpu = cluster.get("num_nodes"), cluster.get("gpus_per_node"), (cluster.get("gpu") or {}).get("name")
    size = f"{nodes} x {per} GPUs" if isinstance(nodes, int) and isinstance(per, int) else "?"
    return [("model", model), ("cluster", f"{cluster.get('name', '?')}: {size}" + (f" {gpu}" if gpu else "")),
            ("calibration", calibration_summary(cluster.get("calibration")))]


def build_inputs(model: dict[str, Any], cluster: dict[str, Any], space: dict[str, Any],
                 run: list[tuple[str, str]]) -> Inputs:
    models = model_rows(model)
    calibration = cluster.get("calibration")
    return Inputs(tuple(models), tuple(cluster_rows(cluster)),
                  tuple(str(s) for s in cluster.get("sources") or ()), tuple(space_rows(space)), tuple(run),
                  tuple(summary_rows(models, cluster)),
                  tuple(flat_rows(calibration)) if isinstance(calibration, dict) and calibration else ())
