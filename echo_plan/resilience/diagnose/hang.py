"""Hangs: which ranks never entered the collective the others wait in, or which connections have
posted work that never finished (docs/diagnose.md, "Hangs").

A rank *waits* when its oldest unfinished record has started: its kernel runs and cannot finish
until every member has entered. For each collective some rank waits in, a member that never
entered it (no record of it, or a record still 'scheduled') is either waiting in another
collective (follow it) or is stuck outside communication: a non-communication hang on that rank.
A waited-on collective that every member entered hangs in communication; its per-connection
records, where present, show which connections moved the least of their data.
"""

from __future__ import annotations

import numpy as np

from echo_plan.resilience.diagnose.matrix import localise_tiers
from echo_plan.resilience.diagnose.records import ConnDir, RecordTable, State
from echo_plan.resilience.diagnose.stats import hash_cols
from echo_plan.resilience.diagnose.verdict import Component, Diagnosis, Suspect, Syndrome, confidence

STUCK_MARGIN = 0.05  # a connection within 5% of the least-progressed one counts as stuck


def find_hang(t: RecordTable, node_of, base: dict) -> Diagnosis | None:
    tracked = t.state != State.UNKNOWN
    if not tracked.any():
        return None
    inc = np.flatnonzero(tracked & (t.state != State.COMPLETED))
    if inc.size == 0:
        return None
    _, first = np.unique(t.rank[inc], return_index=True)
    first_rows = inc[first]
    key = hash_cols(t.group, t.seq, t.p2p.astype(np.int64))
    waiting = {int(t.rank[i]): int(i) for i in first_rows if t.state[i] == State.STARTED}
    if not waiting:
        return None
    order = np.argsort(key, kind="stable")
    skeys = key[order]
    present = set(t.ranks_present)

    def rows_of(k: int) -> np.ndarray:
        lo, hi = np.searchsorted(skeys, k, "left"), np.searchsorted(skeys, k, "right")
        return order[lo:hi]

    stack = sorted(set(waiting.values()))
    seen: set[int] = set()
    noncomm: dict[int, int] = {}  # rank -> the row (of a waiting peer) it never entered
    comm: list[int] = []  # a row of each collective every present member entered
    comm_rows: list[int] = []  # and all their rows
    waited_by: dict[int, int] = {}
    for rank, row in waiting.items():
        waited_by[int(key[row])] = waited_by.get(int(key[row]), 0) + 1
    while stack:
        row = stack.pop()
        k = int(key[row])
        if k in seen:
            continue
        seen.add(k)
        rows = rows_of(k)
        state = {int(t.rank[i]): int(t.state[i]) for i in rows}
        members = t.group_ranks[int(t.group[row])]
        never = [m for m in members if m in present and state.get(m, State.SCHEDULED) == State.SCHEDULED]
        if not never:
            comm.append(row)
            comm_rows.extend(int(i) for i in rows)
            continue
        for m in never:
            if m in waiting and int(key[waiting[m]]) != k:
                stack.append(waiting[m])
            else:
                noncomm.setdefault(m, row)

    def describe(row: int) -> dict:
        g = int(t.group[row])
        return {"group": t.group_names[g], "seq": int(t.seq[row]), "op": t.op_names[int(t.op[row])],
                "members": len(t.group_ranks[g]), "waiting_ranks": waited_by.get(int(key[row]), 0)}

    evidence = dict(base)
    evidence["waiting_ranks"] = len(waiting)
    if noncomm:
        ranks = sorted(noncomm)
        evidence["never_entered"] = ranks
        evidence["hung_collectives"] = [describe(r) for r in sorted(set(noncomm.values()))][:16]
        # a rank many peers wait for is the likelier root when several never entered
        suspects = [Suspect(r, node_of(r), Component.GPU, confidence(3.0, len(ranks)),
                            f"never entered {t.group_names[int(t.group[noncomm[r]])]} #{int(t.seq[noncomm[r]])} "
                            f"that its peers wait in; its own records are all finished or only scheduled")
                    for r in ranks]
        return Diagnosis(Syndrome.NON_COMMUNICATION_HANG, tuple(suspects), evidence, len(present), t.missing_ranks,
                         len(t))
    evidence["hung_collectives"] = [describe(r) for r in comm][:16]
    suspects, matrix = _stuck_connections(t, comm_rows, node_of)
    if matrix:
        evidence["delay_matrix"] = matrix
    missing = sorted({m for r in comm for m in t.group_ranks[int(t.group[r])] if m not in present})
    notes = []
    if not suspects:
        members = [set(t.group_ranks[int(t.group[r])]) for r in comm]
        common = sorted(set.intersection(*members)) if members else []
        common = [r for r in common if r in present] or common
        nodes = {node_of(r) for r in common}
        comp = Component.NVLINK if len(nodes) == 1 and None not in nodes and len(common) > 1 else Component.NIC
        if comp is Component.NVLINK:
            suspects = [Suspect(None, nodes.pop(), comp, confidence(1.0), "the hung collectives stay inside this node")]
        else:
            suspects = [Suspect(r, node_of(r), comp, confidence(1.0, len(common)),
                                "a member of every hung collective (the records have no per-connection data "
                                "to tell which one)") for r in common]
        notes.append("flight-recorder dumps have no per-connection records: the hang is located to the "
                     "collective's members only")
    if missing:
        notes.append(f"ranks {_short(missing)} of the hung collectives have no records; the fault may be theirs")
    return Diagnosis(Syndrome.COMMUNICATION_HANG, tuple(suspects), evidence, len(present), t.missing_ranks,
                     len(t), tuple(notes))


