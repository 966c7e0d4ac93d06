"""Clusters of today (issue 35): the NVLink domain apart from the server, and the Blackwell presets."""

from __future__ import annotations

import pytest

from echo_plan.cost.collectives import collective_model_for
from echo_plan.errors import EchoPlanError, SpecError
from echo_plan.specs import PlanSpec, load_cluster, load_model
from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

BLACKWELL = ("b200", "b300", "gb200-nvl72", "gb300-nvl72")
# recipe fp8-blackwell fits the B200 die's FP8, MXFP8 and NVFP4 rates on named GB200 runs; fp8-blackwell-ultra
# the Blackwell Ultra die's (B300, GB300) on named GB300 runs
FITTED_ON = {"b200": "megatron_bridge_gb200", "gb200-nvl72": "megatron_bridge_gb200",
             "b300": "megatron_bridge_gb300", "gb300-nvl72": "megatron_bridge_gb300"}


@pytest.mark.parametrize("name, hbm, per_server, domain", [
    ("b200", 179, 8, 8), ("b300", 268, 8, 8), ("gb200-nvl72", 185, 4, 72), ("gb300-nvl72", 277, 4, 72)])
def test_presets_have_their_memory_servers_and_domains(name, hbm, per_server, domain):
    c = load_cluster(name)
    assert c.gpu.hbm_GiB == hbm and c.gpus_per_node == per_server and c.domain_gpus == domain
    assert c.sources and "hardware.md" in c.sources[0]
    # the H100's compute figures as a prior across generations, not its ranges (errors of H100 runs); each die's
    # low-precision GEMM rates fitted on two named runs per precision, its ranges from its runs predicted without
    # their suite
    assert "another GPU generation" in c.calibration["from"]
    compute, suite = c.calibration["compute"], FITTED_ON[name]
    rows = compute["fitted_on"][suite]
    assert list(compute["fitted_on"]) == [suite] and len(rows) == 6
    assert {r.split()[1] for r in rows} == {"fp8", "mxfp8", "nvfp4"}
    for figure in ("fp8_gemm_efficiency_scale", "mxfp8_gemm_efficiency_scale", "fp4_gemm_efficiency_scale"):
        assert 0.5 < compute[figure] < 1.5
    assert suite in c.calibration["ranges"]["by_stack"]["megatron-core"]["source"]


def test_the_domain_is_whole_servers_and_one_server_by_default():
    c = load_cluster("dgx-h100")
    assert c.domain_gpus == c.gpus_per_node and c.nvlink_domain_gpus is None
    with pytest.raises(EchoPlanError, match="whole number"):
        c.replace(gpus_per_node=4, nvlink_domain_gpus=70)
    nvl = load_cluster("gb200-nvl72", gpus=256)
    assert nvl.num_nodes == 64 and nvl.num_domains == 4  # 3 full racks and part of a fourth
    assert load_cluster("gb200-nvl72", gpus=2).nvlink_domain_gpus is None  # less than a tray


def _time(cluster, group, nbytes=256 * 2**20, kind=CollectiveKind.ALL_REDUCE):
    return collective_model_for(cluster).time(kind, nbytes, group, cluster).time_s


@pytest.mark.parametrize("size, stride", [(16, 1), (32, 1), (8, 8), (72, 1), (64, 2)])
@pytest.mark.parametrize("kind", [CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL])
def test_a_larger_nvlink_domain_never_slows_a_collective(size, stride, kind):
    servers = load_cluster("gb200-nvl72", gpus=288).replace(nvlink_domain_gpus=None)  # trays of 4 on the network
    racks = load_cluster("gb200-nvl72", gpus=288)
    group = CommGroup(GroupKind.TP, size, stride)
    assert _time(racks, group, kind=kind) <= _time(servers, group, kind=kind) * (1 + 1e-12)


def test_a_domain_of_one_server_is_exactly_the_server():
    c = load_cluster("h800")
    same = c.replace(nvlink_domain_gpus=c.gpus_per_node)
    for group in (CommGroup(GroupKind.DP, 12, 8), CommGroup(GroupKind.TP, 8), CommGroup(GroupKind.DP, 96)):
        assert _time(c, group) == _time(same, group)


def test_tensor_parallel_16_stays_on_nvlink_inside_an_nvl72_rack():
    group = CommGroup(GroupKind.TP, 16)
    rack, hgx = load_cluster("gb200-nvl72"), load_cluster("b200", gpus=16)
    topo, _ = collective_model_for(rack).lines(CollectiveKind.ALL_REDUCE, group, rack)
    assert topo.nodes == 1 and topo.ppn == 16
    assert _time(rack, group) < _time(hgx, group)


def test_the_search_may_put_tp_across_trays_of_one_domain():
    from echo_plan.search.config import prune_for
    from echo_plan.search.space import default_space_path_for, load_space
    from echo_plan.search.study import SearchConfig

    model = load_model("gpt3-175b")  # 96 heads: tp 12 divides them, and 72, not 8
    for name, allowed in (("gb200-nvl72", True), ("b200", False)):
        cluster = load_cluster(name, gpus=144)
        space = load_space(default_space_path_for(model)).with_values({"tp": (12,)})
        pruned = prune_for(SearchConfig(model=model, cluster=cluster, global_batch_size=144, space=space))
        said = any("does not fit in a 8-GPU NVLink domain" in v.detail for v in pruned.verdicts)
        assert (bool(pruned.valid), said) == (allowed, not allowed), name


def test_leaf_spine_routing_is_refused_across_a_multi_server_domain():
    with pytest.raises(SpecError, match="--routing"):
        load_cluster("gb200-nvl72").with_routing("ecmp")


@pytest.mark.parametrize("name", BLACKWELL)
def test_simulate_says_the_blackwell_figures_are_a_prior(name):
    from echo_plan.simulate import simulate

    model = load_model("llama3-8b")
    cluster = load_cluster(name, gpus=8)
    result = simulate(model, cluster, PlanSpec(tp=2, dp=4, sequence_parallel=True, global_batch_size=16))
    text = " ".join(result.notes)
    assert "inherited from dgx-h100" in text and "another GPU generation" in text
    assert "no measured GEMM and attention efficiencies" in text
    # ranges from the Blackwell runs of the same die, predicted without their suite
    assert "leave-one-suite-out" in result.range_basis and FITTED_ON[name] in result.range_basis
    assert result.fits and result.step_time_range_s[0] < result.step_time_s < result.step_time_range_s[1]
