"""The search's memory estimate made to agree with the tracer for low-precision plans.

The search prunes candidates with the closed-form activations (``cost/activation_memory.py``) before it
simulates any. In bf16 those equal the traced layers' saved bytes (tests/search/test_activation_scale.py);
in FP8 and NVFP4 they do not: the closed form keeps every saved tensor in the parameters' dtype, where
the stacks save many linear inputs as FP8 copies (a byte per element) and DeepSeek's caches more in FP8.
Measured on the traces: the closed form is 7-30% above the traced layers of Megatron-Core FP8 layouts and
60-75% above DeepSeek-V3's MoE layer with the ``deepseek-v3`` stack, so the estimate pruned DeepSeek's own
recipe (97 GiB estimated, 70.6 simulated, on 80 GB cards) and the search never saw it: an overestimate
hides the best plan.

The zero-bubble schedules' estimate has a second stand-in, in every precision: what a split backward keeps
from B until W, judged at about what a layer saves without recomputation; for GPT-3 175B's zero-bubble
plans on the default H800 search that was under what the traced layers keep, and 8 of the README search's 100
simulations went to plans that did not fit.

For each low precision (and, with a split backward, each precision), tensor-parallel layout and recompute mode
the candidates use, one reference layer of each kind is traced (tp, sequence parallelism and recompute as the candidate's; micro-batch 1, no context
parallelism, every expert local), and the ratio of its saved bytes to the closed form's scales the closed
form of every candidate with that layout; so does the ratio of what a split backward keeps from B until W
(zero-bubble and DualPipe schedules) to the closed form's stand-in for it. The ratio depends on the
tensor-parallel split (which tensors are replicated), not on the micro-batch, the sequence or the expert
layout (the routing is balanced): measured on DeepSeek-V3's MoE layer, 1.60 at tp 1 with ep 8 and ep 64,
1.68 at tp 2, 1.75 at tp 4. The reference traces go to the search's trace cache, where the plans simulated
later with the same layout find them. benchmarks/estimate_accuracy.py prints estimate against simulation.
"""

from __future__ import annotations

from echo_plan.cost.activation_memory import layer_activation_bytes
from echo_plan.cost.memory import RETAINED
from echo_plan.layout.backward_split import retained_bytes, split_backward
from echo_plan.specs.cluster import ClusterSpec, DType
from echo_plan.specs.model import ModelSpec
from echo_plan.specs.moe import LayerKind
from echo_plan.specs.plan import PlanSpec, Recompute
from echo_plan.specs.software import SoftwareSpec
from echo_plan.trace.cache import TraceCache

EXACT = (DType.BF16, DType.FP16, DType.FP32)  # the closed form is the traced saved bytes there


class TracedActivationScale:
    """``scale(plan)(kind, recompute)``: traced / closed-form saved bytes of one layer of ``kind`` under
    ``recompute`` for ``plan``'s precision and tensor-parallel layout (1.0 where the closed form is exact);
    ``recompute`` RETAINED: what a split backward keeps from B until W, traced, over the closed form without
    recomputation (the estimate's stand-in for it). Traces once per (dtype, tp, sequence parallelism,
    recompute); holds the ratios, nothing else."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, stack: SoftwareSpec, cache: TraceCache) -> None:
        self.model, self.cluster, self.stack, self.cache = model, cluster, stack, cache
        self._ratios: dict[tuple, dict[tuple[LayerKind, Recompute], float]] = {}

    def __call__(self, plan: PlanSpec):
        if plan.dtype in EXACT and not plan.schedule.split_backward:
            return None  # the closed form is the traced bytes, and no W pass keeps anything
        key = (plan.dtype, plan.tp, plan.sequence_parallel, plan.recompute)
        if key not in self._ratios:
            self._ratios[key] = self._measure(plan)
        ratios = self._ratios[key]
        return lambda kind, recompute: ratios.get((kind, recompute), 1.0)

    def _measure(self, plan: PlanSpec) -> dict[tuple[LayerKind, Recompute], float]:
        from echo_plan.trace.tracer import trace_model  # deferred: loads torch, only for a low-precision space

        ref = PlanSpec.build({"tp": plan.tp, "pp": 1, "dp": 1, "cp": 1, "ep": 1, "etp": 1,
                              "micro_batch_size": 1, "global_batch_size": 1, "dtype": plan.dtype.value,
                              "recompute": plan.recompute.value, "sequence_parallel": plan.sequence_parallel},
                             "reference plan for the memory estimate")
        stack = self.stack.as_run(ref, self.cluster.gpu.sm_arch)
        out: dict[tuple[LayerKind, Recompute], float] = {}
        for kind, trace in trace_model(self.model, ref, self.cache, stack).blocks:
            for mode, saved in trace.saved_bytes_by_mode.items():
                closed = layer_activation_bytes(self.model, ref, Recompute(mode), stack, kind)
                if closed > 0 and saved > 0:
                    out[(kind, Recompute(mode))] = saved / closed
            closed = layer_activation_bytes(self.model, ref, Recompute.NONE, stack, kind)
            kept = retained_bytes(trace, split_backward(trace)[1])  # under the plan's recompute, as simulate has it
            if closed > 0 and kept > 0:
                out[(kind, RETAINED)] = kept / closed
        return out
