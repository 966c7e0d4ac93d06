"""``diagnose``: records in, a syndrome and suspects out (hang rules first, then slowdowns).

Never needs the simulator: it reads only the records (and, where they do not say which server a
rank is on, the GPUs per server of ``--cluster``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from echo_plan.resilience.diagnose.hang import find_hang
from echo_plan.resilience.diagnose.records import RecordTable, State
from echo_plan.resilience.diagnose.slow import comm_slow, compute_stragglers
from echo_plan.resilience.diagnose.stats import hash_cols
from echo_plan.resilience.diagnose.verdict import Diagnosis, Syndrome
from echo_plan.resilience.diagnose.layout import labelled, missing_in
from echo_plan.resilience.diagnose.layout import make_layout
from echo_plan.resilience.diagnose.load import cluster_node_of, load_records

if TYPE_CHECKING:
    from echo_plan.resilience.diagnose.layout import Layout


class NodeMap:
    """rank -> server: what the records say, else ``fallback(rank)``; None when unknown."""

    def __init__(self, t: RecordTable, fallback: Callable[[int], int] | None, world: int = 0) -> None:
        top = max(max(t.expected_ranks, default=0) + 1, world)
        self.arr = np.full(top, -1, dtype=np.int64)
        if fallback is not None:
            self.arr[:] = [fallback(r) for r in range(top)]
        known = t.node >= 0
        self.arr[t.rank[known]] = t.node[known]

    def __call__(self, rank: int) -> int | None:
        n = int(self.arr[rank]) if 0 <= rank < self.arr.size else -1
        return None if n < 0 else n


def diagnose_table(t: RecordTable, node_fallback: Callable[[int], int] | None = None,
                   layout: "Layout | None" = None) -> Diagnosis:
    """``layout`` (the job's parallel degrees, layout.py): every rank of the job is expected, and each
    group is named with its kind."""
    from dataclasses import replace

    node_of = NodeMap(t, node_fallback, layout.world if layout is not None else 0)
    expected = layout.world if layout is not None else len(t.expected_ranks)
    if layout is not None:
        t = labelled(t, layout)
        missing = missing_in(t, layout)
    else:
        missing = t.missing_ranks
    base: dict = {}
    notes: list[str] = []
    if missing:
        base["missing_ranks"] = list(missing)
        notes.append(f"{len(missing)} of {expected} ranks have no records "
                     f"({', '.join(map(str, missing[:12]))}{' ...' if len(missing) > 12 else ''}); "
                     "diagnosed from the ranks present")
    hang = find_hang(t, node_of, base)
    if hang is not None:
        return replace(hang, missing_ranks=missing, notes=tuple(notes) + hang.notes)
    if (t.state == State.UNKNOWN).all():
        notes.append("the records do not track whether each op finished (torch's Gloo group): hangs cannot "
                     "be told apart from a job still running, and slowdowns are judged from arrival times")
    done = (t.state == State.COMPLETED) | (t.state == State.UNKNOWN)
    t_done = _subset(t, done) if not done.all() else t
    arrive = np.where(np.isfinite(t_done.start_s), t_done.start_s, t_done.enqueue_s)
    inst = hash_cols(t_done.group, t_done.seq, t_done.p2p.astype(np.int64))
    comp, comp_ev = compute_stragglers(t_done, arrive, inst, node_of)
    comm, comm_ev = comm_slow(t_done, arrive, inst, node_of)
    evidence = {**base, **comp_ev, **comm_ev}
    present = len(t.ranks_present)
    if not comp and not comm:
        return Diagnosis(Syndrome.HEALTHY, (), evidence, present, missing, len(t), tuple(notes))
    comp_top = comp[0].confidence * len(_same_node(comp)) if comp else 0.0
    comm_top = max(s.confidence for s in comm) if comm else 0.0
    if comm and comm_top >= comp_top:
        return Diagnosis(Syndrome.COMMUNICATION_SLOW, tuple(comm + comp), evidence, present, missing, len(t),
                         tuple(notes))
    return Diagnosis(Syndrome.NON_COMMUNICATION_SLOW, tuple(comp + comm), evidence, present, missing, len(t),
                     tuple(notes))


def _same_node(suspects) -> list:
    node = suspects[0].node
    return [s for s in suspects if node is not None and s.node == node] or suspects[:1]


def _subset(t: RecordTable, keep: np.ndarray) -> RecordTable:
    from dataclasses import replace

    idx = np.flatnonzero(keep)
    remap = np.full(len(t), -1, dtype=np.int64)
    remap[idx] = np.arange(idx.size)
    csel = keep[t.conn_row] if t.conn_row.size else np.zeros(0, bool)
    return replace(t, rank=t.rank[idx], node=t.node[idx], group=t.group[idx], seq=t.seq[idx], p2p=t.p2p[idx],
                   op=t.op[idx], nbytes=t.nbytes[idx], enqueue_s=t.enqueue_s[idx], start_s=t.start_s[idx],
                   end_s=t.end_s[idx], state=t.state[idx], conn_row=remap[t.conn_row[csel]],
                   conn_peer=t.conn_peer[csel], conn_dir=t.conn_dir[csel], conn_busy_s=t.conn_busy_s[csel],
                   conn_done=t.conn_done[csel])


def diagnose_paths(paths: Iterable[str], gpus_per_node: int | None = None,
                   degrees: tuple[int | None, int | None, int | None, int | None] = (None, None, None, None)
                   ) -> Diagnosis:
    """``degrees``: (tp, cp, pp, dp) of the job where the user gives them (layout.make_layout)."""
    fallback = cluster_node_of(gpus_per_node) if gpus_per_node else None
    table = load_records(paths, gpus_per_node)
    return diagnose_table(table, fallback, make_layout(*degrees, table))
