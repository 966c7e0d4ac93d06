"""Context-parallel attention as Megatron-Core runs it (Transformer Engine's CP attention functions).

With context parallelism ``cp`` the sequence is cut into 2 x cp chunks and CP rank r holds chunks
r and 2cp - 1 - r, so every rank has the same share of the causal work (the early chunk sees few
keys, the late one many). Every other part of the layer works on the rank's s / cp tokens as it
would on a shorter sequence; only the attention core needs the other ranks' keys and values. Two
ways to get them (the stack's ``cp_comm``, Megatron-Core's ``--cp-comm-type``):

* ``p2p`` (ring attention; TE ``AttnFuncWithCPAndKVP2P``): the rank's K/V chunks (packed into one
  buffer) travel round the CP ring in cp - 1 steps. At step 0 the local queries attend to the local
  keys under the causal mask; at step i > 0 the traced rank 0 holds rank (0 - i)'s chunks, whose
  positions all precede its late query chunk and follow its early one, so only the late half of
  the queries attends to them, unmasked. While one step's attention runs the next step's K/V is
  already in flight (the exchange is issued before the attention and reads nothing it writes), on
  the CP stream. Each step's partial output is merged into the running one by log-sum-exp (TE's
  fused correction kernel). Backward walks the ring again: K/V travel as in forward, and the dK/dV
  of each visiting chunk is accumulated and passed on, so that after cp - 1 sends it is back with
  its owner.
* ``all_gather`` (as Llama 3 trained, Llama Team 2024 section 3.3.2; TE
  ``AttnFuncWithCPAndKVAllGather``): K/V are all-gathered over the CP group (and re-ordered into
  sequence order), each local query chunk attends to the keys up to its own position under the
  causal mask, and backward reduce-scatters dK/dV.

Rank 0 is traced; the load balancing gives every rank the same FLOPs (rank 0's steps are all of
the "late half" kind, a middle rank mixes both kinds of equal size). The loss's CP all-reduce of
token counts (a few bytes) is left out.
"""

from __future__ import annotations

import torch

from echo_plan.specs.software import CPComm
from echo_plan.trace import kernels, parallel
from echo_plan.trace.fake_pg import TPGroup


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)  # [s, b, heads, d] -> [b, heads, s, d] view


def _sbhd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(2, 0, 1, 3)  # [b, heads, s, d] -> [s, b, heads, d] view


def _kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([b, heads, s, d]) of a packed [s, b, 2, heads, d] buffer."""
    return _bhsd(kv[:, :, 0]), _bhsd(kv[:, :, 1])


def _join(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two [b, heads, s_i, ...] halves that kernels wrote into one buffer, as that buffer (no kernel)."""
    if a.dim() == 3:  # log-sum-exp [b, heads, s]
        return kernels.assemble([a.permute(2, 0, 1), b.permute(2, 0, 1)]).permute(1, 2, 0)
    return _bhsd(kernels.assemble([_sbhd(a), _sbhd(b)]))


def _saved_output(ctx, q, kv, early, late, group: TPGroup, dropout_p: float) -> torch.Tensor:
    """Join the early and late query chunks' (output, log-sum-exp), save what both CP variants' backward
    reads (q, the local packed K/V, output, log-sum-exp), and return the output as [s_local, b, heads * d]."""
    out, lse = _join(early[0], late[0]), _join(early[1], late[1])
    ctx.save_for_backward(q, kv, out, lse)
    ctx.group, ctx.p = group, dropout_p
    return _sbhd(out).reshape(q.shape[0], q.shape[1], -1)


