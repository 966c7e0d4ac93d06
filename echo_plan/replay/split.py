"""Level 1 for the zero-bubble and DualPipe schedules: the two parts of a traced backward, timed.

Zero-bubble schedules (Qi et al., ICLR 2024) run a layer's backward as two separately scheduled
passes: B, the input gradient (what the previous stage waits for), and W, the weight gradients
(deferrable). Which traced ops belong to which part follows from the trace alone, by data flow
(``layout/backward_split.py``: ``split_backward``, and ``retained_bytes``, what deferring W keeps alive).

Each part is replayed on its own (:func:`replay_split`), so a collective that used to hide behind
a weight-gradient GEMM (the input gradient's reduce-scatter) is exposed in B when W runs later, as
on a GPU.

DualPipe (DeepSeek-V3, arXiv 2412.19437 section 3.2.1) runs the forward of one micro-batch and the
backward of another as one overlapped pair; :func:`pair_saving` replays a layer's forward and
backward ops together, issued alternately between their collectives, so each one's communication
(the MoE all-to-all, TP collectives) runs beside the other's compute. The saving is how much
shorter the pair is than the two run one after the other.

A chunk's layers run back to back, so the pair of two chunks of n layers is one overlapped sequence,
not n separate pairs: a layer's last exchange hides under the next layer's compute (DeepSeek's published
profile of a 4-layer chunk pair shows no break at the layer boundaries). A replay of a two-layer pair
gives what each further layer saves (``pair_marginal_s``), and n layers save the first layer's saving
plus n - 1 marginal ones: exact where the order of issue repeats layer by layer (DeepSeek-V3's MoE layer:
34.3, 64.8, 95.3 and 125.8 ms for 1-4 layers), within 1% of the pair's time for tensor-parallel layers
whose list-scheduled order does not quite (tests/replay/test_split.py). Replaying every layer of a chunk
would cost a pair replay per layer and plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echo_plan.layout.backward_split import retained_bytes, split_backward
from echo_plan.replay.engine import replay
from echo_plan.replay.interference import InterferenceModel
from echo_plan.replay.kinds import TaskKind
from echo_plan.replay.layer import PhaseTiming, _phase, phase_tasks
from echo_plan.trace.records import LayerTrace, Phase

__all__ = ["SplitTiming", "replay_split", "split_timings", "pair_saving", "pair_replay", "pair_saving_of",
           "zb_v_times"]


@dataclass(frozen=True, slots=True)
class SplitTiming:
    """A traced stage's backward as B (input gradient) and W (weight gradients), one micro-batch."""

    input_grad: PhaseTiming
    weight_grad: PhaseTiming
    retained_bytes: int  # activations and gradients W reads, alive from B until W
    pair_saving_s: float  # DualPipe: forward + backward overlapped is this much shorter (>= 0)
    pair_marginal_s: float = 0.0  # what each further layer of the same kind in the chunk pair saves (>= 0)


def replay_split(trace: LayerTrace, compute, comm, cluster, dtype, interference: InterferenceModel,
                 forward: PhaseTiming | None = None, backward: PhaseTiming | None = None,
                 layer: bool = True) -> SplitTiming:
    """B and W timings of one traced stage (each replayed alone), W's retained bytes, and the
    DualPipe pair saving (needs the stage's whole ``forward`` and ``backward`` timings); for a
    ``layer`` (not the embedding or the output, of which a chunk has one) what each further layer of a
    chunk pair saves too."""
    b_ops, w_ops = split_backward(trace)
    b = _phase(list(b_ops), compute, comm, cluster, dtype, interference)
    w = _phase(list(w_ops), compute, comm, cluster, dtype, interference)
    saving = marginal = 0.0
    if forward is not None and backward is not None:
        apart = forward.duration_s + backward.duration_s
        saving = pair_saving(trace, compute, comm, cluster, dtype, interference, apart)
        if saving > 0.0 and layer:
            marginal = pair_saving(trace, compute, comm, cluster, dtype, interference, 2 * apart, layers=2) - saving
    return SplitTiming(b, w, retained_bytes(trace, w_ops), saving, max(0.0, marginal))


def pair_saving(trace: LayerTrace, compute, comm, cluster, dtype, interference: InterferenceModel,
                apart_s: float, layers: int = 1, backward_trace: LayerTrace | None = None) -> float:
    """How much shorter the forward of ``layers`` layers of one micro-batch and the backward of as many of
    another (of ``backward_trace``'s kind where given) run as an overlapped pair (segment by segment between
    collectives: issued alternately, forward first, or in a list scheduler's order, whichever finishes first)
    than apart (``apart_s``: the two passes of all those layers one after the other)."""
    together = pair_replay(trace, compute, comm, cluster, dtype, interference, layers, backward_trace)
    return 0.0 if together is None else max(0.0, apart_s - together.makespan_s)


