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

A third way is PyTorch's own ring attention (stack ``cp_runtime: torch``, torchtitan's
``context_parallel``; ``torch/distributed/tensor/experimental/_attention.py`` ``_templated_ring_attention``
and its backward, as torch 2.5-2.8 run it with load balancing and ``convert_to_f32``): the model repeats the
K/V heads to the query heads before SDPA (torchtitan's ``repeat_kv``), so the ring moves the repeated heads;
every step is an SDPA call, at step 0 the local queries against the local keys under the causal mask and, on
rank 0, the late query chunk against each visiting rank's keys unmasked; the partial outputs are merged by eager
fp32 ops (a sigmoid of the log-sum-exp difference, the output's and log-sum-exp's updates, the merged half
written back into a new buffer); K/V are packed into one buffer by a cat at each step (``cp_comm`` all_gather,
the rotate method allgather: gathered once, the cat made and unused; p2p, its alltoall: each cat sent on). Its
backward gathers K/V again, runs an SDPA backward per step, accumulates dQ, dK and dV in fp32 (zeroed buffers,
the half of dQ added through a new buffer), packs dK/dV by a cat after every step and sends them on (cp sends:
the last brings each rank its own), and casts the three back.

Rank 0 is traced; the load balancing gives every rank the same FLOPs (rank 0's steps are all of
the "late half" kind, a middle rank mixes both kinds of equal size). The loss's CP all-reduce of
token counts (a few bytes) is left out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from echo_plan.specs.software import CPComm, CPRuntime
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


def _flat_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch's ring attention packs K and V into one flat buffer (``torch.cat([key.flatten(), value.flatten()])``)."""
    return torch.cat((k.reshape(-1), v.reshape(-1)))


def _unflat(buf: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two tensors shaped as ``like`` ([b, heads, s, d]) that :func:`_flat_kv` packed: views."""
    n = like.numel()
    return buf[:n].view(like.shape), buf[n:].view(like.shape)


class _TorchKV:
    """The K/V a rank sees at each ring step of torch's ring attention: its own at step 0, then step i's rank's,
    from one all-gather (rotate method allgather) or one exchange per step (alltoall); a packing cat at every step
    but the last, as torch makes it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, group: TPGroup, comm: CPComm) -> None:
        self.k, self.v, self.group = k, v, group
        buf = _flat_kv(k, v)
        self.n = buf.numel()
        self.gathered = parallel.all_gather(buf, group) if comm is CPComm.ALL_GATHER else None
        self.recv = kernels.cp_exchange(buf, group.name) if comm is not CPComm.ALL_GATHER and group.size > 1 else None

    def step(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 0:
            return self.k, self.v
        cur = self.gathered[i * self.n:(i + 1) * self.n] if self.gathered is not None else self.recv
        k, v = _unflat(cur, self.k)
        if i + 1 < self.group.size:
            nxt = _flat_kv(k, v)
            if self.gathered is None:
                self.recv = kernels.cp_exchange(nxt, self.group.name)
        return k, v


class _TorchRingAttention(torch.autograd.Function):
    """torch's ring attention on rank 0 of the CP group (module docstring): q, k, v are [s_local, b, heads, d] with
    the K/V heads already repeated to the query heads."""

    @staticmethod
    def forward(ctx, q, k, v, group: TPGroup, comm: CPComm, dropout_p: float):
        s, b, c = q.shape[0], q.shape[1], q.shape[0] // 2
        qb, kb, vb = _bhsd(q), _bhsd(k), _bhsd(v)
        ring = _TorchKV(kb, vb, group, comm)
        out32 = lse32 = None
        for i in range(group.size):
            ki, vi = ring.step(i)
            if i == 0:
                o, lse = kernels.attention_with_lse(qb, ki, vi, True, dropout_p)
                out32, lse32 = o.float(), lse.float()
                continue
            o, lse = kernels.attention_with_lse(qb[:, :, c:], ki, vi, False, dropout_p)
            h_out, h_lse = out32[:, :, c:], lse32[:, :, c:]
            merged = h_out - torch.sigmoid((lse - h_lse).unsqueeze(-1)) * (h_out - o)
            merged_lse = h_lse - F.logsigmoid(h_lse - lse)
            out32 = torch.cat((out32[:, :, :c], merged), dim=2)  # _partial_update: the late half into a new buffer
            lse32 = torch.cat((lse32[:, :, :c], merged_lse), dim=2)
        out = out32.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse32)
        ctx.group, ctx.comm, ctx.p = group, comm, dropout_p
        return _sbhd(out).reshape(s, b, -1)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, c = ctx.group, q.shape[0] // 2
        qb, kb, vb = _bhsd(q), _bhsd(k), _bhsd(v)
        gb = _bhsd(grad.reshape(q.shape))
        ring = _TorchKV(kb, vb, group, ctx.comm)
        dq = torch.zeros_like(qb, dtype=torch.float32)
        dk = torch.zeros_like(kb, dtype=torch.float32)
        dv = torch.zeros_like(vb, dtype=torch.float32)
        sent = None
        for i in range(group.size):
            ki, vi = ring.step(i)
            if i == 0:
                dq_i, dk_i, dv_i = kernels.attention_backward(gb, qb, ki, vi, out, lse, True, ctx.p)
                dq = dq + dq_i
            else:
                dq_i, dk_i, dv_i = kernels.attention_backward(gb[:, :, c:], qb[:, :, c:], ki, vi, out[:, :, c:],
                                                              lse[:, :, c:].contiguous(), False, ctx.p)
                dk, dv = _unflat(sent, dk)  # the visiting chunk's dK/dV so far, from the previous rank
                dq = torch.cat((dq[:, :, :c], dq[:, :, c:] + dq_i), dim=2)  # _partial_update with add
            dk, dv = dk + dk_i, dv + dv_i
            sent = kernels.cp_exchange(_flat_kv(dk, dv), group.name)
        dk, dv = _unflat(sent, dk)  # after cp sends each rank holds its own chunk's sums
        return (_sbhd(dq.to(q.dtype)), _sbhd(dk.to(k.dtype)), _sbhd(dv.to(v.dtype)), None, None, None)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: TPGroup,
                               comm: CPComm, dropout_p: float = 0.0,
                               runtime: CPRuntime = CPRuntime.TRANSFORMER_ENGINE) -> torch.Tensor:
    """Causal attention over the whole sequence from this CP rank's two chunks ([s_local, b, heads, d]
    each); returns [s_local, b, heads * d]."""
    if runtime is CPRuntime.TORCH:
        rep = q.shape[2] // k.shape[2]  # torchtitan's repeat_kv: the K/V heads repeated before SDPA (a copy each)
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return _TorchRingAttention.apply(q, k, v, group, comm, float(dropout_p))
    fn = _RingAttention if comm is CPComm.P2P else _AllGatherAttention
    return fn.apply(q, k, v, group, float(dropout_p))
