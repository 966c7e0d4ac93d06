"""MSCCL-IR: parsing, validation errors, what the examples compute, and the time prediction."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from echo_plan.errors import FileFormatError
from echo_plan.interop.msccl import MscclAlgorithm, StepType, load_msccl, parse_msccl
from echo_plan.interop.msccl_predict import predict
from echo_plan.specs import load_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

DATA = Path(__file__).resolve().parents[2] / "echo_plan" / "data" / "msccl"
EXAMPLES = sorted(DATA.glob("*.xml"))


def run_data(algo: MscclAlgorithm) -> dict[tuple[int, str, int], Counter]:
    """Execute the algorithm on symbolic data: each chunk is a multiset of (gpu, chunk) inputs.

    Independent of the timing replay: repeatedly runs any step whose thread-block predecessor,
    dependencies and incoming message are ready.
    """
    bufs: dict[tuple[int, str, int], Counter] = {}
    for g in algo.gpus:
        for c in range(algo.nchunksperloop):
            bufs[(g.id, "i", c)] = Counter({(g.id, c): 1})
    queues: dict[tuple[int, int, int], list] = {}
    pos = {(g.id, tb.id): 0 for g in algo.gpus for tb in g.tbs}
    done: set = set()
    progress = True
    while progress:
        progress = False
        for g in algo.gpus:
            for tb in g.tbs:
                key = (g.id, tb.id)
                while pos[key] < len(tb.steps):
                    st = tb.steps[pos[key]]
                    if any((g.id, t, s) not in done for t, s in st.deps):
                        break
                    q = queues.setdefault((tb.recv, g.id, tb.chan), [])
                    if st.type.receives and not q:
                        break
                    src = [bufs.get((g.id, st.srcbuf.value, st.srcoff + k), Counter()) for k in range(st.cnt)]
                    got = q.pop(0) if st.type.receives else None
                    reduce = st.type in (StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_SEND,
                                         StepType.RECV_REDUCE_COPY_SEND, StepType.REDUCE)
                    if st.type is StepType.REDUCE:
                        got = [bufs.get((g.id, st.dstbuf.value, st.dstoff + k), Counter()) for k in range(st.cnt)]
                    if got is not None:
                        val = [a + b for a, b in zip(got, src)] if reduce else got
                    else:
                        val = src
                    if st.type in (StepType.RECV, StepType.RECV_REDUCE_COPY, StepType.RECV_COPY_SEND,
                                   StepType.RECV_REDUCE_COPY_SEND, StepType.COPY, StepType.REDUCE):
                        for k in range(st.cnt):
                            bufs[(g.id, st.dstbuf.value, st.dstoff + k)] = Counter(val[k])
                    if st.type.sends:
                        queues.setdefault((g.id, tb.send, tb.chan), []).append([Counter(v) for v in val])
                    done.add((g.id, tb.id, st.index))
                    pos[key] += 1
                    progress = True
    assert all(pos[(g.id, tb.id)] == len(tb.steps) for g in algo.gpus for tb in g.tbs), "deadlock"
    return bufs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_parse_and_compute_an_all_reduce(path):
    algo = load_msccl(path)
    assert algo.kind is CollectiveKind.ALL_REDUCE and algo.proto == "Simple"
    bufs = run_data(algo)
    want_each = {c: Counter({(g, c): 1 for g in range(algo.ngpus)}) for c in range(algo.nchunksperloop)}
    for g in range(algo.ngpus):
        for c in range(algo.nchunksperloop):
            assert bufs[(g, "i", c)] == want_each[c], (g, c)


def test_ring_structure():
    algo = load_msccl(DATA / "ring_allreduce_8.xml")
    assert algo.ngpus == 8 and algo.nchunksperloop == 8
    for g in algo.gpus:
        (tb,) = g.tbs
        assert (tb.send, tb.recv) == ((g.id + 1) % 8, (g.id - 1) % 8)
        assert sum(s.type.sends for s in tb.steps) == 14 and sum(s.type.receives for s in tb.steps) == 14


def _nccl_ring_time(nbytes, cluster, n):
    """NCCL's ring all-reduce with the Simple protocol, from the collective model."""
    from echo_plan.cost.base import Algorithm, Protocol_
    from echo_plan.cost.collectives import collective_model_for

    cands = collective_model_for(cluster).candidates(CollectiveKind.ALL_REDUCE, nbytes,
                                                     CommGroup(GroupKind.WORLD, n), cluster)
    (ring,) = [c for c in cands if c.algorithm is Algorithm.RING and c.protocol is Protocol_.SIMPLE]
    return ring.time_s