def mixed_pair_savings(traces, timing: dict, compute, comm, cluster, dtype, interference: InterferenceModel,
                       cache: dict, cluster_key: str) -> dict:
    """(first layer pair's saving, each further layer's) of a forward of one layer kind beside the backward of
    another, for every ordered pair of the plan's distinct traced kinds (a dense layer's compute can hide an MoE
    layer's exchange, which neither kind's own pair shows)."""
    out = {}
    blocks = list(traces.blocks)
    for a, ta in blocks:
        for b, tb in blocks:
            if a == b:
                continue
            key = ("mixed-pair", ta.key.digest(), tb.key.digest(), compute, comm, cluster_key, dtype, interference)
            hit = cache.get(key)
            if hit is None:
                apart = timing["blocks"][a].forward.duration_s + timing["blocks"][b].backward.duration_s
                one = pair_saving(ta, compute, comm, cluster, dtype, interference, apart, 1, tb)
                two = pair_saving(ta, compute, comm, cluster, dtype, interference, 2 * apart, 2, tb) if one > 0 else 0
                hit = cache[key] = (one, max(0.0, two - one))
            out[(a, b)] = hit
    return out


def pair_replay(trace: LayerTrace, compute, comm, cluster, dtype, interference: InterferenceModel,
                layers: int = 1, backward_trace: LayerTrace | None = None):
    """The replay of one micro-batch's forward beside another's backward of ``layers`` consecutive layers
    of this stage's kind (whichever order of issue finishes first; each task's start and end as it ran,
    interference included), or None when there is no communication to hide and the pair is the two passes
    back to back. ``backward_trace``: a layer of another kind whose backward runs beside this one's forward
    (a pair of two kinds: DualPipe's dense first stage beside an MoE stage), else this one. Task ids are the
    trace's op indices (the other trace's shifted past them), plus ``k`` times the id range for the k-th
    further layer."""
    if layers < 1:
        raise ValueError(f"layers {layers}: a pair has at least one layer")
    other = backward_trace if backward_trace is not None else trace
    fwd = phase_tasks([op for op in trace.ops if op.phase is Phase.FORWARD], compute, comm, cluster, dtype)
    bwd = phase_tasks([op for op in other.ops if op.phase is not Phase.FORWARD], compute, comm, cluster, dtype)
    if not any(t.kind.is_comm for t in fwd + bwd):
        return None
    width = 1 + max((op.index for op in trace.ops), default=0)
    if backward_trace is not None:  # its ops are numbered from 0 too: shift them past this trace's
        bwd = [replace(t, id=t.id + width, deps=tuple(d + width for d in t.deps)) for t in bwd]
        width += 1 + max((op.index for op in other.ops), default=0)
    fwd, bwd = _repeated(fwd, layers, width), _repeated(bwd, layers, width)
    fwd, bwd = _own_exchange_stream(fwd), _own_exchange_stream(bwd)
    fs, bs = _segments(fwd), _segments(bwd)
    return min((replay(order, interference) for order in (_alternate(fs, bs), _greedy(fs, bs))),
               key=lambda r: r.makespan_s)


def _repeated(tasks: list, layers: int, width: int) -> list:
    """``tasks`` (one layer's pass) run ``layers`` times back to back: each copy's ids and dependencies
    shifted by ``width``. A layer's first ops need the previous layer's output, which its last compute op
    wrote; the compute stream's order keeps that."""
    return [t if k == 0 else replace(t, id=t.id + k * width, deps=tuple(d + k * width for d in t.deps))
            for k in range(layers) for t in tasks]


def _own_exchange_stream(tasks: list) -> list:
    """The MoE all-to-alls of a pair on a stream of their own: the overlapped schedules run the token
    exchange on a communication stream (or SMs) apart from the tensor-parallel collectives, so one
    pass's attention collectives do not queue behind the other pass's exchange."""
    return [replace(t, stream="ep_comm") if t.kind is TaskKind.ALL_TO_ALL else t for t in tasks]


