"""Compiled kernels beside the level-2 builder (``build_kernel.py``): the event loop's arrays of a built
step (``graph``), a replayed step's critical rank and breakdown (``replay/breakdown.py``'s, on arrays)
and ZB-V's list schedule (``schedules_zb._zb_v``'s).
Each does the same floating-point operations in the same order as the Python code it mirrors, so the
results are the same bit for bit (tests/replay/test_pipeline_fast.py). Importing this module imports
Numba; ``build_kernel`` re-exports its kernels.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def breakdown(pp, n, dev, skind, sid, keys, qptr, order, start, end, work, dep_end, dep_last, cat, islot, ishare,
              ph_compute, ph_tp, ph_inter, ph_ep, ph_host):
    """``replay/breakdown.py``'s critical rank and step breakdown on the replay's arrays, with the same
    floating-point operations in the same order. Returns (rank, step end of the rank, compute, tp,
    pp, dp, bubble, interference, optimizer, expert exchange, host), and the previous task of each stream and the dependency
    that released each task (``ReplayResult.prev_at`` / ``waited_at``)."""
    ns = len(qptr) - 1
    prev = np.full(n, -1, dtype=np.int64)
    waited = np.full(n, -1, dtype=np.int64)
    for s in range(ns):
        prev_end = 0.0
        for q in range(qptr[s], qptr[s + 1]):
            i = order[q]
            if q > qptr[s]:
                prev[i] = order[q - 1]
            j = dep_last[i]
            if j >= 0 and dep_end[i] > prev_end:
                waited[i] = j
            prev_end = end[i]
    dev_end = np.full(pp, -1.0)
    has = np.zeros(pp, dtype=np.bool_)
    for s in range(ns):
        d = keys[s] // 5
        e = end[order[qptr[s + 1] - 1]]
        if not has[d] or e > dev_end[d]:
            dev_end[d] = e
            has[d] = True
    rank = 0
    best = dev_end[0] if has[0] else 0.0
    for r in range(1, pp):
        e = dev_end[r] if has[r] else 0.0
        if e > best:
            best = e
            rank = r
    step_end = dev_end[rank] if has[rank] else 0.0
    cs = -1
    for s in range(ns):
        if keys[s] == rank * 5:
            cs = s
    compute = tp = pp_s = dp_s = bubble = inter = opt = ep = host = 0.0
    if cs >= 0:
        for q in range(qptr[cs], qptr[cs + 1]):
            i = order[q]
            w = work[i]
            actual = end[i] - start[i]
            if cat[i] == 6:
                opt += w
            else:
                sl = islot[i]
                compute += ph_compute[sl] * ishare[i]
                tp += ph_tp[sl] * ishare[i]
                ep += ph_ep[sl] * ishare[i]
                host += ph_host[sl] * ishare[i]
                inter += ph_inter[sl] * ishare[i]
            inter += actual - w
        # the gaps of the compute stream, each with the task it waited on (idle_intervals)
        cursor0 = 0.0
        ngap = 0
        g_start = np.zeros(qptr[cs + 1] - qptr[cs] + 1)
        g_end = np.zeros(qptr[cs + 1] - qptr[cs] + 1)
        g_wait = np.zeros(qptr[cs + 1] - qptr[cs] + 1, dtype=np.int64)
        g_next = np.zeros(qptr[cs + 1] - qptr[cs] + 1, dtype=np.int64)
        for q in range(qptr[cs], qptr[cs + 1]):
            i = order[q]
            s0 = start[i]
            if s0 > cursor0:
                g_start[ngap] = cursor0
                g_end[ngap] = s0
                g_wait[ngap] = waited[i]
                g_next[ngap] = i
                ngap += 1
            e = end[i]
            cursor0 = cursor0 if cursor0 >= e else e
        if step_end > cursor0:
            g_start[ngap] = cursor0
            g_end[ngap] = step_end
            g_wait[ngap] = -1
            g_next[ngap] = -1
            ngap += 1
        for g in range(ngap):
            gap_start = g_start[g]
            cursor = g_end[g]
            if g_next[g] < 0:  # after the optimizer: the rank's task that ends last (the first such)
                x = -1
                for i in range(n):
                    if dev[i] == rank and (x < 0 or end[i] > end[x]):
                        x = i
            else:
                x = g_wait[g]
            while x >= 0 and cursor > gap_start:
                c = cat[x]
                if c != 4 and c != 5:
                    break
                s0 = start[x]
                seg = s0 if s0 >= gap_start else gap_start
                if c == 4:
                    pp_s += cursor - seg
                else:
                    dp_s += cursor - seg
                cursor = seg
                released = waited[x]
                x = released if released >= 0 else prev[x]
            if cursor > gap_start:
                bubble += cursor - gap_start
    return rank, step_end, compute, tp, pp_s, dp_s, bubble, inter, opt, ep, host, prev, waited


@njit(cache=True, nogil=True)
def _before(a0, a1, a2, a3, b0, b1, b2, b3):
    """(a0, a1, a2, a3) < (b0, b1, b2, b3), as Python compares tuples."""
    if a0 != b0:
        return a0 < b0
    if a1 != b1:
        return a1 < b1
    if a2 != b2:
        return a2 < b2
    return a3 < b3


@njit(cache=True, nogil=True)
def zb_v(pp, m, tf, tb, tw):
    """``schedules_zb._zb_v``'s list schedule (same picks, same float operations, same heap order).
    Returns per rank the actions as (pass code 0 F / 2 Bi / 3 W, micro-batch, chunk) rows, and ok."""
    nst = 2 * pp
    inf = np.inf
    f_end = np.full((nst, m), inf)
    b_end = np.full((nst, m), inf)
    next_f = np.zeros((pp, 2), dtype=np.int64)
    next_b = np.zeros((pp, 2), dtype=np.int64)
    held = np.zeros(pp, dtype=np.int64)
    pend = np.zeros((pp, 2 * m, 2), dtype=np.int64)  # FIFO of (micro-batch, chunk) per rank
    p_head = np.zeros(pp, dtype=np.int64)
    p_tail = np.zeros(pp, dtype=np.int64)
    out = np.zeros((pp, 6 * m, 3), dtype=np.int64)
    nout = np.zeros(pp, dtype=np.int64)
    left = np.full(pp, 6 * m, dtype=np.int64)
    cap = 2 * pp
    heap = [(0.0, 0, r) for r in range(pp)]
    blocked = np.zeros(pp + 2, dtype=np.bool_)  # index x + 1
    spins = 0
    while len(heap) > 0:
        now, was_waiting, r = heapq.heappop(heap)
        end = now
        found = False
        b0 = b1 = b2 = b3 = 0  # the best (priority, micro-batch, -stage, chunk)
        soon = inf
        for c in range(2):
            k = r if c == 0 else nst - 1 - r
            i = next_b[r, c]
            if i < m:
                ready = f_end[k, i]
                if k < nst - 1 and b_end[k + 1, i] > ready:
                    ready = b_end[k + 1, i]
                if ready <= now:
                    if not found or _before(0, i, -k, c, b0, b1, b2, b3):
                        b0, b1, b2, b3 = 0, i, -k, c
                        found = True
                elif ready < soon:
                    soon = ready
            i = next_f[r, c]
            if i < m and held[r] < cap - (1 - c):
                ready = f_end[k - 1, i] if k > 0 else 0.0
                if ready <= now:
                    if not found or _before(1, i, -k, c, b0, b1, b2, b3):
                        b0, b1, b2, b3 = 1, i, -k, c
                        found = True
                elif ready < soon:
                    soon = ready
        if found:
            i, c = b1, b3
            if b0 == 0:
                out[r, nout[r], 0] = 2
                b_end[-b2, i] = now + tb
                next_b[r, c] += 1
                pend[r, p_tail[r], 0] = i
                pend[r, p_tail[r], 1] = c
                p_tail[r] += 1
                end = now + tb
            else:
                out[r, nout[r], 0] = 0
                f_end[-b2, i] = now + tf
                next_f[r, c] += 1
                held[r] += 1
                end = now + tf
            out[r, nout[r], 1] = i
            out[r, nout[r], 2] = c
            nout[r] += 1
        elif p_head[r] < p_tail[r]:
            i = pend[r, p_head[r], 0]
            c = pend[r, p_head[r], 1]
            p_head[r] += 1
            out[r, nout[r], 0] = 3
            out[r, nout[r], 1] = i
            out[r, nout[r], 2] = c
            nout[r] += 1
            held[r] -= 1
            end = now + tw
        else:
            spins += 1
            if spins > 64 * (6 * m * pp + pp):
                return out, nout, False
            if soon < inf:
                heapq.heappush(heap, (soon, 0, r))
            else:
                blocked[r + 1] = True
                if len(heap) == 0:
                    return out, nout, False
            continue
        for x in (r - 1, r + 1):
            if blocked[x + 1]:
                blocked[x + 1] = False
                heapq.heappush(heap, (now, 1, x))
        left[r] -= 1
        if left[r]:
            heapq.heappush(heap, (end, 0, r))
    for r in range(pp):
        if left[r]:
            return out, nout, False
    return out, nout, True


@njit(cache=True, nogil=True)
def graph(n, pp, dev, skind, d_own, d_dep, code, ncodes):
    """The event loop's arrays: streams numbered in order of first use (as the engine numbers them)
    with their (device, stream code), each stream's tasks in order (``qptr``/``order``), dependency
    counts, dependents in CSR form (task order), the most streams of one device, and the profile
    codes in order of first use."""
    sid_of = np.full(pp * 5, -1, dtype=np.int64)
    sid = np.zeros(n, dtype=np.int64)
    keys = np.zeros(pp * 5, dtype=np.int64)
    ns = 0
    seen = np.zeros(ncodes, dtype=np.bool_)
    codes = np.zeros(ncodes, dtype=np.int64)
    nc = 0
    for i in range(n):
        key = dev[i] * 5 + skind[i]
        s = sid_of[key]
        if s < 0:
            s = sid_of[key] = ns
            keys[ns] = key
            ns += 1
        sid[i] = s
        if not seen[code[i]]:
            seen[code[i]] = True
            codes[nc] = code[i]
            nc += 1
    qptr = np.zeros(ns + 1, dtype=np.int64)
    for i in range(n):
        qptr[sid[i] + 1] += 1
    per_dev = np.zeros(pp, dtype=np.int64)
    for s in range(ns):
        qptr[s + 1] += qptr[s]
        per_dev[keys[s] // 5] += 1
    fill = qptr[:-1].copy()
    order = np.zeros(n, dtype=np.int64)
    for i in range(n):
        s = sid[i]
        order[fill[s]] = i
        fill[s] += 1
    nd = len(d_own)
    ndeps = np.zeros(n, dtype=np.int64)
    dptr = np.zeros(n + 1, dtype=np.int64)
    for q in range(nd):
        ndeps[d_own[q]] += 1
        dptr[d_dep[q] + 1] += 1
    for i in range(n):
        dptr[i + 1] += dptr[i]
    # dependents of each task in task order: owners by increasing index within each dependency
    by_owner = np.argsort(d_own, kind="mergesort")
    didx = np.zeros(nd, dtype=np.int64)
    fill = dptr[:-1].copy()
    for q in range(nd):
        j = by_owner[q]
        d = d_dep[j]
        didx[fill[d]] = d_own[j]
        fill[d] += 1
    maxrun = 1
    for d in range(pp):
        if per_dev[d] > maxrun:
            maxrun = per_dev[d]
    return sid, keys[:ns], qptr, order, ndeps, dptr, didx, maxrun, codes[:nc]
