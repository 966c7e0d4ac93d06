"""Slowdowns: a compute straggler, or a slow NIC, NVLink or link (docs/diagnose.md, "Slowdowns").

* Non-communication: a rank's *gaps* (from the end of its previous op to its arrival at the next,
  on its own clock) are its own work; waiting for others happens inside collectives, not in the
  gaps. Each gap is compared with the normal gap at the same program point (the same position in
  the same sequence of ops: the ranks of one pipeline stage) over all ranks; a rank whose gaps sum to clearly more
  than the medians is a straggler: it arrives last and waits least. Without end times (torch's
  Gloo records only enqueue times) the rank that arrives last in most of its collectives, by a
  clear share of the time between collectives, is the straggler.
* Communication: with per-connection records, each connection's busy time over the median of its
  class is one cell of the delay matrix (matrix.py reads its shape). Without them, each group's
  transfer time (from the last arrival to the end) is compared with groups of the same op, size
  and span; the ranks common to every slow group are the suspects.

Thresholds are relative to the records' own distribution: a value stands out when it is both a
clear share above normal (TAU_*) and many standard deviations away. Because faults only make
things slower, "normal" is the lower quartile and the spread is read below it (stats.normal_low),
so a fault that slows up to three quarters of the values (a server of a two-server job) still
stands out.
"""

from __future__ import annotations

import numpy as np

from echo_plan.resilience.diagnose.matrix import localise_tiers
from echo_plan.resilience.diagnose.records import ConnDir, RecordTable, State
from echo_plan.resilience.diagnose.stats import hash_cols, normal_low, seg_max, seg_median, seg_quantile
from echo_plan.resilience.diagnose.verdict import Component, Suspect, confidence

# Judgements, not measurements: how far above normal a figure must be to count (docs/diagnose.md)
TAU_COMPUTE = 0.05  # a rank's own work 5% above the median at the same program points
TAU_CELL = 0.25  # a connection 25% slower than its class
TAU_GROUP = 0.25  # a group's transfers 25% slower than its peer groups'
TAU_LATE = 0.10  # (no end times) arriving last by 10% of the time between collectives
Z_MIN = 6.0  # and this many robust standard deviations from the median
MIN_ROWS = 5


def _gaps(t: RecordTable, arrive: np.ndarray) -> np.ndarray:
    """Per row, the rank's own time before it: from the end of its previous op, or from the previous
    op's start when that op is a send (a send does not hold its sender: NCCL and torch post it
    and carry on), to this op's arrival; NaN on a rank's first row."""
    gap = np.full(len(t), np.nan)
    if len(t) > 1:
        same = t.rank[1:] == t.rank[:-1]
        send = np.asarray([name == "send" for name in t.op_names], dtype=bool)
        prev_send = send[t.op[:-1]] if send.size else np.zeros(len(t) - 1, bool)
        since = np.where(prev_send, arrive[:-1], t.end_s[:-1])
        gap[1:] = np.where(same, np.maximum(arrive[1:] - since, 0.0), np.nan)
    return gap


