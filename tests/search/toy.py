"""A small deterministic evaluator and memory estimator for testing the search machinery.

They stand in for ``simulate`` and ``estimate_memory`` by dependency injection (the search takes
any Evaluator / MemoryEstimator); the formulas are a coarse analytical model of Megatron-style
training so the landscape has the right shape (TP communication, bubbles, recompute cost,
optimizer sharding), not a prediction of anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from echo_plan.cost.stage_memory import StageMemory
from echo_plan.replay.results import Breakdown, StepResult
from echo_plan.specs import ClusterSpec, ModelSpec, PlanSpec

GiB = 2**30


def toy_memory(model: ModelSpec, plan: PlanSpec, cluster: ClusterSpec) -> tuple[StageMemory, ...]:
    params = model.num_params / (plan.tp * plan.pp)
    opt = 12 * params / (plan.dp if plan.distributed_optimizer else 1)
    tokens = plan.micro_batch_size * model.seq_length
    per_layer = {"none": 34, "selective": 18, "full": 2}[plan.recompute.value] * tokens * model.hidden_size
    if plan.sequence_parallel:
        per_layer /= plan.tp
    else:
        per_layer /= max(1, plan.tp // 2)
    layers = model.num_layers / plan.pp
    inflight = min(plan.pp, plan.num_microbatches)
    act = per_layer * layers * inflight * (1 + 0.1 * (plan.virtual_stages - 1))
    cap = int(cluster.gpu.hbm_GiB * GiB)
    return tuple(StageMemory(s, int(2 * params), int(2 * params), int(opt), int(act), 1 * GiB, cap)
                 for s in range(plan.pp))


def toy_step(model: ModelSpec, cluster: ClusterSpec, plan: PlanSpec) -> StepResult:
    tokens = plan.global_batch_size * model.seq_length
    flops = 6 * model.num_params * tokens
    gpus = cluster.num_gpus
    eff = 0.55 * min(1.0, 0.7 + 0.1 * plan.micro_batch_size) * (1.0 - 0.03 * (plan.tp - 1) / 7)
    compute = flops / (gpus * cluster.gpu.peak_bf16_tflops * 1e12 * eff)
    compute *= {"none": 1.0, "selective": 1.04, "full": 1.33}[plan.recompute.value]
    tp_comm = compute * 0.02 * (plan.tp - 1) * (0.8 if plan.sequence_parallel else 1.0)
    m = plan.num_microbatches
    bubble = (compute + tp_comm) * (plan.pp - 1) / (m * plan.virtual_stages)
    pp_comm = 0.0005 * m * (plan.pp > 1) * plan.virtual_stages
    grad_bytes = 2 * model.num_params / (plan.tp * plan.pp)
    dp_comm = 0.0 if plan.dp == 1 else grad_bytes / 40e9 * (0.2 if plan.overlap_grad_reduce else 1.0)
    optimizer = 16 * model.num_params / (plan.tp * plan.pp) / cluster.gpu.hbm_bw_GBps / 1e9
    if plan.distributed_optimizer:
        optimizer /= plan.dp
    bd = Breakdown(compute, tp_comm, pp_comm, dp_comm, bubble, 0.0, optimizer)
    step = bd.total_s
    model_tflops = flops / step / gpus / 1e12
    return StepResult(
        model=model.name, cluster=cluster.name, num_gpus=gpus, plan=plan.model_dump(mode="json"),
        step_time_s=step, tokens_per_s=tokens / step, model_tflops_per_gpu=model_tflops,
        hardware_tflops_per_gpu=model_tflops, mfu=model_tflops / cluster.gpu.peak_bf16_tflops,
        memory=toy_memory(model, plan, cluster), breakdown=bd,
    )


class ToyEvaluator:
    def __init__(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        self.model, self.cluster = model, cluster
        self.calls = 0
        self._keys: set[tuple] = set()
        self._made = self._hits = 0

    def evaluate(self, plan: PlanSpec) -> StepResult:
        self.calls += 1
        key = (plan.tp, plan.sequence_parallel, plan.micro_batch_size, plan.recompute)
        if key in self._keys:
            self._hits += 1
        else:
            self._keys.add(key)
            self._made += 1
        return toy_step(self.model, self.cluster, plan)

    @property
    def traces_made(self) -> int:
        return self._made

    @property
    def cache_hits(self) -> int:
        return self._hits


@dataclass(frozen=True)
class ToyFactory:
    model: ModelSpec
    cluster: ClusterSpec

    def build(self) -> ToyEvaluator:
        return ToyEvaluator(self.model, self.cluster)