@pytest.mark.parametrize("cluster_name", ["dgx-a100", "dgx-h100"])
def test_ring_prediction_close_to_nccl_ring_for_large_sizes(cluster_name):
    cluster = load_cluster(cluster_name, nodes=1)
    algo = load_msccl(DATA / "ring_allreduce_8.xml")
    nbytes = 1 << 30
    ours = predict(algo, nbytes, cluster).time_s
    nccl = _nccl_ring_time(nbytes, cluster, 8)
    assert ours == pytest.approx(nccl, rel=0.02)


def test_ring_prediction_is_bandwidth_optimal():
    cluster = load_cluster("dgx-a100", nodes=1)
    algo = load_msccl(DATA / "ring_allreduce_8.xml")
    big = predict(algo, 1 << 32, cluster)
    # a ring all-reduce moves 2(n-1)/n of the buffer through each GPU's link: busbw -> the link bandwidth
    # the model uses (the preset's calibrated NVLink figure)
    from echo_plan.interop.msccl_predict import LinkParams

    assert big.busbw_GBps == pytest.approx(LinkParams.from_cluster(cluster, "Simple").nvlink_GBps, rel=0.01)
    assert big.messages == 8 * 14 and big.network_bytes == 0
    assert big.nvlink_bytes == pytest.approx(8 * 14 * (1 << 32) / 8)


def test_prediction_properties():
    cluster = load_cluster("dgx-a100", nodes=2)
    hier = load_msccl(DATA / "hierarchical_allreduce_2x8.xml")
    sizes = [1 << k for k in range(10, 32, 3)]
    times = [predict(hier, s, cluster).time_s for s in sizes]
    assert times == sorted(times)  # more bytes never take less time
    assert times[0] < 1e-3  # small sizes are latency-bound (tens of microseconds)
    p = predict(hier, 1 << 30, cluster)
    # each GPU exchanges size/16 each way with its peer twice: 2 x size/8 cross the network per pair
    assert p.network_bytes == pytest.approx(16 * 2 * (1 << 30) / 16)
    # a slower network makes it slower; a faster one never slower
    slow = cluster.replace(network=cluster.network.replace(nic_bw_Gbps=100.0))
    assert predict(hier, 1 << 30, slow).time_s > p.time_s


def test_group_placement_decides_links():
    cluster = load_cluster("dgx-a100", nodes=2)
    ring = load_msccl(DATA / "ring_allreduce_8.xml")
    inside = predict(ring, 1 << 28, cluster, CommGroup(GroupKind.DP, 8, 1, 0))
    across = predict(ring, 1 << 28, cluster, CommGroup(GroupKind.DP, 8, 2, 0))  # ranks 0,2,..,14: two servers
    assert inside.network_bytes == 0 and across.network_bytes > 0
    assert across.time_s > inside.time_s


def _algo(body: str, ngpus: int = 2, extra: str = "") -> str:
    return f'<algo name="t" proto="Simple" nchunksperloop="2" ngpus="{ngpus}" coll="allreduce" {extra}>\n{body}\n</algo>'


PAIR = """<gpu id="0" i_chunks="2" o_chunks="0" s_chunks="0">
  <tb id="0" send="1" recv="1" chan="0">
    <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    <step s="1" type="rrc" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
  </tb>
</gpu>
<gpu id="1" i_chunks="2" o_chunks="0" s_chunks="0">
  <tb id="0" send="0" recv="0" chan="0">
    <step s="0" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
  </tb>
</gpu>"""


def test_minimal_algorithm_parses_and_predicts():
    algo = parse_msccl(_algo(PAIR))
    p = predict(algo, 1 << 20, load_cluster("dgx-a100", nodes=1))
    assert p.messages == 2 and p.time_s > 0


