"""The interference event loop of :mod:`echo_plan.replay.engine`, compiled with Numba.

Same algorithm, same order of operations and the same floating-point expressions as the Python
loop (``engine._run_rates``), so both give the same starts and ends, bit for bit (tested on random
graphs and on real steps). It exists because a search replays hundreds of level-2 steps of
5-20 thousand tasks each, and the Python loop costs ~5 us per task.

Interference factors come from ``InterferenceModel.task_factor``, a Python function, which compiled
code cannot call. The loop is therefore resumable: every factor it needs is looked up in a table
keyed by (task profile, sorted profiles of the other tasks running on its GPU); when a key is
missing, the loop stops *before changing any state*, returns the missing keys, Python computes
them, and the loop goes on where it stopped. A step needs a few dozen distinct keys.

Numba is imported on first use (it costs ~0.3 s); without it, or with ``ECHO_PLAN_JIT=0`` in the
environment, :func:`available` is False and the engine uses the Python loop. The compiled code is
cached on disk by Numba (``cache=True``), so only the first run on a machine compiles it.
"""

from __future__ import annotations

import os
from itertools import chain
from typing import Any, Callable

_state: dict[str, Any] = {}  # the compiled kernel, once loaded (a cache, not configuration)

MAX_KEY = 2**62  # keys are base-(profiles+1) numbers of (1 + running tasks) digits


def available() -> bool:
    """True when the compiled loop can be used (Numba importable, not switched off)."""
    if os.environ.get("ECHO_PLAN_JIT", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if "kernel" not in _state:
        try:
            _state["kernel"] = _compile()
        except ImportError:
            _state["kernel"] = None
    return _state["kernel"] is not None


def run_rates(n: int, work: list[float], stream_of: list[int], device_of: list[int], pid: list[int],
              deps: list[tuple[int, ...]], nstreams: int, nprofiles: int,
              factor_of: Callable[[int, tuple[int, ...]], float]
              ) -> tuple[list[float], list[float], list[float], list[int], list[int], list[int]] | None:
    """Run the loop. ``pid``: each task's interference profile (0..nprofiles-1); ``factor_of(p,
    others)`` the factor of a task of profile p beside tasks of the sorted profiles ``others``.
    Returns start, end, dep_end, dep_last, and (for a deadlock message) ndeps and head per stream,
    or None when the keys would not fit in 64 bits (the caller uses the Python loop)."""
    import numpy as np

    kernel, init = _state["kernel"]
    i64, f64 = np.int64, np.float64
    # devices as 0..ndev-1, and the most tasks that can run at once on one of them (its streams)
    dev_arr = np.asarray(device_of, dtype=i64)
    ndev_ids, dev = np.unique(dev_arr, return_inverse=True)
    sid = np.asarray(stream_of, dtype=i64)
    stream_dev = np.zeros(nstreams, dtype=i64)
    stream_dev[sid] = dev
    maxrun = int(np.bincount(stream_dev, minlength=1).max()) if nstreams else 1
    base = nprofiles + 1
    if base ** (maxrun + 1) >= MAX_KEY:
        return None
    lens = np.fromiter(map(len, deps), dtype=i64, count=n)
    ndeps = lens.copy()
    flat = np.fromiter(chain.from_iterable(deps), dtype=i64, count=int(lens.sum()))
    order = np.argsort(sid, kind="stable")
    qptr = np.zeros(nstreams + 1, dtype=i64)
    np.cumsum(np.bincount(sid, minlength=nstreams), out=qptr[1:])
    # dependents in CSR form: for each task, the tasks that list it in deps, in task order
    owners = np.repeat(np.arange(n, dtype=i64), lens)
    by_dep = np.argsort(flat, kind="stable")
    didx = owners[by_dep]
    dptr = np.zeros(n + 1, dtype=i64)
    np.cumsum(np.bincount(flat, minlength=n), out=dptr[1:])

    w = np.asarray(work, dtype=f64)
    p = np.asarray(pid, dtype=i64)
    ndev = len(ndev_ids)
    st_i = np.zeros(8, dtype=i64)
    st_f = np.zeros(2, dtype=f64)
    head = np.zeros(nstreams, dtype=i64)
    busy = np.zeros(nstreams, dtype=np.bool_)
    start = np.zeros(n, dtype=f64)
    end = np.zeros(n, dtype=f64)
    dep_end = np.zeros(n, dtype=f64)
    dep_last = np.full(n, -1, dtype=i64)
    ver = np.zeros(n, dtype=i64)
    rem = np.zeros(n, dtype=f64)
    last = np.zeros(n, dtype=f64)
    factor = np.zeros(n, dtype=f64)
    run_tasks = np.zeros((ndev, maxrun), dtype=i64)
    run_n = np.zeros(ndev, dtype=i64)
    dirty_flag = np.zeros(ndev, dtype=np.bool_)
    dirty_list = np.zeros(ndev, dtype=i64)
    cap = n * (2 * maxrun + 1) + 16  # every start or end pushes at most one entry per running task
    hp_t = np.zeros(cap, dtype=f64)
    hp_s = np.zeros(cap, dtype=i64)
    hp_i = np.zeros(cap, dtype=i64)
    hp_v = np.zeros(cap, dtype=i64)
    keys = init()
    miss = np.zeros(max(64, ndev * maxrun), dtype=i64)
    while True:
        status = kernel(st_i, st_f, w, sid, dev, p, ndeps, dptr, didx, qptr, order, head, busy, start, end,
                        dep_end, dep_last, ver, rem, last, factor, run_tasks, run_n, dirty_flag, dirty_list,
                        hp_t, hp_s, hp_i, hp_v, keys, base, miss)
        if status == 0:
            break
        for k in miss[:st_i[5]].tolist():  # decode each missing key, compute its factor
            digits = []
            x = k
            while x:
                digits.append(x % base - 1)
                x //= base
            digits.reverse()
            keys[k] = float(factor_of(digits[0], tuple(digits[1:])))
    return (start.tolist(), end.tolist(), dep_end.tolist(), dep_last.tolist(), ndeps.tolist(), head.tolist())


def _compile():
    import numba
    import numpy as np
    from numba import njit, types
    from numba.typed import Dict

    int64, float64 = types.int64, types.float64

    def init():
        return Dict.empty(key_type=int64, value_type=float64)

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
               hp_t, hp_s, hp_i, hp_v, keys, base, miss):
        # st_i: 0 started, 1 seq, 2 done, 3 heap size, 4 dirty count, 5 missing keys; st_f: 0 now
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
                    if key not in keys:
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
                        f = keys[key_of(i, d, run_tasks, run_n, pid, base, scratch)]
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

    del numba
    return kernel, init
