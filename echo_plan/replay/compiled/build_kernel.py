"""The level-2 task builder of :func:`echo_plan.replay.pipeline.build_tasks`, compiled with Numba.

Same tasks, in the same order, with the same work (the same floating-point expressions) and the
same dependencies as the Python builder, written straight into the arrays the compiled event loop
reads (``rates_kernel``) instead of Python lists; ``level2.py`` prepares the inputs and holds
the rules for when it is used. Importing this module imports Numba (``cache=True``: compiled once
per machine, loaded from Numba's on-disk cache afterwards).

Codes: pass kinds 0 F, 1 B, 2 Bi, 3 W; streams 0 compute, 1 pp_fwd, 2 pp_bwd, 3 dp_comm, 4
pp_gather; categories 0-3 the pass kinds, 4 p2p, 5 dp, 6 optimizer. A task's profile code is its
compute slot ``(rank * 4 + pass) * v + chunk`` for compute, else ``kbase`` + the code the caller
gives its TaskKind.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from echo_plan.replay.compiled.step_kernel import breakdown, graph, zb_v

__all__ = ["build", "graph", "breakdown", "zb_v"]  # what level2.py calls

S_COMPUTE, S_FWD, S_BWD, S_DP, S_GATHER = 0, 1, 2, 3, 4
C_P2P, C_DP, C_OPT = 4, 5, 6


@njit(cache=True, nogil=True)
def build(pp, v, m, act_ptr, act_kind, act_chunk, act_mb, act_over, act_pair, prev_r, prev_c, next_r, next_c, work_pc,
          b_ptr, b_params,
          b_reduce_s, b_reduce_code, b_gather_s, p2p_s, recv_s, tied_s, opt_s, scale, overlap_grad, overlap_gather,
          sync, k_p2p, k_gather, k_memory, k_allreduce, kbase):
    # -- first pass: positions of sends, DP row counts (as build_tasks) --------------------------------
    first_f = np.full((pp, v), -1, dtype=np.int64)
    last_b = np.full((pp, v), -1, dtype=np.int64)
    go = np.zeros(pp, dtype=np.bool_)
    send_at = np.zeros(pp * v * 2 * m, dtype=np.int64)
    ndp = np.zeros(pp, dtype=np.int64)
    nred = np.zeros(pp, dtype=np.int64)
    tied_on = tied_s > 0 and pp > 1
    pos = 0
    for r in range(pp):
        for k in range(act_ptr[r], act_ptr[r + 1]):
            c = act_chunk[k]
            kd = act_kind[k]
            if kd == 0:
                if first_f[r, c] < 0:
                    first_f[r, c] = k - act_ptr[r]
            elif kd == 1 or kd == 3:
                last_b[r, c] = k - act_ptr[r]
        if overlap_gather:
            for c in range(v):
                for b in range(b_ptr[r * v + c], b_ptr[r * v + c + 1]):
                    if b_gather_s[b] > 0:
                        go[r] = True
        for k in range(act_ptr[r], act_ptr[r + 1]):
            kd = act_kind[k]
            fwd = kd == 0
            c = act_chunk[k]
            mb = act_mb[k]
            nb = b_ptr[r * v + c + 1] - b_ptr[r * v + c]
            has_src = (prev_r[r, c] if fwd else next_r[r, c]) >= 0
            has_dst = (next_r[r, c] if fwd else prev_r[r, c]) >= 0
            if kd != 3 and recv_s > 0 and has_src:
                pos += 1
            if fwd:
                pos += nb if go[r] and first_f[r, c] == k - act_ptr[r] else 1
            else:
                pos += nb if overlap_grad and nb > 0 and last_b[r, c] == k - act_ptr[r] else 1
            if kd != 3 and has_dst:
                send_at[((r * v + c) * 2 + (1 if fwd else 0)) * m + mb] = pos
                pos += 1
        cnt = 0
        for c in range(v):
            nb = b_ptr[r * v + c + 1] - b_ptr[r * v + c]
            if go[r] and first_f[r, c] >= 0:
                cnt += nb
            if last_b[r, c] >= 0:
                cnt += nb
                nred[r] += nb
            if not overlap_gather:
                for b in range(b_ptr[r * v + c], b_ptr[r * v + c + 1]):
                    if b_gather_s[b] > 0:
                        cnt += 1
        if tied_on and r == pp - 1:
            cnt += 1
        ndp[r] = cnt
    dp_base = np.zeros(pp, dtype=np.int64)
    for r in range(pp):
        dp_base[r] = pos
        pos += 1 + ndp[r]
    n = pos

    work = np.zeros(n, dtype=np.float64)
    dev = np.zeros(n, dtype=np.int64)
    skind = np.zeros(n, dtype=np.int64)
    code = np.zeros(n, dtype=np.int64)
    cat = np.zeros(n, dtype=np.int64)
    islot = np.full(n, -1, dtype=np.int64)
    ishare = np.ones(n, dtype=np.float64)
    maxred = 1
    for r in range(pp):
        if nred[r] > maxred:
            maxred = nred[r]
    cap = 4 * n + 2 * (maxred + 2) * pp + 16
    d_own = np.zeros(cap, dtype=np.int64)
    d_dep = np.zeros(cap, dtype=np.int64)
    nd = 0
    dp_cnt = np.zeros(pp, dtype=np.int64)
    reduce_ids = np.zeros((pp, maxred), dtype=np.int64)
    nreduce = np.zeros(pp, dtype=np.int64)
    last_compute = np.zeros(pp, dtype=np.int64)
    gather_at = np.zeros(len(b_params) + 1, dtype=np.int64)  # bucket index -> its all-gather task
    at = 0  # next position of a compute-side task
    order_c = np.zeros(v, dtype=np.int64)

    for r in range(pp):
        p2p = p2p_s[r]
        sc = scale[r]
        base_r = act_ptr[r]
        if go[r]:  # chunks in order of first forward, each bucket from the last
            nc = _chunks_in_order(order_c, first_f[r], v)  # by first forward
            for a in range(nc):
                c = order_c[a]
                for b in range(b_ptr[r * v + c + 1] - 1, b_ptr[r * v + c] - 1, -1):
                    i = _dp_task(work, dev, skind, code, cat, dp_base, dp_cnt, r, b_gather_s[b], kbase + k_gather)
                    gather_at[b] = i
        prev_send = -1
        last = 0
        for k in range(act_ptr[r], act_ptr[r + 1]):
            kd = act_kind[k]
            fwd = kd == 0
            c = act_chunk[k]
            mb = act_mb[k]
            slot = (r * 4 + kd) * v + c
            wslot = slot if act_over[k] < 0 else act_over[k]  # DualPipe's pairs: the overlapped cost
            w = work_pc[wslot] * sc
            src = -1
            dst = -1
            if kd != 3:
                if fwd:
                    if prev_r[r, c] >= 0:
                        src = (prev_r[r, c] * v + prev_c[r, c]) * 2 + 1
                    dst = next_r[r, c]
                else:
                    if next_r[r, c] >= 0:
                        src = (next_r[r, c] * v + next_c[r, c]) * 2
                    dst = prev_r[r, c]
            dep0 = -1  # the base deps: the previous send (sync) and what arrived
            dep1 = -1
            dep2 = -1  # a pair starts when the paired backward's input is in as well
            if sync and prev_send >= 0:
                dep0 = prev_send
            if act_pair[k] and k + 1 < act_ptr[r + 1]:
                nk = act_kind[k + 1]
                nc_ = act_chunk[k + 1]
                if nk != 3:
                    if nk == 0:
                        if prev_r[r, nc_] >= 0:
                            dep2 = send_at[((prev_r[r, nc_] * v + prev_c[r, nc_]) * 2 + 1) * m + act_mb[k + 1]]
                    elif next_r[r, nc_] >= 0:
                        dep2 = send_at[((next_r[r, nc_] * v + next_c[r, nc_]) * 2) * m + act_mb[k + 1]]
            if src >= 0:
                got = send_at[src * m + mb]
                if recv_s > 0:
                    g = at
                    at += 1
                    work[g] = recv_s
                    dev[g] = r
                    skind[g] = S_GATHER
                    code[g] = kbase + k_gather
                    cat[g] = C_P2P
                    d_own[nd] = g
                    d_dep[nd] = got
                    nd += 1
                    got = g
                dep1 = got
            b0 = b_ptr[r * v + c]
            nb = b_ptr[r * v + c + 1] - b0
            kpos = k - base_r
            mode = 0  # 0: one task; 1: forward pieces (gathers, buckets reversed); 2: backward pieces
            if fwd and go[r] and first_f[r, c] == kpos:
                mode = 1
            elif (not fwd) and overlap_grad and nb > 0 and last_b[r, c] == kpos:
                mode = 2
            if mode == 0:
                last = at
                at += 1
                work[last] = w
                dev[last] = r
                code[last] = slot
                cat[last] = kd
                islot[last] = wslot
                ishare[last] = sc
                nd = _depend(d_own, d_dep, nd, last, dep0, dep2, dep1)
            else:
                tot = 0
                for b in range(b0, b0 + nb):
                    tot += b_params[b]
                if tot == 0:
                    tot = 1
                prev_piece = -1
                for q in range(nb):
                    b = b0 + nb - 1 - q if mode == 1 else b0 + q
                    share = b_params[b] / tot
                    last = at
                    at += 1
                    work[last] = w * share
                    dev[last] = r
                    code[last] = slot
                    cat[last] = kd
                    islot[last] = wslot
                    ishare[last] = share * sc
                    if q == 0:
                        nd = _depend(d_own, d_dep, nd, last, dep0, dep2, dep1)
                    else:
                        d_own[nd] = last
                        d_dep[nd] = prev_piece
                        nd += 1
                    if mode == 1:
                        d_own[nd] = last
                        d_dep[nd] = gather_at[b]
                        nd += 1
                    prev_piece = last
                    if mode == 2 and (kd == 1 or kd == 3):  # the bucket's reduction starts after its piece
                        i = _dp_task(work, dev, skind, code, cat, dp_base, dp_cnt, r, b_reduce_s[b], kbase + b_reduce_code[b])
                        d_own[nd] = i
                        d_dep[nd] = last
                        nd += 1
                        reduce_ids[r, nreduce[r]] = i
                        nreduce[r] += 1
            last_compute[r] = last
            if dst >= 0:
                i = at
                at += 1
                work[i] = p2p
                dev[i] = r
                skind[i] = S_FWD if fwd else S_BWD
                code[i] = kbase + k_p2p
                cat[i] = C_P2P
                d_own[nd] = i
                d_dep[nd] = last
                nd += 1
                prev_send = i
            else:
                prev_send = -1
        if not overlap_grad:  # all reductions after the rank's last backward, chunks in that order
            nc = _chunks_in_order(order_c, last_b[r], v)  # by last backward
            for a in range(nc):
                c = order_c[a]
                for b in range(b_ptr[r * v + c], b_ptr[r * v + c + 1]):
                    i = _dp_task(work, dev, skind, code, cat, dp_base, dp_cnt, r, b_reduce_s[b], kbase + b_reduce_code[b])
                    d_own[nd] = i
                    d_dep[nd] = last_compute[r]
                    nd += 1
                    reduce_ids[r, nreduce[r]] = i
                    nreduce[r] += 1
    tied = -1
    if tied_on:
        r = pp - 1
        tied = dp_base[r] + 1 + dp_cnt[r]
        dp_cnt[r] += 1
        work[tied] = tied_s
        dev[tied] = r
        skind[tied] = S_DP
        code[tied] = kbase + k_allreduce
        cat[tied] = C_DP
        for q in range(nreduce[0]):
            d_own[nd] = tied
            d_dep[nd] = reduce_ids[0, q]
            nd += 1
        for q in range(nreduce[r]):
            d_own[nd] = tied
            d_dep[nd] = reduce_ids[r, q]
            nd += 1
        d_own[nd] = tied
        d_dep[nd] = last_compute[0]
        nd += 1
        d_own[nd] = tied
        d_dep[nd] = last_compute[r]
        nd += 1
    ok = at == dp_base[0]
    for r in range(pp):
        i = dp_base[r]
        if not overlap_gather:
            for b in range(b_ptr[r * v], b_ptr[r * v + v]):
                if b_gather_s[b] > 0:
                    j = _dp_task(work, dev, skind, code, cat, dp_base, dp_cnt, r, b_gather_s[b], kbase + k_gather)
                    d_own[nd] = j
                    d_dep[nd] = i
                    nd += 1
        if dp_cnt[r] != ndp[r]:
            ok = False
        work[i] = opt_s[r]
        dev[i] = r
        skind[i] = S_COMPUTE
        code[i] = kbase + k_memory
        cat[i] = C_OPT
        ishare[i] = scale[r]
        d_own[nd] = i
        d_dep[nd] = last_compute[r]
        nd += 1
        for q in range(nreduce[r]):
            d_own[nd] = i
            d_dep[nd] = reduce_ids[r, q]
            nd += 1
        if tied >= 0 and (r == 0 or r == pp - 1):
            d_own[nd] = i
            d_dep[nd] = tied
            nd += 1
    return (ok, n, work, dev, skind, code, cat, islot, ishare, d_own[:nd], d_dep[:nd])


@njit(cache=True, nogil=True, inline="always")
def _dp_task(work, dev, skind, code, cat, dp_base, dp_cnt, r, w, task_code):
    """Rank ``r``'s next data-parallel task (after its optimizer slot ``dp_base[r]``): its index."""
    i = dp_base[r] + 1 + dp_cnt[r]
    dp_cnt[r] += 1
    work[i] = w
    dev[i] = r
    skind[i] = S_DP
    code[i] = task_code
    cat[i] = C_DP
    return i


@njit(cache=True, nogil=True, inline="always")
def _chunks_in_order(order_c, pos, v):
    """The chunks with a position (>= 0) into ``order_c``, sorted by it (insertion sort: positions are
    distinct); their count."""
    nc = 0
    for c in range(v):
        if pos[c] >= 0:
            order_c[nc] = c
            nc += 1
    for a in range(1, nc):
        x = order_c[a]
        b2 = a
        while b2 > 0 and pos[order_c[b2 - 1]] > pos[x]:
            order_c[b2] = order_c[b2 - 1]
            b2 -= 1
        order_c[b2] = x
    return nc


@njit(cache=True, nogil=True, inline="always")
def _depend(d_own, d_dep, nd, task, dep0, dep2, dep1):
    """Append ``task``'s dependencies on dep0, dep2 and dep1 (in that order, -1: none); the new count."""
    for dep in (dep0, dep2, dep1):
        if dep >= 0:
            d_own[nd] = task
            d_dep[nd] = dep
            nd += 1
    return nd