def _saved_inputs(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What :func:`_saved_output` kept, with q and the incoming gradient as [b, heads, s, d] views."""
    q, kv, out, lse = ctx.saved_tensors
    return q, kv, out, lse, _bhsd(q), _bhsd(grad.reshape(q.shape[0], q.shape[1], q.shape[2], -1))


class _RingAttention(torch.autograd.Function):
    """Ring attention on rank 0 of the CP group: q, k, v are [s_local, b, heads, d]."""

    @staticmethod
    def forward(ctx, q, k, v, group: TPGroup, dropout_p: float):
        cp, c = group.size, q.shape[0] // 2
        qb = _bhsd(q)
        kv = torch.stack((k, v), dim=2)  # the packed send buffer (TE: torch.cat of k and v)
        cur, late, late_lse = kv, None, None
        early = early_lse = None
        for i in range(cp):
            nxt = kernels.cp_exchange(cur, group.name) if i + 1 < cp else None  # in flight during this step
            kb, vb = _kv_views(cur)
            if i == 0:
                out, lse = kernels.attention_with_lse(qb, kb, vb, True, dropout_p)
                early, late = out[:, :, :c], out[:, :, c:]
                early_lse, late_lse = lse[:, :, :c], lse[:, :, c:]
            else:  # rank 0 - i's chunks: before the late query chunk, after the early one
                part, part_lse = kernels.attention_with_lse(qb[:, :, c:], kb, vb, False, dropout_p)
                late, late_lse = kernels.attn_out_correction(late, late_lse, part, part_lse)
            cur = nxt
        return _saved_output(ctx, q, kv, (early, early_lse), (late, late_lse), group, dropout_p)

    @staticmethod
    def backward(ctx, grad):
        q, kv, out, lse, qb, gb = _saved_inputs(ctx, grad)
        group, p = ctx.group, ctx.p
        cp, s, c = group.size, q.shape[0], q.shape[0] // 2
        cur, recv, own = kv, None, None
        dq_early = dq_late = None
        for i in range(cp):
            nxt = kernels.cp_exchange(cur, group.name) if i + 1 < cp else None
            kb, vb = _kv_views(cur)
            if i == 0:
                dq, dk, dv = kernels.attention_backward(gb, qb, kb, vb, out, lse, True, p)
                dq_early, dq_late = dq[:, :, :c], dq[:, :, c:]
                own = kernels.assemble([_sbhd(dk), _sbhd(dv)])  # dK, dV written into one [2s, b, hkv, d] buffer
            else:
                dqi, dki, dvi = kernels.attention_backward(gb[:, :, c:], qb[:, :, c:], kb, vb, out[:, :, c:],
                                                           lse[:, :, c:], False, p)
                dq_late = dq_late + dqi
                part = kernels.assemble([_sbhd(dki), _sbhd(dvi)])
                acc = part if recv is None else recv + part  # the visiting chunk's dK/dV so far
                recv = kernels.cp_exchange(acc, group.name)  # passed on; after cp - 1 sends it is home
            cur = nxt
        dkv = own if recv is None else own + recv
        dq = _sbhd(_join(dq_early, dq_late))
        return dq, dkv[:s], dkv[s:], None, None


def _sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """All-gathered [cp x s_local, ...] K/V (rank r's chunks r and 2cp-1-r) in sequence order: one copy."""
    c = gathered.shape[0] // (2 * cp)
    chunks = gathered.split(c, dim=0)
    order = [chunks[2 * j] for j in range(cp)] + [chunks[2 * (cp - 1 - j) + 1] for j in range(cp)]
    return torch.cat(order, dim=0)


def _rank_order(ordered: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of :func:`_sequence_order` (one copy), before the reduce-scatter."""
    c = ordered.shape[0] // (2 * cp)
    chunks = ordered.split(c, dim=0)
    return torch.cat([t for r in range(cp) for t in (chunks[r], chunks[2 * cp - 1 - r])], dim=0)


class _AllGatherAttention(torch.autograd.Function):
    """All-gather context parallelism on rank 0 (chunks 0 and 2cp - 1): q, k, v are [s_local, b, heads, d]."""

    @staticmethod
    def forward(ctx, q, k, v, group: TPGroup, dropout_p: float):
        cp, c = group.size, q.shape[0] // 2
        kv = torch.stack((k, v), dim=2)
        full = _sequence_order(parallel.all_gather(kv, group), cp)
        kb, vb = _kv_views(full)
        qb = _bhsd(q)
        early, early_lse = kernels.attention_with_lse(qb[:, :, :c], kb[:, :, :c], vb[:, :, :c], True, dropout_p)
        late, late_lse = kernels.attention_with_lse(qb[:, :, c:], kb, vb, True, dropout_p)  # all 2cp chunks
        # TE keeps the local K/V and gathers again in backward
        return _saved_output(ctx, q, kv, (early, early_lse), (late, late_lse), group, dropout_p)

    @staticmethod
    def backward(ctx, grad):
        q, kv, out, lse, qb, gb = _saved_inputs(ctx, grad)
        group, p = ctx.group, ctx.p
        cp, c = group.size, q.shape[0] // 2
        full = _sequence_order(parallel.all_gather(kv, group), cp)
        kb, vb = _kv_views(full)
        dq_e, dk_e, dv_e = kernels.attention_backward(gb[:, :, :c], qb[:, :, :c], kb[:, :, :c], vb[:, :, :c],
                                                      out[:, :, :c], lse[:, :, :c], True, p)
        dq_l, dk, dv = kernels.attention_backward(gb[:, :, c:], qb[:, :, c:], kb, vb, out[:, :, c:], lse[:, :, c:],
                                                  True, p)
        dk[:, :, :c].add_(dk_e)
        dv[:, :, :c].add_(dv_e)
        dkv = _rank_order(torch.stack((_sbhd(dk), _sbhd(dv)), dim=2), cp)
        mine = parallel.reduce_scatter(dkv, group)  # [s, b, 2, hkv, d]: this rank's chunks, summed over ranks
        dq = _sbhd(_join(dq_e, dq_l))
        return dq, mine[:, :, 0], mine[:, :, 1], None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: TPGroup,
                               comm: CPComm, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over the whole sequence from this CP rank's two chunks ([s_local, b, heads, d]
    each); returns [s_local, b, heads * d]."""
    fn = _RingAttention if comm is CPComm.P2P else _AllGatherAttention
    return fn.apply(q, k, v, group, float(dropout_p))
