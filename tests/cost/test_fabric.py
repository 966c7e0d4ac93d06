"""Cross-leaf flows of a collective group and the routing's effect on the NCCL model (cost/fabric.py)."""

from __future__ import annotations

import pytest

from echo_plan.cost.collectives import NcclModel
from echo_plan.cost.fabric import bin_sets, connections, group_copies, group_slowdown
from echo_plan.errors import SpecError
from echo_plan.specs import load_cluster
from echo_plan.specs.cluster import Routing
from echo_plan.trace.records import CollectiveKind as K
from echo_plan.trace.records import CommGroup, GroupKind as G

H800 = load_cluster("h800", gpus=1024)  # 128 servers: 4 leaves of 32 per rail plane
GROUPS = [
    (K.SEND_RECV, CommGroup(G.PP, 2, 128)),  # pipeline neighbours, tp8 dp16
    (K.ALL_REDUCE, CommGroup(G.PP, 2, 7 * 128)),  # tied embeddings, first and last stage
    (K.ALL_REDUCE, CommGroup(G.DP, 64, 8)),  # data parallel over 64 servers (two leaves)
    (K.REDUCE_SCATTER, CommGroup(G.DP, 128, 8)),
    (K.ALL_TO_ALL, CommGroup(G.EP, 64, 8)),
    (K.ALL_GATHER, CommGroup(G.DP, 32, 4)),  # two ranks per server
]
SIZES = [1 << 16, 1 << 22, 1 << 28]


MODEL = NcclModel()  # caches each (kind, group, cluster)'s lines, so every size reuses them


def _time(cluster, kind, group, nbytes):
    return MODEL.time(kind, nbytes, group, cluster).time_s


@pytest.mark.parametrize("kind,group", GROUPS, ids=lambda x: getattr(x, "value", None) or f"{x.size}x{x.stride}")
def test_planned_never_slower_than_ecmp(kind, group):
    for flows in (1, 4):
        planned = H800.with_routing("planned", flows)
        ecmp = H800.with_routing("ecmp", flows)
        for n in SIZES:
            assert _time(planned, kind, group, n) <= _time(ecmp, kind, group, n) * (1 + 1e-12)