def compute_stragglers(t: RecordTable, arrive: np.ndarray, inst: np.ndarray, node_of) -> tuple[list[Suspect], dict]:
    gap = _gaps(t, arrive)
    size = np.asarray([len(m) for m in t.group_ranks], dtype=np.int64)[t.group]
    prev_op = np.r_[-1, t.op[:-1]]
    prev_nb = np.r_[-1, t.nbytes[:-1]]
    ok = np.isfinite(gap)
    if ok.sum() < MIN_ROWS:
        return _late_arrivers(t, arrive, inst, node_of)
    key, coarse = _program_points(t, size, prev_op, prev_nb)
    key = key[ok]
    g = gap[ok]
    med = seg_quantile(key, g, 0.25)  # the normal gap here: faults only lengthen gaps
    ranks = t.rank[ok]
    uniq, inv = np.unique(ranks, return_inverse=True)
    own = np.bincount(inv, weights=g)
    norm = np.bincount(inv, weights=med)
    n = np.bincount(inv)
    fine = np.where((norm > 0) & (n >= MIN_ROWS), (own - norm) / np.maximum(norm, 1e-12), 0.0)
    z1, base1, _ = normal_low(fine, 0.005)
    # the same work in another order (the pipeline stages between the first and the last): the
    # rank's total against ranks whose ops are the same multiset
    role = coarse[ok][np.unique(inv, return_index=True)[1]]
    base_tot = seg_quantile(role, own, 0.25)
    _, rinv, rcount = np.unique(role, return_inverse=True, return_counts=True)
    wide = np.where(rcount[rinv] >= 3, own / np.maximum(base_tot, 1e-12) - 1.0, 0.0)
    z2, base2, _ = normal_low(wide, 0.005)
    flag1 = (fine - base1 >= TAU_COMPUTE) & (z1 >= Z_MIN)
    flag2 = (wide - base2 >= TAU_COMPUTE) & (z2 >= Z_MIN)
    use1 = flag1 | ~flag2
    excess, z = np.where(use1, fine, wide), np.where(use1, z1, z2)
    base = np.where(use1, base1, base2)
    flagged = np.flatnonzero(flag1 | flag2)
    if flagged.size == 0:
        return [], {}
    order = flagged[np.argsort(-excess[flagged])]
    suspects = []
    for i in order[:64]:
        r = int(uniq[i])
        strength = min((excess[i] - base[i]) / TAU_COMPUTE, z[i] / Z_MIN)
        suspects.append(Suspect(r, node_of(r), Component.GPU, confidence(strength, 1),
                                f"its own work between collectives is {excess[i]:+.1%} against ranks at the same "
                                "program points"))
    top = suspects[0].rank
    ev = {"compute_excess": [{"rank": int(uniq[i]), "excess": round(float(excess[i]), 4)} for i in order[:16]],
          "last_arriving": _arrival_evidence(t, arrive, inst, top)}
    return suspects, ev


def _program_points(t: RecordTable, size: np.ndarray, prev_op: np.ndarray, prev_nb: np.ndarray) -> np.ndarray:
    """A key per row that is equal on ranks at the same point of the same program: the rank's *role*
    (a hash of its whole sequence of ops, sizes and group sizes: the ranks of one pipeline stage
    share it) and the row's position in the rank's sequence. Ranks whose role fewer than three
    ranks share are keyed by the op, its size, group size, sequence number and previous op instead."""
    # a point-to-point op's direction (to a lower or a higher rank: the previous or the next
    # pipeline stage) tells a forward from a backward where the collectives alike would not
    hi = np.asarray([max(m) for m in t.group_ranks], dtype=np.int64)[t.group]
    direction = np.where(t.p2p, np.where(hi > t.rank, 1, 2), 0)
    row = hash_cols(t.op, t.nbytes, size, direction)
    starts = np.flatnonzero(np.r_[True, t.rank[1:] != t.rank[:-1]])
    pos = np.arange(len(t)) - np.repeat(starts, np.diff(np.r_[starts, len(t)]))
    with np.errstate(over="ignore"):
        mixed = hash_cols(row, pos).view(np.uint64)
        role_of_rank = np.add.reduceat(mixed, starts) if starts.size else mixed[:0]
    counts = np.diff(np.r_[starts, len(t)])
    role_of_rank = hash_cols(role_of_rank.view(np.int64), counts)
    _, rinv, rcount = np.unique(role_of_rank, return_inverse=True, return_counts=True)
    role = np.repeat(role_of_rank, counts)
    shared = np.repeat(rcount[rinv] >= 3, counts)
    by_role = hash_cols(role, pos)
    fallback = hash_cols(t.op, t.nbytes, size, t.seq, t.p2p.astype(np.int64), prev_op, prev_nb)
    with np.errstate(over="ignore"):
        bag = np.add.reduceat(row.view(np.uint64), starts) if starts.size else row[:0].view(np.uint64)
    coarse = np.repeat(hash_cols(bag.view(np.int64), counts), counts)
    return np.where(shared, by_role, fallback), coarse