def _stuck_connections(t: RecordTable, rows: list[int], node_of) -> tuple[list[Suspect], dict]:
    if not rows or t.conn_row.size == 0:
        return [], {}
    sel = np.isin(t.conn_row, np.asarray(rows))
    if not sel.any():
        return [], {}
    done: dict[tuple[int, int], float] = {}
    for r, peer, d, f in zip(t.conn_row[sel], t.conn_peer[sel], t.conn_dir[sel], t.conn_done[sel]):
        me = int(t.rank[r])
        cell = (me, int(peer)) if d == ConnDir.SEND else (int(peer), me)
        done[cell] = min(done.get(cell, 1.0), float(f))
    low = min(done.values())
    if low >= 1.0:
        return [], {}
    bad = {c for c, f in done.items() if f <= low + STUCK_MARGIN}
    suspects, evidence = localise_tiers(done, bad, node_of, lambda c: 3.0,
                                        "moved the least data (posted, never finished)")
    if suspects and suspects[0].component is Component.LINK and suspects[0].peer is not None:
        since = float(np.nanmin(t.start_s[np.asarray(rows)]))
        suspects = _one_end(t, suspects, since, node_of)
    return suspects, evidence


def _one_end(t: RecordTable, suspects: list[Suspect], since: float, node_of) -> list[Suspect]:
    """One hung connection cannot say which of its ends (or the path between) failed; an end that
    finished traffic to another server after the hang began has a working NIC, which leaves the
    other end's NIC as the likelier fault."""
    link = suspects[0]
    ends = (link.rank, link.peer)
    cleared = [r for r in ends if _network_done_after(t, r, since, node_of)]
    if len(cleared) != 1:
        return suspects
    other = ends[1] if cleared[0] == ends[0] else ends[0]
    nic = Suspect(other, node_of(other), Component.NIC, link.confidence,
                  f"the one hung connection {link.rank} -> {link.peer} ends at it, and rank {cleared[0]} at the "
                  "other end finished traffic to other servers after the hang began")
    rest = [s for s in suspects[1:] if s.rank not in ends or s.component is not Component.NIC]
    return [nic, Suspect(link.rank, link.node, link.component, link.confidence / 2, link.why, link.peer)] + rest


def _network_done_after(t: RecordTable, rank: int, since: float, node_of) -> bool:
    rows = np.flatnonzero((t.rank == rank) & (t.state == State.COMPLETED) & (t.start_s > since))
    if rows.size == 0 or t.conn_row.size == 0:
        return False
    peers = t.conn_peer[np.isin(t.conn_row, rows)]
    here = node_of(rank)
    return here is not None and any(node_of(int(p)) not in (None, here) for p in np.unique(peers))


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:12])) + (f" (+{len(ranks) - 12} more)" if len(ranks) > 12 else "")
