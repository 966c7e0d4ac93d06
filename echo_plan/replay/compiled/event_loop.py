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

The loop itself is in :mod:`echo_plan.replay.compiled.rates_kernel` (importing Numba and loading
the cached kernel cost ~0.6 s; Numba caches the compiled code on disk, so only the first run on a
machine compiles it, ~4 s). Whether it runs, and loading it, is the switch's (``switch.py``): this
module only runs a loaded kernel module on a graph.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable

MAX_KEY = 2**62  # keys are base-(profiles+1) numbers of (1 + running tasks) digits
HEAP_SLOTS_PER_TASK, HEAP_MIN_SLOTS = 4, 64  # a step pushes 2-3 events per task; the loop asks for more


def run_with(mod: Any, n: int, work: list[float], stream_of: list[int], device_of: list[int], pid: list[int],
         deps: list[tuple[int, ...]], nstreams: int, nprofiles: int, factor_of: Callable[[int, tuple[int, ...]], float]
         ) -> tuple[list[float], list[float], list[float], list[int], list[int], list[int]] | None:
    """Run the loop of kernel module ``mod``. ``pid``: each task's interference profile
    (0..nprofiles-1); ``factor_of(p, others)`` the factor of a task of profile p beside tasks of the
    sorted profiles ``others``. Returns start, end, dep_end, dep_last, and (for a deadlock message)
    ndeps and head per stream, or None when the keys would not fit in 64 bits (the caller uses the
    Python loop)."""
    import numpy as np

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
    out = run_arrays(mod, n, np.asarray(work, dtype=f64), sid, dev, len(ndev_ids), maxrun, np.asarray(pid, dtype=i64),
                     ndeps, dptr, didx, qptr, order, nprofiles, factor_of)
    start, end, dep_end, dep_last, ndeps, head = out
    return (start.tolist(), end.tolist(), dep_end.tolist(), dep_last.tolist(), ndeps.tolist(), head.tolist())


def run_arrays(mod: Any, n: int, w: Any, sid: Any, dev: Any, ndev: int, maxrun: int, p: Any, ndeps: Any, dptr: Any,
               didx: Any, qptr: Any, order: Any, nprofiles: int, factor_of: Callable[[int, tuple[int, ...]], float]
               ) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The loop on a graph already in array form (int64 / float64 numpy arrays): ``sid``/``dev`` each
    task's stream and device (0..ndev-1), ``p`` its profile, ``ndeps`` its dependency count (consumed),
    ``dptr``/``didx`` its dependents in CSR form (task order), ``qptr``/``order`` each stream's tasks in
    order; ``maxrun`` the most streams of one device. Returns start, end, dep_end, dep_last, and ndeps
    and head per stream (as arrays; for a deadlock message). The caller checks ``(nprofiles + 1) **
    (maxrun + 1) < MAX_KEY``."""
    import numpy as np

    i64, f64 = np.int64, np.float64
    nstreams = len(qptr) - 1
    base = nprofiles + 1
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
    cap = HEAP_SLOTS_PER_TASK * n + HEAP_MIN_SLOTS
    hp_t = np.zeros(cap, dtype=f64)
    hp_s = np.zeros(cap, dtype=i64)
    hp_i = np.zeros(cap, dtype=i64)
    hp_v = np.zeros(cap, dtype=i64)
    table = 64
    tkeys = np.full(table, -1, dtype=i64)
    tvals = np.zeros(table, dtype=f64)
    nkeys = 0
    miss = np.zeros(max(64, ndev * maxrun), dtype=i64)
    while True:
        status = mod.kernel(st_i, st_f, w, sid, dev, p, ndeps, dptr, didx, qptr, order, head, busy, start, end,
                            dep_end, dep_last, ver, rem, last, factor, run_tasks, run_n, dirty_flag, dirty_list,
                            hp_t, hp_s, hp_i, hp_v, tkeys, tvals, base, miss)
        if status == 0:
            break
        if status == 2:  # the heap is full: double it (live entries are its first st_i[3] slots)
            hp_t, hp_s, hp_i, hp_v = (np.concatenate([a, np.zeros_like(a)]) for a in (hp_t, hp_s, hp_i, hp_v))
            continue
        missing = miss[:st_i[5]].tolist()
        if 2 * (nkeys + len(missing)) > table:  # keep the table at most half full
            while 2 * (nkeys + len(missing)) > table:
                table *= 2
            old = [(int(k), float(v)) for k, v in zip(tkeys, tvals) if k != -1]
            tkeys = np.full(table, -1, dtype=i64)
            tvals = np.zeros(table, dtype=f64)
            for k, v in old:
                mod.table_insert(tkeys, tvals, k, v)
        for k in missing:  # decode each missing key, compute its factor
            digits = []
            x = k
            while x:
                digits.append(x % base - 1)
                x //= base
            digits.reverse()
            mod.table_insert(tkeys, tvals, k, float(factor_of(digits[0], tuple(digits[1:]))))
            nkeys += 1
    return start, end, dep_end, dep_last, ndeps, head