@pytest.mark.parametrize("mutate, message, line", [
    (lambda t: t.replace("</tb>\n</gpu>\n<gpu", "</tb>\n<gpu", 1), "malformed XML: mismatched tag", 13),
    (lambda t: t.replace('type="rrc"', 'type="bogus"', 1), "type='bogus' is not one of", 5),
    (lambda t: t.replace('depid="-1" deps="-1" hasdep="0"/>', 'depid="3" deps="0" hasdep="0"/>', 1),
     "dangling dependency", 4),
    (lambda t: t.replace('depid="-1" deps="-1" hasdep="0"/>\n    <step s="1" type="rrc" srcbuf="i" srcoff="1"',
                         'depid="0" deps="1" hasdep="0"/>\n    <step s="1" type="rrc" srcbuf="i" srcoff="1"', 1),
     "later step of its own", 4),
    (lambda t: t.replace('cnt="1"', 'cnt="x"', 1), "cnt='x' is not an integer", 4),
    (lambda t: t.replace('<step s="1" type="rrc" srcbuf="i" srcoff="0"', '<step s="1" type="r" srcbuf="i" srcoff="0" ', 1)
     .replace('recv="0" chan="0"', 'recv="-1" chan="0"', 1), "receives but the tb has recv=-1", 11),
    (lambda t: t.replace('send="0" recv="0"', 'send="5" recv="0"', 1), "a peer must be another GPU", 9),
    (lambda t: t.replace('<step s="1" type="rrc" srcbuf="i" srcoff="0"', '<step s="2" type="rrc" srcbuf="i" srcoff="0"', 1),
     "s=2 found where s=1", 11),
    (lambda t: t.replace('<gpu id="1"', '<gpu id="2"', 1), r"outside \[0, ngpus=2\)", 8),
    (lambda t: t.replace('ngpus="2"', 'ngpus="3"', 1), r"ids must be 0..2 once each \(repeated \[\], missing \[2\]\)", 1),
])
def test_malformed_algorithms_name_the_line(mutate, message, line):
    text = _algo(PAIR)
    bad = mutate(text)
    assert bad != text
    with pytest.raises(FileFormatError, match=message) as err:
        parse_msccl(bad, "bad.xml")
    assert err.value.line == line and str(err.value).startswith(f"bad.xml, line {line}: ")


def test_unmatched_messages_and_missing_hasdep_and_deadlock():
    one_sided = PAIR.replace('<step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" '
                             'depid="-1" deps="-1" hasdep="0"/>', "")
    with pytest.raises(FileFormatError, match="sends 1 message"):
        parse_msccl(_algo(one_sided))
    two_tbs = """<gpu id="0"><tb id="0" send="1" recv="-1" chan="0">
      <step s="0" type="s" srcoff="0" cnt="1" depid="1" deps="0" hasdep="0"/></tb>
      <tb id="1" send="-1" recv="1" chan="0"><step s="0" type="r" srcoff="0" cnt="1" hasdep="{h}"/></tb></gpu>
      <gpu id="1"><tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="r" srcoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="s" srcoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/></tb></gpu>"""
    with pytest.raises(FileFormatError, match="hasdep=0"):
        parse_msccl(_algo(two_tbs.format(h=0)))
    # gpu 0 sends only after receiving, gpu 1 likewise: a valid file that can never finish
    algo = parse_msccl(_algo(two_tbs.format(h=1)))
    with pytest.raises(FileFormatError, match="deadlock"):
        predict(algo, 1 << 20, load_cluster("dgx-a100", nodes=1))


def test_load_errors(tmp_path):
    with pytest.raises(FileFormatError, match="no such file"):
        load_msccl(tmp_path / "none.xml")
    (tmp_path / "x.xml").write_text("<notalgo/>")
    with pytest.raises(FileFormatError, match="expected <algo>"):
        load_msccl(tmp_path / "x.xml")
    (tmp_path / "y.xml").write_text(_algo(PAIR).replace('coll="allreduce"', 'coll="scan"'))
    with pytest.raises(FileFormatError, match="coll='scan'"):
        load_msccl(tmp_path / "y.xml")
