"""The per-connection delay matrix and what its shape says (docs/diagnose.md, "Where").

A cell (src -> dst) holds how a connection behaved against the normal for its kind: its busy time
over the median of connections of the same op, size, group size and tier (a ratio, 1 = normal),
or for a hang how little of its data it moved. In a ring or tree every rank sends on some
connections and receives on others, so:

* a rank whose sends and receives are all bad (a bad row and a bad column) has a bad NIC, or,
  when all its bad cells stay inside its server and several ranks of that server look the same,
  the server's NVLink is bad;
* a rank whose row alone is bad (two cells or more) sends slowly (its NIC's transmit side); one
  whose column alone is bad receives slowly;
* a lone bad cell, whose row and column are otherwise fine, is the link between the two ranks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from echo_plan.resilience.diagnose.verdict import Component, Suspect, confidence

Cell = tuple[int, int]


def localise(cells: dict[Cell, float], bad: set[Cell], node_of: Callable[[int], int | None],
             strength: Callable[[Cell], float], what: str) -> tuple[list[Suspect], dict]:
    """Suspects from the bad cells of a delay matrix, and the matrix evidence (bad rows, columns, cells)."""
    out: dict[int, list[Cell]] = defaultdict(list)
    inn: dict[int, list[Cell]] = defaultdict(list)
    for c in cells:
        out[c[0]].append(c)
        inn[c[1]].append(c)

    def share(lst: list[Cell]) -> float:
        return sum(c in bad for c in lst) / len(lst) if lst else 0.0

    ranks = sorted({r for c in bad for r in c})
    both = [r for r in ranks if share(out[r]) >= 0.5 and share(inn[r]) >= 0.5]
    suspects: list[Suspect] = []
    intra = {c for c in bad if node_of(c[0]) is not None and node_of(c[0]) == node_of(c[1])}
    nodes = {node_of(r) for r in ranks}
    if bad and bad <= intra and len(nodes) == 1 and len(both) >= 2:
        node = nodes.pop()
        s = max(strength(c) for c in bad)
        suspects.append(Suspect(None, node, Component.NVLINK, confidence(s),
                                f"{len(both)} ranks of node {node} {what} on every NVLink connection inside it"))
        bad = set()
    # the fewest components that explain every bad cell: the rank with both a bad row and a bad
    # column touching the most bad cells first
    rest = set(bad)
    found: list[tuple[int, set[Cell]]] = []
    while True:
        cand = [r for r in both if any(r in c for c in rest)]
        if not cand:
            break
        r = max(cand, key=lambda r: (sum(r in c for c in rest), share(out[r]) + share(inn[r]), -r))
        mine = {c for c in rest if r in c}
        found.append((r, mine))
        rest -= mine
    for r, mine in found:
        s = max(strength(c) for c in mine)
        comp = Component.NVLINK if mine <= intra else Component.NIC
        suspects.append(Suspect(r, node_of(r), comp, confidence(s, len(found)),
                                f"row and column of rank {r} {what} ({len(mine)} connections)"))
    explained = bad - rest
    for r in sorted({c[0] for c in rest}):
        if len(out[r]) >= 2 and share(out[r]) == 1.0:
            mine = set(out[r])
            suspects.append(Suspect(r, node_of(r), Component.NIC, confidence(max(map(strength, mine))),
                                    f"row of rank {r} {what}: it sends slowly on all {len(mine)} connections"))
            explained |= mine
    for r in sorted({c[1] for c in rest - explained}):
        if len(inn[r]) >= 2 and share(inn[r]) == 1.0:
            mine = set(inn[r])
            suspects.append(Suspect(r, node_of(r), Component.NIC, confidence(max(map(strength, mine))),
                                    f"column of rank {r} {what}: it receives slowly on all {len(mine)} connections"))
            explained |= mine
    lone = sorted(rest - explained)
    for c in lone:
        conf = confidence(strength(c), len(lone))
        suspects.append(Suspect(c[0], node_of(c[0]), Component.NVLINK if c in intra else Component.LINK, conf,
                                f"only the cell rank {c[0]} -> rank {c[1]} {what}", peer=c[1]))
        if c not in intra:  # one connection cannot tell its path from the NIC at either end
            suspects += [Suspect(r, node_of(r), Component.NIC, conf / 2,
                                 f"the NIC at one end of the one bad connection {c[0]} -> {c[1]}") for r in c]
    evidence = {
        "rows": [{"rank": r, "bad_share": round(share(out[r]), 3)} for r in ranks if share(out[r]) >= 0.5],
        "columns": [{"rank": r, "bad_share": round(share(inn[r]), 3)} for r in ranks if share(inn[r]) >= 0.5],
        "cells": [{"src": c[0], "dst": c[1], "value": round(cells[c], 3)} for c in sorted(bad)][:64],
    }
    suspects.sort(key=lambda s: -s.confidence)  # stable: a link before its ends' NICs
    return suspects, evidence


def localise_tiers(cells: dict[Cell, float], bad: set[Cell], node_of: Callable[[int], int | None],
                   strength: Callable[[Cell], float], what: str) -> tuple[list[Suspect], dict]:
    """``localise`` inside servers (NVLink cells) and between them (network cells) apart: a NIC
    shows on its rank's network row and column, which its NVLink connections would dilute."""
    def intra(c: Cell) -> bool:
        a = node_of(c[0])
        return a is not None and a == node_of(c[1])

    suspects: list[Suspect] = []
    evidence: dict = {"rows": [], "columns": [], "cells": []}
    for inside in (False, True):
        part = {c: v for c, v in cells.items() if intra(c) == inside}
        sub_bad = {c for c in bad if c in part}
        if not sub_bad:
            continue
        s, ev = localise(part, sub_bad, node_of, strength, what)
        suspects += s
        for k in evidence:
            evidence[k] += ev[k]
    suspects.sort(key=lambda s: -s.confidence)
    return suspects, evidence
