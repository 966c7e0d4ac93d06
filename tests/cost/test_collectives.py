"""Properties the NCCL collective model must hold, on every preset cluster and collective."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echo_plan.cost.base import Algorithm, CollectiveModel, Protocol_
from echo_plan.cost.collectives import NcclModel, collective_model_for, net_rank_GBps
from echo_plan.cost.nccl_params import load_default_params
from echo_plan.errors import SpecError
from echo_plan.specs import cluster_names, load_cluster
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

KINDS = list(CollectiveKind)
CLUSTERS = {name: load_cluster(name) for name in cluster_names()}
MODEL = NcclModel()


def _groups(cluster):
    g = cluster.gpus_per_node
    return [
        CommGroup(GroupKind.TP, min(g, 8)),  # inside one server
        CommGroup(GroupKind.DP, 4, stride=g),  # one rank per server
        CommGroup(GroupKind.WORLD, 2 * g),  # two full servers
        CommGroup(GroupKind.DP, 8, stride=2),  # several ranks per server, several servers
        CommGroup(GroupKind.PP, 2, stride=g // 2 if g > 1 else 1),
    ]


def test_is_a_collective_model():
    assert isinstance(MODEL, CollectiveModel)


def test_group_of_one_is_free():
    est = MODEL.time(CollectiveKind.ALL_REDUCE, 1 << 20, CommGroup(GroupKind.TP, 1), CLUSTERS["h800"])
    assert est.time_s == 0.0 and est.algorithm is Algorithm.LOCAL


@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("kind", KINDS)
def test_time_grows_with_size(name, kind):
    cluster = CLUSTERS[name]
    for group in _groups(cluster):
        prev = 0.0
        size = 1
        while size <= 1 << 32:
            for s in (size, size * 3 // 2 + 1):
                t = MODEL.time(kind, s, group, cluster).time_s
                assert t >= prev * (1 - 1e-12), (group, s)
                prev = t
            size *= 2


@pytest.mark.parametrize("name", sorted(CLUSTERS))
@pytest.mark.parametrize("kind", KINDS)
def test_busbw_within_hardware(name, kind):
    cluster = CLUSTERS[name]
    nvl = cluster.gpu.nvlink_uni_GBps
    for group in _groups(cluster):
        ppn, nodes = group.placement(cluster.domain_gpus)  # NVLink reaches the domain
        for size in (1 << 10, 1 << 20, 1 << 26, 1 << 32):
            est = MODEL.time(kind, size, group, cluster)
            if kind is CollectiveKind.ALL_TO_ALL:
                # inter-server peers' share limits over the rank's NIC share
                bound = nvl if nodes == 1 else net_rank_GBps(cluster) * (group.size - 1) / (group.size - ppn)
            elif kind is CollectiveKind.SEND_RECV:
                bound = nvl if group.stride < cluster.domain_gpus else net_rank_GBps(cluster)
            elif nodes == 1:
                # NVLS reduces in the switch: all-reduce moves each byte once each way
                bound = 2 * nvl if est.algorithm is Algorithm.NVLS else nvl
            else:
                bound = min(nvl, ppn * net_rank_GBps(cluster)) if ppn > 1 else net_rank_GBps(cluster)
            assert est.busbw_GBps <= bound * (1 + 1e-9), (group, size, est)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    nbytes=st.integers(1, 1 << 33),
    size=st.sampled_from([2, 4, 8, 16, 32]),
    stride=st.sampled_from([1, 2, 4, 8]),
    nvl_mult=st.floats(1.0, 4.0),
    nic_mult=st.floats(1.0, 4.0),
)
def test_more_bandwidth_never_slows(kind, nbytes, size, stride, nvl_mult, nic_mult):
    base = CLUSTERS["dgx-a100"]
    faster = base.replace(
        gpu=base.gpu.replace(nvlink_link_bw_GBps=base.gpu.nvlink_link_bw_GBps * nvl_mult),
        network=base.network.replace(nic_bw_Gbps=base.network.nic_bw_Gbps * nic_mult),
    )
    group = CommGroup(GroupKind.DP, size, stride=stride)
    t0 = MODEL.time(kind, nbytes, group, base).time_s
    t1 = MODEL.time(kind, nbytes, group, faster).time_s
    assert t1 <= t0 * (1 + 1e-12)


def test_placement_decides_tier():
    c = CLUSTERS["dgx-a100"]
    size = 1 << 30
    inside = MODEL.time(CollectiveKind.ALL_REDUCE, size, CommGroup(GroupKind.TP, 8), c)
    across = MODEL.time(CollectiveKind.ALL_REDUCE, size, CommGroup(GroupKind.DP, 8, stride=8), c)
    # one rank per server: every hop on one 200 Gb/s NIC (~23.5 GB/s), far below NVLink
    assert across.busbw_GBps < 25 < 200 < inside.busbw_GBps
    near = MODEL.time(CollectiveKind.SEND_RECV, size, CommGroup(GroupKind.PP, 2, stride=4), c)
    far = MODEL.time(CollectiveKind.SEND_RECV, size, CommGroup(GroupKind.PP, 2, stride=8), c)
    assert near.time_s * 5 < far.time_s


def test_protocol_follows_size_as_nccl_would():
    c = CLUSTERS["dgx-a100"]
    g = CommGroup(GroupKind.TP, 8)
    small = MODEL.time(CollectiveKind.ALL_REDUCE, 1024, g, c)
    large = MODEL.time(CollectiveKind.ALL_REDUCE, 1 << 30, g, c)
    assert small.protocol is Protocol_.LL and large.protocol is Protocol_.SIMPLE
    p2p = CommGroup(GroupKind.PP, 2, stride=8)
    assert MODEL.time(CollectiveKind.SEND_RECV, 4096, p2p, c).protocol is Protocol_.LL
    assert MODEL.time(CollectiveKind.SEND_RECV, 1 << 20, p2p, c).protocol is Protocol_.SIMPLE


def test_nvls_only_where_hopper_switch_reduces():
    g = CommGroup(GroupKind.TP, 8)
    h100 = MODEL.candidates(CollectiveKind.ALL_REDUCE, 1 << 30, g, CLUSTERS["dgx-h100"])
    a100 = MODEL.candidates(CollectiveKind.ALL_REDUCE, 1 << 30, g, CLUSTERS["dgx-a100"])
    assert any(c.algorithm is Algorithm.NVLS for c in h100)
    assert not any(c.algorithm is Algorithm.NVLS for c in a100)
    across = MODEL.candidates(CollectiveKind.ALL_REDUCE, 1 << 30, CommGroup(GroupKind.WORLD, 16), CLUSTERS["dgx-h100"])
    assert not any(c.algorithm is Algorithm.NVLS for c in across)


def test_candidates_include_the_choice_and_are_sorted():
    c = CLUSTERS["h800"]
    g = CommGroup(GroupKind.WORLD, 16)
    for size in (256, 1 << 20, 1 << 28):
        chosen = MODEL.time(CollectiveKind.ALL_REDUCE, size, g, c)
        cands = MODEL.candidates(CollectiveKind.ALL_REDUCE, size, g, c)
        times = [x.time_s for x in cands]
        assert times == sorted(times) and times[0] == chosen.time_s
        assert {x.algorithm for x in cands} == {Algorithm.RING, Algorithm.TREE}


def test_oversubscribed_fat_tree_is_slower_across_servers():
    c = CLUSTERS["dgx-a100"]
    fat = c.replace(network=c.network.replace(fabric="fat-tree", oversubscription=2.0))
    g = CommGroup(GroupKind.DP, 4, stride=8)
    assert MODEL.time(CollectiveKind.ALL_REDUCE, 1 << 30, g, fat).time_s > \
        1.5 * MODEL.time(CollectiveKind.ALL_REDUCE, 1 << 30, g, c).time_s


def test_calibration_changes_the_model_and_is_validated():
    c = CLUSTERS["dgx-a100"]
    slow = c.replace(calibration={"nccl": {"params": {"nvlink_bw_efficiency": 0.5}}})
    g = CommGroup(GroupKind.TP, 8)
    assert collective_model_for(slow).time(CollectiveKind.ALL_REDUCE, 1 << 30, g, slow).time_s > \
        1.8 * collective_model_for(c).time(CollectiveKind.ALL_REDUCE, 1 << 30, g, c).time_s
    with pytest.raises(SpecError, match="nvlink_bw_efficiency=-1") as err:  # rejected when the cluster is made
        c.replace(calibration={"nccl": {"params": {"nvlink_bw_efficiency": -1}}})
    assert "A100-SXM4" not in str(err.value)  # the message names the value, not the whole cluster
    with pytest.raises(SpecError, match="unknown section"):
        c.replace(calibration={"computee": {}})
    with pytest.raises(SpecError):
        load_default_params().with_calibration({"no_such_knob": 1.0})


def test_memo_is_per_cluster_object():
    model = NcclModel()
    c = CLUSTERS["dgx-a100"]
    g = CommGroup(GroupKind.DP, 4, stride=8)
    t0 = model.time(CollectiveKind.ALL_REDUCE, 1 << 28, g, c).time_s
    faster = c.replace(network=c.network.replace(nic_bw_Gbps=800))
    assert model.time(CollectiveKind.ALL_REDUCE, 1 << 28, g, faster).time_s < t0
    assert model.time(CollectiveKind.ALL_REDUCE, 1 << 28, g, c).time_s == t0