@pytest.mark.parametrize("kind,group", GROUPS[:3], ids=["p2p", "tied", "dp"])
def test_more_flows_per_connection_never_slow_a_collective_under_ecmp(kind, group):
    slow = [group_slowdown(kind, group, H800.with_routing("ecmp", k)).expected for k in (1, 2, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(slow, slow[1:]))
    times = [_time(H800.with_routing("ecmp", k), kind, group, 1 << 26) for k in (1, 4, 16)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("kind,group", GROUPS, ids=lambda x: getattr(x, "value", None) or f"{x.size}x{x.stride}")
def test_a_failed_uplink_never_speeds_a_collective(kind, group):
    for routing in ("ecmp", "planned"):
        healthy = H800.with_routing(routing)
        for down in (1, 31) if kind is K.ALL_TO_ALL else (1, 8, 31):
            net = healthy.network.replace(failed_uplinks=((1, down),))
            hurt = healthy.replace(network=net.model_dump())
            for n in SIZES:
                assert _time(hurt, kind, group, n) >= _time(healthy, kind, group, n) * (1 - 1e-12)


@pytest.mark.parametrize("kind,group", GROUPS, ids=lambda x: getattr(x, "value", None) or f"{x.size}x{x.stride}")
def test_planned_routing_on_a_non_blocking_fabric_is_the_collision_free_bound(kind, group):
    assert H800.network.leaf_uplinks == H800.network.leaf_downlinks
    assert group_slowdown(kind, group, H800.with_routing("planned")).planned == 1.0
    for n in SIZES:
        assert _time(H800.with_routing("planned"), kind, group, n) == _time(H800, kind, group, n)


def test_single_leaf_groups_are_unaffected_by_routing():
    groups = [(K.ALL_REDUCE, CommGroup(G.TP, 8, 1)), (K.ALL_REDUCE, CommGroup(G.DP, 16, 8)),
              (K.ALL_TO_ALL, CommGroup(G.EP, 32, 1)), (K.ALL_GATHER, CommGroup(G.DP, 32, 8))]
    for kind, group in groups:
        assert not bin_sets(kind, group, H800.with_routing("ecmp"))
        base = [_time(H800, kind, group, n) for n in SIZES]
        for routing in ("planned", "ecmp"):
            assert [_time(H800.with_routing(routing, 3), kind, group, n) for n in SIZES] == base
    small = load_cluster("h800")  # the Echo paper's 12 servers fit under one leaf per rail
    assert small.num_leaves == 1
    for kind, group in GROUPS[:1] + [(K.ALL_REDUCE, CommGroup(G.DP, 12, 8))]:
        assert _time(small.with_routing("ecmp"), kind, group, 1 << 24) == _time(small, kind, group, 1 << 24)


def test_ecmp_collisions_slow_pipeline_transfers_that_cross_leaves():
    s = group_slowdown(K.SEND_RECV, CommGroup(G.PP, 2, 128), H800.with_routing("ecmp"))
    assert s.method == "exact" and s.flows > 0
    assert s.planned == 1.0 < s.expected <= s.p99 <= s.worst
    assert _time(H800.with_routing("ecmp"), K.SEND_RECV, CommGroup(G.PP, 2, 128), 1 << 26) > \
        _time(H800.with_routing("planned"), K.SEND_RECV, CommGroup(G.PP, 2, 128), 1 << 26)


def test_copies_tile_the_cluster():
    copies = group_copies(CommGroup(G.DP, 16, 8), 1024, pairwise=False)
    ranks = sorted(r for c in copies for r in c)
    assert ranks == list(range(1024))
    pairs = group_copies(CommGroup(G.PP, 2, 128), 1024, pairwise=True)
    assert len(pairs) == 1024 - 128


def test_rail_optimised_traffic_stays_on_its_rail():
    src, dst, rails, w = connections(K.ALL_REDUCE, CommGroup(G.DP, 64, 8), H800)
    # the copy of rank r runs on rail r % 8; its ring connects servers on that rail only
    assert set(rails.tolist()) == set(range(8)) and (w == 1).all() and (src != dst).all()
    fat = H800.replace(network=H800.network.replace(fabric="fat-tree", leaf_radix=64, uplinks_per_leaf=16)
                       .model_dump())
    assert set(connections(K.ALL_REDUCE, CommGroup(G.DP, 64, 8), fat)[2].tolist()) == {0}


def test_oversubscribed_fat_tree_planned_charges_the_leaf_only_for_cross_leaf_traffic():
    fat = H800.replace(network=H800.network.replace(fabric="fat-tree", oversubscription=3.0, leaf_radix=64,
                                                    uplinks_per_leaf=16).model_dump())
    inside = CommGroup(G.DP, 4, 8)  # four servers under one 6-server leaf
    assert fat.network.servers_per_leaf == 6
    none_t = _time(fat, K.ALL_REDUCE, inside, 1 << 28)
    planned_t = _time(fat.with_routing("planned"), K.ALL_REDUCE, inside, 1 << 28)
    assert planned_t < none_t  # routing none charges the oversubscription on every hop


def test_fabric_spec_errors_are_one_line():
    net = H800.network
    with pytest.raises(SpecError, match="uplinks_per_leaf"):
        H800.replace(network=net.replace(uplinks_per_leaf=64).model_dump())
    with pytest.raises(SpecError, match="oversubscription"):
        H800.replace(network=net.replace(oversubscription=3.0, uplinks_per_leaf=32).model_dump())
    derived = H800.replace(network=net.replace(oversubscription=3.0).model_dump()).network  # uplinks follow
    assert (derived.leaf_uplinks, derived.leaf_downlinks) == (16, 48)
    with pytest.raises(SpecError, match="leaf 9 does not exist"):
        H800.replace(network=net.replace(failed_uplinks=((9, 1),)).model_dump())
    with pytest.raises(SpecError, match="valid 1 to 31"):
        H800.replace(network=net.replace(failed_uplinks=((0, 32),)).model_dump())
    with pytest.raises(SpecError, match="--routing"):
        H800.with_routing("hashed")
    assert H800.with_routing("ECMP").network.routing is Routing.ECMP


def test_scattered_servers_put_data_parallel_rings_across_leaves():
    rr = H800.replace(network=H800.network.replace(placement="round-robin").model_dump())
    dp = CommGroup(G.DP, 16, 8)
    assert not bin_sets(K.REDUCE_SCATTER, dp, H800.with_routing("ecmp"))  # in order: one leaf
    s = group_slowdown(K.REDUCE_SCATTER, dp, rr.with_routing("ecmp"))
    assert s.planned == 1.0 < s.expected and s.method == "exact"
    assert list(rr.servers_under(1))[:3] == [1, 5, 9] and int(rr.leaf_of(9)) == 1
