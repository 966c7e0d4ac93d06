"""The compiled event loop (Numba); see :mod:`echo_plan.replay.compiled.event_loop` for what it does.

Importing this module imports Numba; the switch (``switch.py``) imports it only when a replay needs it.
Module-level functions with ``cache=True`` are compiled once per machine and loaded from Numba's
on-disk cache afterwards.

The factor table is an open-addressing hash table in two arrays (``tkeys``, ``tvals``; size a power
of two, ``-1`` = empty slot, linear probing from ``key & (size - 1)``): Python fills it with
:func:`table_insert`, the loop only reads it.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def table_insert(tkeys: np.ndarray, tvals: np.ndarray, key: int, value: float) -> None:
    """Put ``key -> value`` in the table (the caller keeps it at most half full)."""
    mask = len(tkeys) - 1
    h = key & mask
    while tkeys[h] != -1 and tkeys[h] != key:
        h = (h + 1) & mask
    tkeys[h] = key
    tvals[h] = value


@njit(cache=True, nogil=True)
def table_find(tkeys, key):
    """Slot of ``key``, or -1 when it is not in the table."""
    mask = len(tkeys) - 1
    h = key & mask
    while True:
        x = tkeys[h]
        if x == key:
            return h
        if x == -1:
            return -1
        h = (h + 1) & mask


@njit(cache=True, nogil=True)
def start_head(s, now, st_i, qptr, order, head, busy, ndeps, start, last, rem, work, factor, dev, run_tasks,
               run_n, dirty_flag, dirty_list):
    h = head[s]
    if busy[s] or qptr[s] + h >= qptr[s + 1]:
        return
    i = order[qptr[s] + h]
    if ndeps[i]:
        return
    busy[s] = True
    start[i] = now
    last[i] = now
    rem[i] = work[i]
    factor[i] = 0.0
    d = dev[i]
    run_tasks[d, run_n[d]] = i
    run_n[d] += 1
    if not dirty_flag[d]:
        dirty_flag[d] = True
        dirty_list[st_i[4]] = d
        st_i[4] += 1


@njit(cache=True, nogil=True)
def key_of(i, d, run_tasks, run_n, pid, base, scratch):
    nrun = run_n[d]
    m = 0
    for k in range(nrun):
        j = run_tasks[d, k]
        if j != i:
            v = pid[j]
            pos = m  # insertion sort into scratch[:m]
            while pos > 0 and scratch[pos - 1] > v:
                scratch[pos] = scratch[pos - 1]
                pos -= 1
            scratch[pos] = v
            m += 1
    key = pid[i] + 1
    for k in range(m):
        key = key * base + scratch[k] + 1
    return key


@njit(cache=True, nogil=True)
def heap_push(hp_t, hp_s, hp_i, hp_v, size, t, s, i, v):
    pos = size
    while pos > 0:
        parent = (pos - 1) >> 1
        pt = hp_t[parent]
        if pt < t or (pt == t and hp_s[parent] < s):
            break
        hp_t[pos] = pt
        hp_s[pos] = hp_s[parent]
        hp_i[pos] = hp_i[parent]
        hp_v[pos] = hp_v[parent]
        pos = parent
    hp_t[pos] = t
    hp_s[pos] = s
    hp_i[pos] = i
    hp_v[pos] = v


@njit(cache=True, nogil=True)
def heap_pop(hp_t, hp_s, hp_i, hp_v, size):
    # removes the root; the caller has read it. size is the size before the pop.
    size -= 1
    t = hp_t[size]
    s = hp_s[size]
    i = hp_i[size]
    v = hp_v[size]
    pos = 0
    while True:
        c = 2 * pos + 1
        if c >= size:
            break
        r = c + 1
        if r < size and (hp_t[r] < hp_t[c] or (hp_t[r] == hp_t[c] and hp_s[r] < hp_s[c])):
            c = r
        if t < hp_t[c] or (t == hp_t[c] and s < hp_s[c]):
            break
        hp_t[pos] = hp_t[c]
        hp_s[pos] = hp_s[c]
        hp_i[pos] = hp_i[c]
        hp_v[pos] = hp_v[c]
        pos = c
    if size > 0:
        hp_t[pos] = t
        hp_s[pos] = s
        hp_i[pos] = i
        hp_v[pos] = v
    return size


@njit(cache=True, nogil=True)
def kernel(st_i, st_f, work, stream_of, dev, pid, ndeps, dptr, didx, qptr, order, head, busy, start, end,
           dep_end, dep_last, ver, rem, last, factor, run_tasks, run_n, dirty_flag, dirty_list,
           hp_t, hp_s, hp_i, hp_v, tkeys, tvals, base, miss):
    # st_i: 0 started, 1 seq, 2 done, 3 heap size, 4 dirty count, 5 missing keys; st_f: 0 now.
    # Returns 0 when no task can run any more, 1 when factors are missing (keys in miss[:st_i[5]]),
    # 2 when the heap needs more room; on 1 and 2 nothing has changed since the last event.
    nstreams = len(qptr) - 1
    scratch = np.zeros(run_tasks.shape[1] + 1, dtype=np.int64)
    if st_i[0] == 0:
        for s in range(nstreams):
            start_head(s, 0.0, st_i, qptr, order, head, busy, ndeps, start, last, rem, work, factor, dev,
                       run_tasks, run_n, dirty_flag, dirty_list)
        st_i[0] = 1
    now = st_f[0]
    while True:
        nd = st_i[4]
        # every factor the dirty devices need must be known before any state changes
        nmiss = 0
        for k in range(nd):
            d = dirty_list[k]
            if run_n[d] < 2:
                continue
            for r in range(run_n[d]):
                key = key_of(run_tasks[d, r], d, run_tasks, run_n, pid, base, scratch)
                if table_find(tkeys, key) < 0:
                    seen = False
                    for q in range(nmiss):
                        if miss[q] == key:
                            seen = True
                    if not seen and nmiss < len(miss):
                        miss[nmiss] = key
                        nmiss += 1
        if nmiss:
            st_i[5] = nmiss
            st_f[0] = now
            return 1
        # and the heap must have room for every push this pass can make (else Python grows it)
        room = 0
        for k in range(nd):
            room += run_n[dirty_list[k]]
        if st_i[3] + room > len(hp_t):
            st_f[0] = now
            return 2
        # devices in ascending order (as the Python loop)
        for a in range(1, nd):
            x = dirty_list[a]
            b = a
            while b > 0 and dirty_list[b - 1] > x:
                dirty_list[b] = dirty_list[b - 1]
                b -= 1
            dirty_list[b] = x
        seq = st_i[1]
        size = st_i[3]
        for k in range(nd):
            d = dirty_list[k]
            dirty_flag[d] = False
            nrun = run_n[d]
            for r in range(nrun):
                i = run_tasks[d, r]
                if nrun == 1:
                    f = 1.0
                else:
                    f = tvals[table_find(tkeys, key_of(i, d, run_tasks, run_n, pid, base, scratch))]
                fi = factor[i]
                if f != fi:
                    if fi > 0.0:
                        rr = rem[i] - (now - last[i]) / fi
                        rem[i] = rr if rr > 0.0 else 0.0
                        last[i] = now
                    factor[i] = f
                    ver[i] += 1
                    heap_push(hp_t, hp_s, hp_i, hp_v, size, now + rem[i] * f, seq, i, ver[i])
                    size += 1
                    seq += 1
        st_i[4] = 0
        st_i[1] = seq
        # the next valid event
        found = False
        i = -1
        while size > 0:
            t = hp_t[0]
            i = hp_i[0]
            v = hp_v[0]
            size = heap_pop(hp_t, hp_s, hp_i, hp_v, size)
            if v == ver[i]:
                now = t
                found = True
                break
        st_i[3] = size
        if not found:
            break
        end[i] = now
        ver[i] = -1
        st_i[2] += 1
        s = stream_of[i]
        busy[s] = False
        head[s] += 1
        d = dev[i]
        nrun = run_n[d]
        pos = 0
        while run_tasks[d, pos] != i:
            pos += 1
        for r in range(pos, nrun - 1):
            run_tasks[d, r] = run_tasks[d, r + 1]
        run_n[d] = nrun - 1
        if not dirty_flag[d]:
            dirty_flag[d] = True
            dirty_list[st_i[4]] = d
            st_i[4] += 1
        for q in range(dptr[i], dptr[i + 1]):
            j = didx[q]
            ndeps[j] -= 1
            if now >= dep_end[j]:
                dep_end[j] = now
                dep_last[j] = i
            if ndeps[j] == 0:
                sj = stream_of[j]
                if not busy[sj]:
                    start_head(sj, now, st_i, qptr, order, head, busy, ndeps, start, last, rem, work, factor,
                               dev, run_tasks, run_n, dirty_flag, dirty_list)
        h = head[s]
        if qptr[s] + h < qptr[s + 1] and not ndeps[order[qptr[s] + h]]:
            start_head(s, now, st_i, qptr, order, head, busy, ndeps, start, last, rem, work, factor, dev,
                       run_tasks, run_n, dirty_flag, dirty_list)
    st_f[0] = now
    return 0
