"""The optimizer on the CPU (``--offload-optimizer``): what each GPU's share of the step costs on the host, and what
it keeps in host memory.

A rank's optimizer shard of ``n`` parameters moves three ways (the stack's ``optimizer_offload`` says which
framework's code path, software_kinds.py ``OptimizerOffload``):

* gradients to the host (D2H): the fp32 gradients of the shard, 4 bytes a parameter (Megatron-Core copies its fp32
  main gradients; DeepSpeed casts each reduced 16-bit gradient to fp32 on the GPU before copying it);
* the AdamW update on the CPU: a fused kernel (torch's fused CPU AdamW, which Megatron-Core asks for with
  ``fused=True``; DeepSpeedCPUAdam) reads the fp32 weight, gradient and both moments and writes weight and moments
  back, 28 bytes a parameter, then the fp32 weight is cast to the 16-bit copy sent back (torch casts on the CPU
  when a copy crosses devices and dtypes), 6 more: :data:`CPU_BYTES_PER_PARAM`. Memory-bound: the host's memory
  bandwidth shared by the server's GPUs, all stepping at once;
* the updated 16-bit weights back to the GPU (H2D), 2 bytes a parameter.

Megatron-Core's HybridDeviceOptimizer with ``overlap_cpu_optimizer_d2h_h2d`` gives every parameter its own CPU
optimizer and stream events, so the three run as a pipeline over the rank's parameters: the step costs the slowest
of the three (the first and last parameter's share of the others is small beside a shard of millions). DeepSpeed
copies the gradients during the backward pass, as each bucket is reduced (hidden here behind it), and after the
backward runs the CPU step of each parameter group, then its copy back: the CPU step plus the copy. With a share
(``offload_fraction`` below 1, Megatron-Core's ``--optimizer-offload-fraction``), the GPU steps the parameters it
keeps while the host steps its own (HybridDeviceOptimizer.step launches the GPU's optimizer first): the step waits
for the slower of the two.

What is a judgement, not a measurement: the host figures of a preset are spec-sheet peaks times an achievable share
(clusters/*.yaml say which); the CPU update is taken as memory-bound with each rank's threads (OMP_NUM_THREADS)
covering its share of the cores: torchrun's default of one thread per rank is several times slower, so the host's
part is a lower bound. No published run with the optimizer offloaded is among the validation suites, so none of
this is checked against measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.errors import SpecError
from echo_plan.specs.software_kinds import OptimizerOffload

GRAD_D2H_BYTES = 4.0  # fp32 gradients of the shard
PARAM_H2D_BYTES = 2.0  # the updated 16-bit weights
CPU_BYTES_PER_PARAM = 28.0 + 6.0  # fused AdamW (read w, g, m, v; write w, m, v, fp32) + the cast to 16 bits
# host memory per offloaded parameter: fp32 master weight, two fp32 moments (the CPU AdamW keeps fp32 moments
# whatever the stack's GPU optimizer does), the pinned fp32 gradient copy; DeepSpeed also pins the 16-bit copy it
# sends back (param_buffer_of_bit16_for_cpu_offload_groups)
HOST_BYTES_PER_PARAM = 16.0
# FSDP2: the fused CPU AdamW on the fp32 shard without a 16-bit copy to make; the fp32 shard goes to the GPU
FSDP2_CPU_BYTES_PER_PARAM = 28.0
FSDP2_H2D_BYTES = 4.0


@dataclass(frozen=True, slots=True)
class HostStep:
    """One rank's optimizer step with its offloaded share on the host, in seconds."""

    d2h_s: float
    cpu_s: float
    h2d_s: float
    exposed_s: float  # what the host's share makes the step wait for after the backward pass
    params: int  # offloaded parameters
    gpu_s: float = 0.0  # the share kept on the GPU, stepped there while the host steps its own (partial offload)

    def wait_s(self, gpu_scale: float = 1.0) -> float:
        """The optimizer step's wait: the host's share and the GPU's, at once (the GPU's ``gpu_scale`` times as long
        on a slow GPU)."""
        return max(self.exposed_s, self.gpu_s * gpu_scale)

    def as_json(self) -> dict:
        return {"params": self.params, "d2h_s": self.d2h_s, "cpu_s": self.cpu_s, "h2d_s": self.h2d_s,
                "exposed_s": self.exposed_s, "gpu_s": self.gpu_s}


def host_step(params: int, cluster, offload: OptimizerOffload, gpu_s: float = 0.0) -> HostStep:
    """The host step of a rank that offloads ``params`` parameters of its optimizer shard, on ``cluster``'s host, the
    way the stack's ``offload`` runs it; ``gpu_s``: the GPU's step of the share it keeps (Megatron-Core launches it
    before the CPU's, so the two run at once)."""
    host = require_host(cluster)
    if offload is OptimizerOffload.NONE:
        raise ValueError("host_step needs a stack that offloads the optimizer")
    fsdp2 = offload is OptimizerOffload.FSDP2  # the fp32 weights stay on the host: nothing cast, the fp32 shard in
    link = host.link_GBps * 1e9
    per_gpu_bw = host.memory_bw_GBps * 1e9 / cluster.gpus_per_node  # every rank of the server steps at once
    d2h = params * GRAD_D2H_BYTES / link
    cpu = params * (FSDP2_CPU_BYTES_PER_PARAM if fsdp2 else CPU_BYTES_PER_PARAM) / per_gpu_bw
    h2d = params * (FSDP2_H2D_BYTES if fsdp2 else PARAM_H2D_BYTES) / link
    if offload is OptimizerOffload.MEGATRON_HYBRID:
        exposed = max(d2h, cpu, h2d)
    elif offload is OptimizerOffload.ZERO_OFFLOAD:  # gradients copied during the backward pass, then step, copy back
        exposed = cpu + h2d
    else:  # FSDP2: the copies ride with each unit's collectives (fsdp_unit_copies_s)
        exposed = cpu
    return HostStep(d2h, cpu, h2d, exposed, int(params), gpu_s)


