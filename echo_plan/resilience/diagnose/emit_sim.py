"""Every rank of a simulated job, step after step, as the records its collective library would write.

Each rank runs its stage's program (program.py) on its own clock. A collective ends when its last
member has arrived plus its transfer time (synchronous: everyone waits for the slowest); a
receive ends when its send was posted plus the transfer time; a send does not block its sender
(NCCL's and torch's point-to-point calls are asynchronous). Per-connection records follow the
ring order of each group: a rank sends to the next member and receives from the previous one;
a connection's busy time is the collective's healthy time over that connection's rate (its
slower end's NIC between servers, the server's NVLink inside one).

Hangs: a hung GPU stops in the middle of the last step; the collective it would issue next is
written 'scheduled' (the CPU posted it, the GPU never reached it), and everyone who then waits for
it is written 'started'. A hung NIC dies at a random moment of the last step (seeded) and never
finishes a collective or transfer that crosses servers through it from then on; its connections
moved nothing, the others part of their data.

Timing noise: every compute segment, transfer and connection time is multiplied by
1 + noise x N(0, 1) (kept above 0.2), from a generator seeded by ``seed``: same seed, same records.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from echo_plan.resilience.diagnose.program import COLL, COMP, SEND, OpTimer, RankFaults
from echo_plan.trace.records import CollectiveKind, GroupKind

T0_S = 1000.0  # the records' clock starts here (seconds)


class _Noise:
    def __init__(self, scale: float, seed: int) -> None:
        self.scale, self.rng = scale, np.random.default_rng(seed)
        self.buf, self.i = np.empty(0), 0

    def __call__(self) -> float:
        if self.scale == 0:
            return 1.0
        if self.i >= self.buf.size:
            self.buf, self.i = self.rng.standard_normal(65536), 0
        self.i += 1
        return max(0.2, 1.0 + self.scale * float(self.buf[self.i - 1]))

    def uniform(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))


def run_job(programs, plan, cluster, comm, faults: RankFaults, steps: int, noise: float, seed: int) -> list[list[list]]:
    """Per rank, its records in issue order: [group, group_ranks, seq, op, nbytes, enqueue_s, start_s,
    end_s, state, conns, p2p, op index] with conns a list of (peer, 'send'|'recv', busy_s, done)."""
    from echo_plan.interop.chakra_export import RankCoords, coords, group_of, rank_of  # deferred: loads google.protobuf

    world, gpn = plan.world_size, cluster.gpus_per_node
    timer = OpTimer(cluster, comm, gpn)
    rnd = _Noise(noise, seed)
    node = [r // gpn for r in range(world)]
    co = [coords(r, plan) for r in range(world)]
    stage_len = [len(p) for p in programs]
    gcache: dict[tuple, tuple[str, tuple[int, ...]]] = {}
    hang_at = {r: (steps - 1) * stage_len[co[r].stage] + stage_len[co[r].stage] // 2 for r in faults.gpu_hang}
    # a NIC dies at a random moment of the last step (by ops issued, seeded like the noise)
    dies_at = {r: (steps - 1) * stage_len[co[r].stage] + int(rnd.uniform(0.0, 1.0) * stage_len[co[r].stage])
               for r in sorted(faults.nic_hang)}

    pc = [0] * world
    clock = [T0_S] * world
    seqs: list[dict] = [dict() for _ in range(world)]
    recs: list[list[list]] = [[] for _ in range(world)]
    pending: dict[tuple, dict[int, int]] = {}  # instance -> rank -> its record index
    posted: dict[tuple, tuple[int, int, float]] = {}  # p2p instance -> (sender, record index, post time)
    waiting_recv: dict[tuple, tuple[int, int]] = {}
    stopped: set[int] = set()
    open_recv: list[int | None] = [None] * world

    def group(r: int, ref) -> tuple[str, tuple[int, ...]]:
        k = (r, ref)
        g = gcache.get(k)
        if g is None:
            g = gcache[k] = group_of(ref, co[r], plan)
        return g

    def cell_factor(a: int, b: int) -> float:
        if node[a] == node[b]:
            return float(faults.nvlink[node[a]])
        return float(min(faults.net[a], faults.net[b]))

    def dead(ranks, at: dict[int, int]) -> bool:  # crosses servers through a NIC that has died
        return bool(dies_at) and any(r in dies_at and at[r] >= dies_at[r] for r in ranks) and \
            len({node[r] for r in ranks}) > 1

    def next_seq(r: int, name: str) -> int:
        s = seqs[r].get(name, 0) + 1
        seqs[r][name] = s
        return s

    def resolve_coll(key, members, kind, gk, nbytes) -> None:
        idx = pending.pop(key)
        arrive = max(recs[m][idx[m]][6] for m in members)
        net = min(float(faults.net[m]) for m in members)
        nvl = min(float(faults.nvlink[node[m]]) for m in members)
        healthy = timer.time(kind, nbytes, members, gk)
        t = timer.time(kind, nbytes, members, gk, net, nvl) * rnd()
        pairs = connections(members, node)
        busy = {p: healthy / cell_factor(*p) * rnd() for p in pairs}
        for m in members:
            rec = recs[m][idx[m]]
            end = arrive + t + abs(rnd() - 1.0) * t * 0.05
            rec[7], rec[8] = end, "completed"
            rec[9] = [(b, "send", busy[(a, b)], 1.0) for a, b in pairs if a == m] + \
                [(a, "recv", busy[(a, b)], 1.0) for a, b in pairs if b == m]
            clock[m] = end

    ready = deque(range(world))
    in_ready = [True] * world
    while ready:
        r = ready.popleft()
        in_ready[r] = False
        prog = programs[co[r].stage]
        total = len(prog) * steps
        while pc[r] < total and r not in stopped:
            op = prog[pc[r] % len(prog)]
            if r in hang_at and pc[r] >= hang_at[r] and op[0] != COMP:
                stopped.add(r)  # the GPU stopped: its next op is posted, never started
                name, members, seq, opname, nb = _describe(r, op, group, co, plan, rank_of, RankCoords, next_seq)
                recs[r].append([name, members, seq, opname, nb, clock[r], None, None, "scheduled", None, op[0] != COLL,
                                pc[r]])
                break
            if op[0] == COMP:
                clock[r] += op[1] * float(faults.compute[r]) * rnd()
                pc[r] += 1
                continue
            if open_recv[r] is not None:  # a receive posted earlier, waiting for its send
                rec = recs[r][open_recv[r]]
                name, members, seq, nb = rec[0], rec[1], rec[2], rec[4]
                open_recv[r] = None
            else:
                name, members, seq, opname, nb = _describe(r, op, group, co, plan, rank_of, RankCoords, next_seq)
                rec = [name, members, seq, opname, nb, clock[r] - 2e-6, clock[r], None, "started", None,
                       op[0] != COLL, pc[r]]
                recs[r].append(rec)
            key = (name, seq)
            if op[0] == COLL:
                pending.setdefault(key, {})[r] = len(recs[r]) - 1
                pc[r] += 1
                if len(pending[key]) == len(members):
                    if dead(members, {m: recs[m][i][11] for m, i in pending[key].items()}):
                        stopped.update(members)
                        _stall(recs, pending.pop(key), members, faults.nic_hang, rnd, node)
                        break
                    resolve_coll(key, members, op[1], _gkind(op[2]), nb)
                    for m in members:
                        if m != r and not in_ready[m] and m not in stopped:
                            ready.append(m)
                            in_ready[m] = True
                    continue
                break  # wait for the others
            src, dst = members if op[0] == SEND else members[::-1]
            kind = GroupKind.PP
            if op[0] == SEND:
                pc[r] += 1
                posted[key] = (r, len(recs[r]) - 1, clock[r])
                if key in waiting_recv:
                    q = waiting_recv.pop(key)
                    if not in_ready[q[0]]:
                        ready.append(q[0])
                        in_ready[q[0]] = True
                continue
            # RECV: wait for the matching send
            if key not in posted:
                open_recv[r] = len(recs[r]) - 1 if recs[r][-1] is rec else recs[r].index(rec)
                waiting_recv[key] = (r, 0)
                break
            sender, sidx, t_post = posted.pop(key)
            if dead((sender, r), {sender: recs[sender][sidx][11], r: rec[11]}):  # the receiver waits; the sender went on
                stopped.add(r)
                _stall(recs, {sender: sidx, r: len(recs[r]) - 1}, (sender, r), faults.nic_hang, rnd, node)
                break
            f = cell_factor(sender, r)
            healthy = timer.time(CollectiveKind.SEND_RECV, nb, (sender, r), kind)
            t = timer.time(CollectiveKind.SEND_RECV, nb, (sender, r), kind,
                           float(min(faults.net[sender], faults.net[r])), float(faults.nvlink[node[r]])) * rnd()
            end = max(t_post, rec[6]) + t
            busy = healthy / f * rnd()
            srec = recs[sender][sidx]
            srec[7], srec[8], srec[9] = end, "completed", [(r, "send", busy, 1.0)]
            rec[7], rec[8], rec[9] = end, "completed", [(sender, "recv", busy, 1.0)]
            clock[r] = end
            pc[r] += 1
    if not faults.gpu_hang and not faults.nic_hang:
        stuck = [r for r in range(world) if pc[r] < len(programs[co[r].stage]) * steps]
        if stuck:  # cannot happen for the schedules echo-plan builds; say so rather than write bad records
            raise RuntimeError(f"simulated job stalled without a hang fault at ranks {stuck[:8]}")
    return recs


def _describe(r, op, group, co, plan, rank_of, RankCoords, next_seq):
    if op[0] == COLL:
        name, members = group(r, op[2])
        return name, members, next_seq(r, name), op[1].value, op[3]
    c = co[r]
    peer = rank_of(RankCoords(op[1], c.d, c.t), plan)
    src, dst = (r, peer) if op[0] == SEND else (peer, r)
    name = f"pp_{src}_to_{dst}"
    return name, (src, dst), next_seq(r, name), "send" if op[0] == SEND else "recv", op[2]


def _gkind(ref) -> GroupKind:
    return {"tp": GroupKind.TP, "dp": GroupKind.DP, "ep": GroupKind.EP, "etp": GroupKind.ETP,
            "edp": GroupKind.EDP}.get(ref.value, GroupKind.WORLD)


_PAIRS: dict[tuple, tuple] = {}


def connections(members: tuple[int, ...], node: list[int]) -> tuple[tuple[int, int], ...]:
    """The (sender, receiver) connections of a collective over ``members``: its ring in member
    order, and where the group has several GPUs on each of several servers, one channel per
    position inside the server that leaves each server through that GPU's own NIC (NCCL opens
    several channels, each crossing servers on a different rail, so every member's NIC carries
    some of the traffic)."""
    got = _PAIRS.get(members)
    if got is not None:
        return got
    n = len(members)
    pairs = [(members[i], members[(i + 1) % n]) for i in range(n)] if n > 2 else \
        ([(members[0], members[1]), (members[1], members[0])] if n == 2 else [])
    by_node: dict[int, list[int]] = {}
    for m in members:
        by_node.setdefault(node[m], []).append(m)
    nodes = sorted(by_node)
    if len(nodes) > 1 and max(len(v) for v in by_node.values()) > 1:
        have = set(pairs)
        for j, nd in enumerate(nodes):
            nxt = by_node[nodes[(j + 1) % len(nodes)]]
            for li, m in enumerate(by_node[nd]):
                if li < len(nxt) and (m, nxt[li]) not in have and m != nxt[li]:
                    pairs.append((m, nxt[li]))
                    have.add((m, nxt[li]))
    got = _PAIRS[members] = tuple(pairs)
    return got


def _stall(recs, idx: dict[int, int], members, dead: frozenset[int], rnd: _Noise, node: list[int]) -> None:
    """A transfer through a hung NIC: everyone entered, nobody finishes; the dead NIC's connections
    (those that leave its server) moved nothing, the others part of their data before they ran dry."""
    pairs = connections(tuple(members), node) if len(members) > 2 or recs[members[0]][idx[members[0]]][3] not in \
        ("send", "recv") else ((members[0], members[1]),)
    done = {p: 0.0 if (p[0] in dead or p[1] in dead) and node[p[0]] != node[p[1]] else rnd.uniform(0.3, 0.9)
            for p in pairs}
    for m in members:
        rec = recs[m][idx[m]]
        rec[9] = [(b, "send", 0.0, done[(a, b)]) for a, b in pairs if a == m] + \
            [(a, "recv", 0.0, done[(a, b)]) for a, b in pairs if b == m]