def _arrival_evidence(t: RecordTable, arrive: np.ndarray, inst: np.ndarray, rank: int) -> dict:
    late = arrive - seg_median(inst, arrive)
    last = arrive >= seg_max(inst, arrive)
    wait = t.end_s - arrive
    mine = t.rank == rank
    out = {"rank": rank, "last_share": round(float(last[mine].mean()), 3) if mine.any() else 0.0,
           "late_by_s": float(np.median(late[mine])) if mine.any() else 0.0}
    if np.isfinite(wait[mine]).any():
        out["median_wait_s"] = float(np.nanmedian(wait[mine]))
        out["group_median_wait_s"] = float(np.nanmedian(wait[~mine])) if (~mine).any() else None
    return out


def _late_arrivers(t: RecordTable, arrive: np.ndarray, inst: np.ndarray, node_of) -> tuple[list[Suspect], dict]:
    """Records with arrival times only (no end): the rank that is last, clearly, most of the time."""
    size = np.asarray([len(m) for m in t.group_ranks], dtype=np.int64)[t.group]
    sel = size >= 2
    if sel.sum() < MIN_ROWS:
        return [], {}
    late = arrive - seg_median(inst, arrive)
    last = arrive >= seg_max(inst, arrive)
    step = np.diff(arrive)
    same = t.rank[1:] == t.rank[:-1]
    interval = float(np.median(step[same])) if same.any() else 0.0
    suspects, evidence = [], {}
    for r in np.unique(t.rank[sel]):
        mine = sel & (t.rank == r)
        if mine.sum() < 3:
            continue
        share, lby = float(last[mine].mean()), float(np.median(late[mine]))
        if share >= 0.6 and interval > 0 and lby >= TAU_LATE * interval:
            suspects.append(Suspect(int(r), node_of(int(r)), Component.GPU, confidence(lby / (TAU_LATE * interval)),
                                    f"arrives last in {share:.0%} of its collectives, by {lby * 1e3:.3g} ms "
                                    "(the records have no end times)"))
    if suspects:
        suspects.sort(key=lambda s: -s.confidence)
        evidence = {"last_arriving": _arrival_evidence(t, arrive, inst, suspects[0].rank)}
    return suspects, evidence


def comm_slow(t: RecordTable, arrive: np.ndarray, inst: np.ndarray, node_of) -> tuple[list[Suspect], dict]:
    if t.conn_row.size:
        return _cells(t, node_of)
    return _groups(t, arrive, inst, node_of)


def _cells(t: RecordTable, node_of) -> tuple[list[Suspect], dict]:
    rows = t.conn_row
    ok = (t.state[rows] != State.SCHEDULED) & np.isfinite(t.conn_busy_s) & (t.conn_busy_s > 0)
    rows, busy = rows[ok], t.conn_busy_s[ok]
    me, peer = t.rank[rows], t.conn_peer[ok]
    send = t.conn_dir[ok] == ConnDir.SEND
    src, dst = np.where(send, me, peer), np.where(send, peer, me)
    arr = node_of.arr
    ns, nd = arr[np.clip(src, 0, arr.size - 1)], arr[np.clip(dst, 0, arr.size - 1)]
    tier = ((ns == nd) & (ns >= 0)).astype(np.int64)
    size = np.asarray([len(m) for m in t.group_ranks], dtype=np.int64)[t.group[rows]]
    cls = hash_cols(t.op[rows], t.nbytes[rows], size, tier)
    ratio = busy / np.maximum(seg_quantile(cls, busy, 0.25), 1e-15)
    cell = src * (1 << 31) + dst
    cval = seg_median(cell, ratio)
    uc, first = np.unique(cell, return_index=True)
    vals = cval[first]
    z, med, _ = normal_low(vals, 0.02)
    badm = (vals >= (1 + TAU_CELL) * med) & (z >= Z_MIN)
    cells = {(int(c >> 31), int(c & ((1 << 31) - 1))): float(v) for c, v in zip(uc, vals)}
    bad = {(int(c >> 31), int(c & ((1 << 31) - 1))) for c in uc[badm]}
    if not bad:
        return [], {}
    suspects, ev = localise_tiers(cells, bad, node_of, lambda c: (cells[c] - 1) / TAU_CELL, "is slow")
    return suspects, {"delay_matrix": ev}


