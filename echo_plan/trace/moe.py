"""The MoE layer of one expert-parallel rank, as Megatron-Core's MoELayer runs it.

Router (a replicated linear to one logit per expert, softmax or sigmoid scores, top-k), token
permutation (``index_select`` of each token once per chosen expert, sorted by expert), dispatch,
the rank's local experts, combine and un-permutation (weighted by the router probabilities,
``index_add``; with the stack's ``moe_probs_in_activation``, Megatron-Core >= 0.12.1, the probabilities
travel with the copies and weight the experts' activation instead, and un-permutation is a sum),
plus the shared experts as a tensor-parallel MLP beside them. Written after
megatron/core/transformer/moe/ (router.py, token_dispatcher.py, moe_utils.py, experts.py); the
code is ours.

Dispatchers (the stack's ``moe_dispatcher``):
* ``alltoall``: each rank sends its tokens' copies to the ranks holding their experts through an
  all-to-all over the expert-parallel group; with expert tensor parallelism the received tokens
  are all-gathered over the expert-TP group; the received tokens are re-sorted by local expert
  when the rank holds several; combine is the reverse.
* ``allgather``: every rank all-gathers all tokens of the expert-parallel group, keeps those routed
  to its experts, and the outputs are reduce-scattered back.

Token counts (this rank is the busiest when ``imbalance`` > 1): each rank routes T tokens x top-k
copies; a balanced router sends as many to every rank, so a rank receives T x k copies spread
evenly over its L local experts. With imbalance F its hottest expert receives F x the mean (the
other local experts the mean), so it receives T x k x (F + L - 1) / L. With a capacity factor C
every expert processes exactly C x the mean (dropped or padded). The local experts run as one
grouped GEMM over [experts, tokens, hidden] (``bmm``; the hot expert as a GEMM of its own), or as
one GEMM per expert when the stack has no grouped GEMM.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from echo_plan.specs import Activation, ModelSpec, SoftwareSpec
from echo_plan.specs.moe import ExpertLayout, RouterKind
from echo_plan.specs.software import MoEDispatcher
from echo_plan.trace import kernels, moe_kernels, parallel
from echo_plan.trace.fake_pg import TPGroup
from echo_plan.trace.layers import clamped_swiglu
from echo_plan.trace.fp8 import fp8_grouped_linear


def routed_token_counts(tokens: int, model: ModelSpec, layout: ExpertLayout) -> tuple[int, int, int]:
    """(copies sent, copies of the hottest local expert, copies of each other local expert) of one rank."""
    moe = model.moe
    assert moe is not None
    local = moe.num_experts // layout.ep
    sent = tokens * moe.top_k
    mean = sent * layout.ep / moe.num_experts  # balanced copies per expert (every rank routes as many)
    if moe.capacity_factor is not None:
        cap = max(1, math.ceil(moe.capacity_factor * mean))
        return local * cap, cap, cap
    hot = max(1, math.ceil(mean * layout.imbalance))
    if layout.ep == 1 and local > 1:  # all experts here: the hot one's extra tokens come from the others
        return sent, hot, max(1, (sent - hot) // (local - 1))
    return sent, hot, max(1, round(mean))


WEIGHTED_KINDS = {Activation.SWIGLU: "swiglu", Activation.SWIGLU_CLAMPED: "clamped_geglu"}  # moe_kernels.weighted_act


class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group``: forward sends ``send`` rows and receives ``recv``; backward reverses."""

    @staticmethod
    def forward(ctx, x, group: TPGroup, send: int, recv: int):
        ctx.group, ctx.send, ctx.recv = group, send, recv
        return all_to_all(x, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def all_to_all(x: torch.Tensor, group: TPGroup, send: int, recv: int) -> torch.Tensor:
    """Rows split evenly over the group's ranks both ways (the fake group moves no data)."""
    n = group.size
    out_splits = [recv // n + (1 if i < recv % n else 0) for i in range(n)]
    in_splits = [send // n + (1 if i < send % n else 0) for i in range(n)]
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_to_all_single(x.contiguous(), out_splits, in_splits, group.name))


class _Riding(torch.autograd.Function):
    """Per-row values that travel inside another exchange (DeepEP's dispatch carries each copy's gate weight
    with its token): ``send`` rows in, ``recv`` out, no collective of their own either way; ``carrier`` (the
    exchanged rows) orders them after that exchange."""

    @staticmethod
    def forward(ctx, w, carrier, recv: int):
        ctx.send = w.shape[0]
        return w.new_empty((recv, *w.shape[1:]))

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty((ctx.send, *grad.shape[1:])), None, None


class _Fp8Dispatch(torch.autograd.Function):
    """An exchange that moves FP8 rows with their scales where the bf16 one moves bf16 rows (DeepEP's FP8
    dispatch, and its gradient dispatch before the experts' FC2); ``order``: the arrived rows sorted by local
    expert, still in FP8. Its other direction stays bf16, as DeepSeek-V3 keeps the combines."""

    @staticmethod
    def forward(ctx, x, group: TPGroup, send: int, recv: int, order):
        ctx.group, ctx.send, ctx.recv, ctx.order = group, send, recv, order
        got = all_to_all(moe_kernels.fp8_payload(x), group, send, recv)
        if order is not None:
            got = moe_kernels.moe_permute(got, order)
        return moe_kernels.fp8_arrived(got, x.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        if ctx.order is not None:
            grad = moe_kernels.moe_permute(grad, ctx.order)
        return all_to_all(grad, ctx.group, ctx.recv, ctx.send), None, None, None, None


class _CombineFp8Grad(torch.autograd.Function):
    """A bf16 combine whose backward dispatches the gradients in FP8 (cast, then FP8 rows with scales)."""

    @staticmethod
    def forward(ctx, y, group: TPGroup, send: int, recv: int, fp8):
        ctx.group, ctx.send, ctx.recv, ctx.fp8 = group, send, recv, fp8
        return all_to_all(y, group, send, recv)

    @staticmethod
    def backward(ctx, grad):
        ctx.fp8.cast(grad.contiguous(), True)  # the gradients before the experts' FC2, cast once
        got = all_to_all(moe_kernels.fp8_payload(grad), ctx.group, ctx.recv, ctx.send)
        return moe_kernels.fp8_arrived(got, grad.shape[-1]), None, None, None, None


def dispatch(x: torch.Tensor, group: TPGroup | None, send: int, recv: int) -> torch.Tensor:
    """Send ``send`` rows, receive ``recv``. Without expert parallelism the rows stay here (a
    permutation copy when the per-expert counts do not add up to the rows exactly)."""
    if group is None:
        return x if send == recv else x.index_select(0, x.new_empty(recv, dtype=torch.long))
    return _AllToAll.apply(x, group, send, recv)


class Experts(nn.Module):
    """This rank's local experts (their FFN split by expert TP), as a grouped GEMM or one GEMM each."""

    def __init__(self, model: ModelSpec, local: int, etp: int, dtype: torch.dtype, grouped: bool,
                 recompute_act=None, discard=None, fused_act: bool = True, act_input_fp8: bool = False,
                 fp32_probs: bool = False) -> None:
        super().__init__()
        self.fp32_probs = fp32_probs  # the dispatcher hands the experts fp32 probabilities (DeepEP), else bf16
        self.act_input_fp8 = act_input_fp8  # the stack's moe_act_input_fp8 (with the moe_act recompute)
        self.fused_act = fused_act  # Megatron-Core's bias_activation_fusion (the stack's fused elementwise ops)
        self.recompute_act = recompute_act if discard is not None else None  # checkpoints a callable
        self.discard = discard
        assert model.moe is not None
        ffn = model.moe.expert_ffn_hidden_size // etp
        self.gated, self.grouped, self.local = model.activation.gated, grouped, local
        self.activation = model.activation
        fc1_out = 2 * ffn if self.gated else ffn
        self.fc1 = nn.Parameter(torch.empty(local, model.hidden_size, fc1_out, dtype=dtype))
        self.fc2 = nn.Parameter(torch.empty(local, ffn, model.hidden_size, dtype=dtype))
        # FC1's bias is added by the grouped GEMM itself (skip_bias_add=False: cuBLAS's epilogue, no kernel of its
        # own); FC2's is returned to Megatron-Core, which adds it per expert (_apply_bias below)
        self.fc2_bias = nn.Parameter(torch.empty(local, model.hidden_size, dtype=dtype)) if model.has_bias else None
        self.fp8 = None  # an fp8.Fp8State when the expert GEMMs run in FP8 (set by the block)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation is Activation.SWIGLU_CLAMPED:  # experts.py: weighted_bias_quick_geglu_impl
            return kernels.clamped_geglu(h) if self.fused_act else clamped_swiglu(h)
        if self.activation is Activation.SWIGLU:
            return kernels.swiglu(h)
        if self.activation is Activation.GELU:
            return F.gelu(h, approximate="tanh")
        return torch.pow(F.relu(h), 2)

    def _bmm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [E, rows, K] @ w [E, K, N]: bf16, or FP8 when the plan trains in fp8 (trace/fp8.py)."""
        if self.fp8 is None:
            return torch.bmm(x, w)

        return fp8_grouped_linear(x, w, self.fp8)

    def weighted(self, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The activation weighted by each copy's router probability (Megatron-Core >= 0.12.1): one fused
        kernel keeping its input and the probabilities, or, unfused, the activation then a multiply."""
        kind = WEIGHTED_KINDS.get(self.activation)
        if self.fused_act and kind is not None:
            return moe_kernels.weighted_act(h, p, kind)
        return (self.act(h).float() * p).to(h.dtype)

    def _fc2_keeps_original(self, a: torch.Tensor) -> None:
        """moe_act recompute in FP8: FC2 saves the activation's output itself (freed and recomputed), not an
        FP8 copy of it (Megatron-Core experts.py: set_save_original_input(linear_fc2))."""
        if self.fp8 is not None:
            self.fp8.keep_original(a)

    def _mlp(self, x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
        kind = WEIGHTED_KINDS.get(self.activation)
        if self.act_input_fp8 and self.recompute_act is not None and p is not None and kind and self.fused_act:
            a = moe_kernels.CachedWeightedAct.apply(self._bmm(x, fc1), p, kind)  # keeps its input in FP8
            self._fc2_keeps_original(a)
            out = self._bmm(a, fc2)
            self.discard(a)  # the activation's output is freed after FC2 and recomputed in backward
            return out
        fn, args = (self.act, ()) if p is None else (self.weighted, (p,))
        if self.recompute_act is None:
            return self._bmm(fn(self._bmm(x, fc1), *args), fc2)
        a = self.recompute_act(fn, self._bmm(x, fc1), *args)  # moe_act recompute: FC1's output is kept,
        self._fc2_keeps_original(a)
        out = self._bmm(a, fc2)
        self.discard(a)  # the activation's output is freed after FC2 and recomputed in backward
        return out

    def _apply_bias(self, out: torch.Tensor, probs: torch.Tensor | None, sizes: list[int]) -> torch.Tensor:
        """FC2's bias as Megatron-Core adds it (TEGroupedMLP._apply_bias, Megatron-Core 2025-09 onwards): for each
        local expert its rows plus the bias times each row's probability, then the experts' rows concatenated
        and cast back (a plain PyTorch product and sum per expert). The probabilities are in the dispatcher's
        dtype: the router's (bf16) for Megatron-Core's all-to-all, fp32 for DeepEP; this trace carries them as
        fp32, so the bf16 case casts them once (one value per copy)."""
        rows = torch.split(out, sizes)
        if probs is None:
            return torch.cat([t + self.fc2_bias[e] for e, t in enumerate(rows)])
        p = probs if self.fp32_probs else probs.to(out.dtype)
        weighted = [t + self.fc2_bias[e] * q for e, (t, q) in enumerate(zip(rows, torch.split(p, sizes)))]
        return torch.cat(weighted).to(out.dtype)

    def forward(self, x: torch.Tensor, hot: int, each: int, probs: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: [hot + (local - 1) x each, hidden] rows sorted by expert; the first expert is the hot one.
        ``probs``: each row's router probability [rows, 1] when it weights the activation."""
        out = self._experts(x, hot, each, probs)
        if self.fc2_bias is None:
            return out
        return self._apply_bias(out, probs, [hot] + [each] * (self.local - 1))

    def _experts(self, x: torch.Tensor, hot: int, each: int, probs: torch.Tensor | None) -> torch.Tensor:
        h = x.shape[-1]

        def part(t: torch.Tensor | None, start: int, stop: int, shape: tuple) -> torch.Tensor | None:
            return None if t is None else t[start:stop].reshape(*shape, t.shape[-1])

        if not self.grouped:
            parts, start = [], 0
            for e in range(self.local):
                n = hot if e == 0 else each
                parts.append(self._mlp(x[start:start + n].unsqueeze(0), self.fc1[e:e + 1], self.fc2[e:e + 1],
                                       part(probs, start, start + n, (1, n))))
                start += n
            return torch.cat([p.squeeze(0) for p in parts])
        rows = x.shape[0]
        if hot == each or self.local == 1:
            return self._mlp(x.view(self.local, -1, h), self.fc1, self.fc2,
                             part(probs, 0, rows, (self.local, rows // self.local))).reshape(-1, h)
        first = self._mlp(x[:hot].unsqueeze(0), self.fc1[:1], self.fc2[:1], part(probs, 0, hot, (1, hot))).squeeze(0)
        rest = self._mlp(x[hot:].view(self.local - 1, each, h), self.fc1[1:], self.fc2[1:],
                         part(probs, hot, rows, (self.local - 1, each))).reshape(-1, h)
        return torch.cat([first, rest])


class MoELayer(nn.Module):
    """Router, dispatch, local experts, combine, shared experts. Input/output [s(/tp), b, h]."""

    def __init__(self, model: ModelSpec, groups, sequence_parallel: bool, dtype: torch.dtype,
                 stack: SoftwareSpec, layout: ExpertLayout, shared_mlp: nn.Module | None,
                 recompute_act=None, discard=None) -> None:
        super().__init__()
        moe = model.moe
        assert moe is not None
        self.model, self.layout, self.groups = model, layout, groups
        self.router_weight = nn.Parameter(torch.empty(moe.num_experts, model.hidden_size, dtype=dtype))
        self.experts = Experts(model, moe.num_experts // layout.ep, layout.etp, dtype, stack.moe_grouped_gemm,
                               recompute_act, discard, fused_act=stack.fused_elementwise,
                               act_input_fp8=stack.moe_act_input_fp8,
                               fp32_probs=stack.moe_dispatcher is MoEDispatcher.DEEPEP)
        self.shared = shared_mlp
        self.allgather = stack.moe_dispatcher is MoEDispatcher.ALLGATHER
        self.fused = stack.moe_permute_fusion
        self.probs_in_act = stack.moe_probs_in_activation
        self.deepep = stack.moe_dispatcher is MoEDispatcher.DEEPEP
        self.dispatch_fp8 = stack.moe_dispatch_fp8
        self.fp8 = None  # an fp8.Fp8State when the linears run FP8 GEMMs (set by the block)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k probabilities and expert indices of each token ([T, k] each)."""
        moe = self.model.moe
        logits = parallel.linear(tokens, self.router_weight, None).float()
        if moe.router is RouterKind.SIGMOID:
            scores = torch.sigmoid(logits)
            probs, idx = torch.topk(scores, moe.top_k, dim=-1)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        else:
            probs, idx = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
        return probs.to(tokens.dtype), idx

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        probs, idx = self.route(tokens)
        combine = self._allgather if self.allgather else self._alltoall
        out = combine(tokens, probs, idx).view(s, b, h)
        if self.shared is not None:
            if self.fp8 is not None and not self.fp8.delayed:  # the router saved this input already
                self.fp8.keep_original(x)  # (Megatron-Core shared_experts.py: set_save_original_input(linear_fc1))
            shared, bias = self.shared(x)
            out = out + shared if bias is None else out + shared + bias
        return out, None

    def _copies(self, like: torch.Tensor, n: int) -> torch.Tensor:
        """Indices of ``n`` token copies (what the routing map selects; values do not matter here)."""
        return like.new_empty(n, dtype=torch.long)

    def _experts_over_etp(self, got, hot, each, probs=None):
        etp = self.groups.etp.size if self.groups.etp is not None else 1
        return self.experts(got, hot * etp, each * etp, probs)

    def _alltoall(self, tokens, probs, idx):
        g, n_tok = self.groups, tokens.shape[0]
        sent, hot, each = routed_token_counts(n_tok, self.model, self.layout)
        recv = hot + (self.experts.local - 1) * each
        order = self._copies(idx, sent)
        fp8_exchange = self.dispatch_fp8 and self.fp8 is not None and g.ep is not None and g.etp is None
        if fp8_exchange:  # the tokens cast to FP8 once, then their copies sent as FP8 rows with scales
            self.fp8.cast(tokens.detach(), False)
        deepep = self.deepep and g.ep is not None and self.probs_in_act  # permutation inside DeepEP's kernels
        k = self.model.moe.top_k
        if deepep and sent == n_tok * k:
            permuted = moe_kernels.deepep_token_rows(tokens, k)  # read in place by the dispatch
        else:
            deepep = False
            permuted = self._permute(tokens, order)  # one row per (token, expert) copy, sorted by expert
        sort = g.ep is not None and self.experts.local > 1  # the received chunks re-sorted by local expert
        if fp8_exchange:
            got = _Fp8Dispatch.apply(permuted, g.ep, sent, recv, self._copies(idx, recv) if sort else None)
            self.fp8.arrived_quantized(got)
        else:
            got = dispatch(permuted, g.ep, sent, recv)
        got = parallel.gather_from_sp(got, g.etp)  # expert TP: every expert-TP rank sees the tokens
        weights = None
        if self.probs_in_act:  # each copy's probability travels with it (fp32, one value per copy)
            weights = (probs.float().reshape(-1, 1) if deepep  # DeepEP takes the [tokens, k] weights as they are
                       else self._permute(probs.float().reshape(-1, 1), order))
            if self.deepep and g.ep is not None:  # inside the token exchange (recv_topk_weights)
                weights = parallel.gather_from_sp(_Riding.apply(weights, got, recv), g.etp)
            else:  # Megatron-Core: an all-to-all of their own
                weights = parallel.gather_from_sp(dispatch(weights, g.ep, sent, recv), g.etp)
        if sort:
            if not fp8_exchange:
                got = self._permute(got, self._copies(got, got.shape[0]))  # sort the received chunks by expert
            if weights is not None:
                weights = self._permute(weights, self._copies(weights, weights.shape[0]))
        y = self._experts_over_etp(got, hot, each, weights)
        if g.ep is not None and self.experts.local > 1:
            y = self._permute(y, self._copies(y, y.shape[0]))  # back to source-rank order
        y = parallel.reduce_scatter_to_sp(y, g.etp)
        back = _CombineFp8Grad.apply(y, g.ep, recv, sent, self.fp8) if fp8_exchange else dispatch(y, g.ep, recv, sent)
        if deepep:
            return moe_kernels.deepep_combined(back, k)  # summed into the tokens by the combine kernel
        if self.probs_in_act:
            return self._sum_copies(back, order, tokens.shape[0])
        return self._unpermute(back, probs, order, tokens.shape[0])

    def _sum_copies(self, rows: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
        """Each token's copies summed (already weighted by their probabilities in the experts)."""
        if self.fused:
            return moe_kernels.moe_unpermute_sum(rows, index, n)
        return rows.new_zeros((n, rows.shape[1])).index_add(0, index, rows)

    def _permute(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return moe_kernels.moe_permute(rows, index) if self.fused else rows.index_select(0, index)

    def _unpermute(self, rows: torch.Tensor, probs: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
        """Weighted sum of each token's copies (the router probabilities of its experts)."""
        weights = probs.reshape(-1).index_select(0, self._copies(probs, rows.shape[0]))
        if self.fused:
            return moe_kernels.moe_unpermute(rows, weights, index, n)
        return rows.new_zeros((n, rows.shape[1])).index_add(0, index, rows * weights.unsqueeze(1))

    def _allgather(self, tokens, probs, idx):
        g, n_tok = self.groups, tokens.shape[0]
        _, hot, each = routed_token_counts(n_tok, self.model, self.layout)
        recv = hot + (self.experts.local - 1) * each
        everyone = parallel.gather_from_sp(tokens, g.ep)  # [T x ep, h]
        all_probs = parallel.gather_from_sp(probs, g.ep)
        mine = self._copies(everyone, recv)  # the copies routed to this rank's experts, by expert
        weights = None
        if self.probs_in_act:
            weights = parallel.gather_from_sp(all_probs.float().reshape(-1, 1).index_select(0, mine), g.etp)
        y = self._experts_over_etp(parallel.gather_from_sp(everyone.index_select(0, mine), g.etp), hot, each,
                                   weights)
        y = parallel.reduce_scatter_to_sp(y, g.etp)
        if not self.probs_in_act:
            y = y * all_probs.reshape(-1, 1).index_select(0, mine)
        full = everyone.new_zeros(everyone.shape).index_add(0, mine, y)
        return parallel.reduce_scatter_to_sp(full, g.ep)  # this rank's tokens, summed over all experts