def _greedy(first: list[list], second: list[list]) -> list:
    """Segments of two passes issued in the order a list scheduler picks: next, the segment that can
    start its compute soonest (each segment's compute waits for its own pass's previous collectives;
    one compute stream, a FIFO per communication stream), so one pass's exchange runs under the
    other's compute where the two passes allow it (Megatron-Core's and DeepSeek's pairs: attention
    beside the other micro-batch's combine, experts beside its dispatch)."""
    queues, pos, comm_done = (first, second), [0, 0], [0.0, 0.0]
    t_compute, t_stream = 0.0, {}
    merged: list = []
    while pos[0] < len(first) or pos[1] < len(second):
        live = [i for i in (0, 1) if pos[i] < len(queues[i])]
        # soonest first; on a tie, the segment that issues a collective (its transfer then runs under the other's)
        i = min(live, key=lambda j: (max(t_compute, comm_done[j]), not queues[j][pos[j]][-1].kind.is_comm, j))
        seg = queues[i][pos[i]]
        t_compute = max(t_compute, comm_done[i]) + sum(t.work_s for t in seg if not t.kind.is_comm)
        for t in seg:
            if t.kind.is_comm:
                t_stream[t.stream] = max(t_stream.get(t.stream, 0.0), t_compute) + t.work_s
                comm_done[i] = max(comm_done[i], t_stream[t.stream])
        merged += seg
        pos[i] += 1
    return merged


def _alternate(first: list[list], second: list[list]) -> list:
    """Segments of two passes issued alternately, ``first``'s segment of each round before ``second``'s."""
    merged: list = []
    for i in range(max(len(first), len(second))):
        merged += (first[i] if i < len(first) else []) + (second[i] if i < len(second) else [])
    return merged


def _segments(tasks: list) -> list[list]:
    """Tasks cut after each collective: a segment is compute work ending in the communication it issues. A
    pass with no collective (a dense layer without tensor parallelism beside an MoE layer) waits for nothing,
    so each of its ops is a segment: the other pass's exchange can run under any of them."""
    if not any(t.kind.is_comm for t in tasks):
        return [[t] for t in tasks]
    out: list[list] = [[]]
    for t in tasks:
        out[-1].append(t)
        if t.kind.is_comm:
            out.append([])
    return [s for s in out if s]


def split_timings(cache: dict, traces, timing: dict, compute, comm, cluster, cluster_key: str, dtype,
                  interference: InterferenceModel, pairs: bool = True) -> dict:
    """:func:`replay_split` of every traced stage of a plan (block, embedding, output, each layer kind),
    kept in ``cache`` (the caller's memo) by trace and models."""
    def one(trace, lt, layer=True):
        key = ("split", trace.key.digest(), compute, comm, cluster_key, dtype, interference, layer)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = replay_split(trace, compute, comm, cluster, dtype, interference, lt.forward,
                                            lt.backward, layer)
        return hit
    out = {name: one(getattr(traces, name), timing[name], name == "block") for name in ("block", "embedding",
                                                                                       "output")}
    out["blocks"] = {kind: one(t, timing["blocks"][kind]) for kind, t in traces.blocks}
    if pairs:  # a schedule that pairs a forward with a backward: the pairs of two kinds too
        out["pairs"] = mixed_pair_savings(traces, timing, compute, comm, cluster, dtype, interference, cache,
                                          cluster_key)
    return out


def zb_v_times(f_s: float, b_s: float, w_s: float) -> tuple[float, float, float]:
    """The F : Bi : W ratios ZB-V's order is list-scheduled with, rounded to halves of F: on a coarse
    grid the order settles into a short period, so the step is affine in the micro-batch count and the
    steady state extrapolates exactly (replay/steady.py); finer ratios gave orders without a period
    (full replays of ~300k tasks) for a few per cent of step time. Plans with close ratios share an order."""
    f_s = max(f_s, 1e-12)
    return (1.0, max(0.5, round(2 * b_s / f_s) / 2), max(0.5, round(2 * w_s / f_s) / 2))


def pair_saving_of(f_kinds, b_kinds, split) -> float:
    """What overlapping a chunk's forward with another chunk's backward saves (DualPipe, and the
    stacks that pair a forward with a backward to hide the MoE exchange), layer by layer: the k-th layer
    of one beside the k-th of the other, the first pair saving what a lone layer pair saves and each
    further one what one more layer of an overlapped chunk saves (a pair of two kinds: its own replay,
    ``split["pairs"]``, one kind's forward beside the other's backward)."""
    def flat(kinds):
        return [k for k, n in kinds for _ in range(n)]

    def timing(k):
        return split["blocks"].get(k, split["block"])

    def saving(a, b, first: bool) -> float:
        if a == b:
            t = timing(a)
            return t.pair_saving_s if first else t.pair_marginal_s
        mixed = split.get("pairs", {}).get((a, b))
        if mixed is not None:
            return mixed[0] if first else mixed[1]
        ta, tb = timing(a), timing(b)  # no replay of the two together: the lesser of their own pairs
        return min(ta.pair_saving_s, tb.pair_saving_s) if first else min(ta.pair_marginal_s, tb.pair_marginal_s)
    pairs = list(zip(flat(f_kinds), flat(b_kinds)))
    return sum(saving(a, b, i == 0) for i, (a, b) in enumerate(pairs))