def fsdp_unit_copies_s(shard_params: float, grad_bytes: float, cluster) -> tuple[float, float]:
    """FSDP2 under CPUOffloadPolicy: one unit's copies between the host and the GPU, on its collectives' own streams:
    (its fp32 shard of ``shard_params`` parameters in, before each all-gather; its reduced gradient shard of
    ``grad_bytes`` a parameter out, after each reduce-scatter)."""
    link = require_host(cluster).link_GBps * 1e9
    return shard_params * FSDP2_H2D_BYTES / link, shard_params * grad_bytes / link


def offloaded_states(plan, stack, optimizer: float, grads: float, sharded_grads: float,
                     shard_params: float) -> tuple[float, float, float]:
    """(gradients, optimizer states) left on the GPU, and the host bytes, when ``plan`` offloads its optimizer shard of
    ``shard_params`` parameters: Megatron-Core and DeepSpeed keep the gradient buffer on the GPU and move the states
    (a share of them, ``offload_fraction``); FSDP2 moves the sharded gradients too (its sharded fp32 parameters are
    the optimizer's master weights, counted with the states)."""
    f = plan.offload_fraction
    host = host_bytes(f * shard_params, stack.optimizer_offload)
    if stack.optimizer_offload is OptimizerOffload.FSDP2:
        return grads - sharded_grads, 0.0, host
    return grads, (1.0 - f) * optimizer, host


def host_bytes(params: float, offload: OptimizerOffload) -> float:
    """Host memory one rank pins for an offloaded optimizer shard of ``params`` parameters."""
    extra = PARAM_H2D_BYTES if offload is OptimizerOffload.ZERO_OFFLOAD else 0.0
    return params * (HOST_BYTES_PER_PARAM + extra)


def host_share_bytes(cluster) -> float:
    """The host memory one GPU's rank may use: the usable share of a server's, split over its GPUs."""
    host = require_host(cluster)
    return host.memory_GiB * 2**30 * host.usable_fraction / cluster.gpus_per_node


def require_host(cluster):
    if cluster.host is None:
        raise SpecError("offload_optimizer", True, f"cluster {cluster.name} gives no host figures (CPU memory, its "
                        "bandwidth, the GPU-host link): add a host: section to its YAML (docs/clusters.md) or use a "
                        "preset that has one")
    return cluster.host


def offload_notes(steps, memory, cluster, stack, fraction: float = 1.0) -> list[str]:
    """simulate's lines on an offloaded optimizer: the slowest rank's host step by part, the host memory per server
    against what it may pin, and that none of it is checked against measurement. ``steps``: each pipeline rank's
    HostStep (None where nothing is offloaded); ``memory``: the StageMemory records."""
    steps = [s for s in steps if s is not None]
    if not steps:
        return []
    worst = max(steps, key=lambda s: s.wait_s())
    host = require_host(cluster)
    share = f" ({fraction:.0%} of its optimizer shard)" if fraction != 1.0 else ""
    how = {OptimizerOffload.MEGATRON_HYBRID: "the copies and the CPU step pipelined per parameter; the step waits "
                                             "for the slowest",
           OptimizerOffload.ZERO_OFFLOAD: "gradients copied during the backward pass; the step waits for the CPU "
                                          "update and the copy back",
           OptimizerOffload.FSDP2: "the parameters, gradients and optimizer states live on the host: each "
                                   "all-gather first copies its unit's fp32 shard in (all units: the weights' figure, "
                                   "once per gather pass) and each reduce-scatter its gradient shard out (the "
                                   "gradients' figure), on those collectives' streams (in the data-parallel part); "
                                   "the step waits for the CPU update"}[stack.optimizer_offload]
    beside = (f"beside the GPU's {worst.gpu_s:.3f} s for the share it keeps: {worst.wait_s():.3f} s "
              if worst.gpu_s else "")
    out = [f"optimizer offloaded to the CPU (stack {stack.name}: {stack.optimizer_offload.value}): "
           f"{worst.params / 1e9:.2f} B parameters per GPU{share}; gradients to the host {worst.d2h_s:.3f} s, "
           f"CPU AdamW {worst.cpu_s:.3f} s at {host.memory_bw_GBps / cluster.gpus_per_node:.0f} GB/s of host memory "
           f"bandwidth per GPU, weights back {worst.h2d_s:.3f} s over {host.link_GBps:g} GB/s; {how}: "
           f"{worst.exposed_s:.3f} s {beside}per step. An estimate from the cluster's host figures (spec sheets, "
           "achievable shares judged), not checked against measured runs; it assumes each rank's CPU threads "
           "(OMP_NUM_THREADS) cover its share of the cores (torchrun's default of 1 is several times slower), so it "
           "is a lower bound: users report offloaded steps several times longer (docs/fsdp.md); the step's 80% "
           "range comes from runs without offload and does not cover this part"]
    used = max(m.host_bytes for m in memory)
    cap = max(m.host_capacity_bytes for m in memory)
    server = cluster.gpus_per_node
    line = (f"host memory for the offloaded optimizer: {used * server / 2**30:.0f} GiB per server of "
            f"{cap * server / 2**30:.0f} GiB it may pin ({host.usable_fraction:.0%} of {host.memory_GiB:g} GiB)")
    if used > cap:
        line += ": does not fit; more GPUs (a smaller shard each) or a host with more memory"
    out.append(line)
    return out