def _groups(t: RecordTable, arrive: np.ndarray, inst: np.ndarray, node_of) -> tuple[list[Suspect], dict]:
    ok = np.isfinite(t.end_s) & np.isfinite(arrive)
    if ok.sum() < MIN_ROWS:
        return [], {}
    x = seg_median(inst[ok], t.end_s[ok]) - seg_max(inst[ok], arrive[ok])
    g = t.group[ok]
    span = np.zeros(len(t.group_names), dtype=np.int64)
    for gid, members in enumerate(t.group_ranks):
        nodes = {node_of(m) for m in members}
        span[gid] = len(nodes) if None not in nodes else 0
    size = np.asarray([len(m) for m in t.group_ranks], dtype=np.int64)
    first = np.unique(inst[ok], return_index=True)[1]  # one row per instance
    gi, xi = g[first], x[first]
    cls = hash_cols(t.op[ok][first], t.nbytes[ok][first], size[gi], span[gi])
    # a class needs instances of two groups or more to say what is normal (faults slow a minority)
    uc, cinv = np.unique(cls, return_inverse=True)
    distinct = np.asarray([np.unique(gi[cinv == c]).size for c in range(uc.size)])[cinv] if uc.size < 20000 \
        else np.full(cls.size, 3)
    keep = distinct >= 2
    if not keep.any():
        return [], {}
    ratio = xi[keep] / np.maximum(seg_quantile(cls[keep], xi[keep], 0.25), 1e-15)
    gk = gi[keep]
    gu = np.unique(gk)
    score = seg_median(gk, ratio)[np.unique(gk, return_index=True)[1]]
    z, med, _ = normal_low(score, 0.02)
    bad_groups = [(int(gu[j]), float(score[j])) for j in range(gu.size)
                  if score[j] >= (1 + TAU_GROUP) * med and z[j] >= Z_MIN]
    if not bad_groups:
        return [], {}
    strength = max(r for _, r in bad_groups) - 1
    ev = {"slow_groups": [{"group": t.group_names[gid], "ratio": round(r, 3)} for gid, r in bad_groups][:16]}
    return _explain_groups([set(t.group_ranks[gid]) for gid, _ in bad_groups], node_of, strength / TAU_GROUP), ev


def _explain_groups(sets: list[set[int]], node_of, strength: float) -> list[Suspect]:
    """The component that every slow group uses. A group inside one server can only be slowed by
    that server's NVLink (or its GPUs' links to it); when such groups are slow, the server's NVLink
    explains them and every slow group with two members or more on that server. Otherwise, the
    NIC of the ranks common to every slow group (or, when none is, of those in the most)."""
    inside = [g for g in sets if len({node_of(m) for m in g}) == 1 and None not in {node_of(m) for m in g}]
    if inside:
        nodes = {node_of(next(iter(g))) for g in inside}
        if len(nodes) == 1:
            node = nodes.pop()
            covered = sum(sum(node_of(m) == node for m in g) >= 2 for g in sets)
            return [Suspect(None, node, Component.NVLINK, confidence(strength) * covered / len(sets),
                            f"{len(inside)} slow groups stay inside this node; {covered} of {len(sets)} slow groups "
                            "use its NVLink")]
    common = sorted(set.intersection(*sets))
    if not common:
        count: dict[int, int] = {}
        for g in sets:
            for m in g:
                count[m] = count.get(m, 0) + 1
        best = max(count.values())
        common = sorted(m for m, c in count.items() if c == best)
    return [Suspect(r, node_of(r), Component.NIC, confidence(strength, len(common)),
                    f"a member of every slow group ({len(sets)}); the records have no per-connection data")
            for r in common]
