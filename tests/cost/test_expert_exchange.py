"""DeepEP's hierarchical expert exchange with node-limited routing (issue 32): properties, and DeepEP's
published H800 bandwidths."""

from __future__ import annotations

import itertools
import math

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from echo_plan.cost.expert_exchange import Routing, distinct_fraction, expert_exchange, load_exchange_efficiency
from echo_plan.specs import load_cluster
from echo_plan.validation.exchange import DEEPEP_FILE, predict, read_deepep
from echo_plan.validation.megatron import validation_dir


def test_distinct_fraction_is_the_exact_probability():
    """A bin of 2 items among 6, 3 draws without replacement: 1 - C(4,3)/C(6,3), counted by hand."""
    hits = sum(1 for draw in itertools.combinations(range(6), 3) if {0, 1} & set(draw))
    assert distinct_fraction(3, 6, 2) == pytest.approx(hits / math.comb(6, 3))
    assert distinct_fraction(0, 6, 2) == 0.0 and distinct_fraction(5, 6, 2) == 1.0


@settings(max_examples=60, deadline=None)
@given(servers=st.sampled_from([1, 2, 4, 8, 16]), limit=st.sampled_from([None, 1, 2, 4]),
       nic=st.floats(5.0, 100.0), more=st.floats(1.0, 4.0))
def test_more_bandwidth_never_slows_and_a_node_limit_never_adds_network_bytes(servers, limit, nic, more):
    routing = Routing(256, 8, servers, 8, limit)
    base = expert_exchange(4096, 14336, routing, 160.0, nic)
    assert expert_exchange(4096, 14336, routing, 160.0, nic * more).time_s <= base.time_s
    assert expert_exchange(4096, 14336, routing, 160.0 * more, nic).time_s <= base.time_s
    free = expert_exchange(4096, 14336, Routing(256, 8, servers, 8, None), 160.0, nic)
    assert base.network_bytes <= free.network_bytes + 1e-6
    if servers == 1:
        assert base.network_bytes == 0.0 and base.bottleneck == "nvlink"


def test_deepseek_v3_routing_crosses_the_network_at_most_four_times():
    """EP 64 over 8 servers: limited to 4 servers a token is sent 3.5 times on average over the network
    (its own server among the 4 half the time), not 8 x (1 - 7/8 ... ) as unlimited routing would."""
    limited, free = Routing(256, 8, 8, 8, 4), Routing(256, 8, 8, 8, None)
    assert limited.servers_per_token() == 4 and free.servers_per_token() > 5
    a = expert_exchange(4096, 14336, limited, 160.0, 47.0)
    assert a.network_bytes == pytest.approx(4096 * 14336 * 3.5)


def test_deepeps_published_h800_bandwidths():
    """Every normal-kernel row within 15% of DeepEP's published figure; the shares are fitted only on the
    rows the data file names (EP 8 and 64), so EP 16 and 32 are predictions."""
    eff = load_exchange_efficiency()
    h800 = load_cluster("h800")
    rows = [r for r in read_deepep(validation_dir() / DEEPEP_FILE) if r.kernel == "normal"]
    assert {r.ep for r in rows} == {8, 16, 32, 64}
    held = [r for r in rows if r.label not in eff.fitted_on]
    assert {r.ep for r in held} == {16, 32}
    for r in rows:
        got = predict(r, h800, eff).reported_GBps
        assert abs(got / r.measured_GBps - 1) <= 0.15, (r.label, got)


def test_deepeps_first_release_is_held_to_its_own_table():
    """The first release (2025-02, what DeepSeek-V3 trained with) gets its shares from its own README's rows (EP 8
    and 64), not from the later release's; its EP 16 rows are held out within 15%. Its EP 32 dispatch is the suite's
    known gap (44 GB/s, no faster than its EP 64's 46, where the model, like the later release, is): when the model
    learns it, this test fails so that the gap's note in validation/suites.py goes too."""
    from echo_plan.specs.software_kinds import DeepEPRelease
    from echo_plan.validation.exchange import DEEPEP_FILES

    feb = load_exchange_efficiency(release=DeepEPRelease.FEB_2025)
    h800 = load_cluster("h800")
    rows = [r for r in read_deepep(validation_dir() / DEEPEP_FILES[DeepEPRelease.FEB_2025]) if r.kernel == "normal"]
    assert {r.release for r in rows} == {"2025-02"} and {r.ep for r in rows} == {8, 16, 32, 64}
    assert all(label.endswith("(2025-02)") for label in feb.fitted_on)
    assert {r.ep for r in rows if r.label not in feb.fitted_on} == {16, 32}
    errors = {r.label: predict(r, h800, feb).reported_GBps / r.measured_GBps - 1 for r in rows}
    gap = "normal dispatch EP 32 (2025-02)"
    assert errors.pop(gap) > 0.15
    assert all(abs(e) <= 0.15 for e in errors.values()), errors


def test_the_later_release_never_exchanges_slower():
    """Tencent's optimisation (2025-04) sped the kernels across servers and left NVLink as it was: its shares are
    at least the first release's on both paths, so no exchange is slower with it."""
    from echo_plan.specs.software_kinds import DeepEPRelease

    feb, apr = (load_exchange_efficiency(release=r) for r in (DeepEPRelease.FEB_2025, DeepEPRelease.APR_2025))
    assert apr.network > feb.network and apr.nvlink >= feb.nvlink
    for ep in (8, 16, 32, 64):
        routing = Routing(256, 8, ep // 8, 8, min(ep // 8, 4))
        slow, fast = (expert_exchange(4096, 7392, routing, 160.0, 50.0, e.nvlink, e.network) for e in (feb, apr))
        assert fast.time_s <= slow.time_s


def test_the_shares_file_names_its_format_and_releases():
    from echo_plan.errors import FileFormatError

    with pytest.raises(FileFormatError, match="not echo-plan-expert-exchange/2"):
        load_exchange_efficiency("format: echo-plan-expert-exchange/1\ndeepep_normal: {nvlink_efficiency: 1}\n")
    with pytest.raises(FileFormatError, match="no shares for DeepEP release 2025-02 \\(it has 2025-04\\)"):
        load_exchange_efficiency("format: echo-plan-expert-exchange/2\ndeepep_normal:\n  2025-04: {nvlink_efficiency: "
                                 "1, network_efficiency: 1}\n", release="2025-02")


def test_the_shipped_shares_are_what_the_fit_gives():
    from echo_plan.calibrate.deepep_fit import DATA, fit

    shipped = yaml.safe_load(DATA.read_text())
    assert fit(validation_dir()) == shipped, "re-run python -m echo_plan.calibrate.deepep_fit --write"


def test_deepep_runs_only_the_expert_parallel_all_to_alls():
    """With the stack's DeepEP dispatcher the EP all-to-all is DeepEP's exchange (node-limited: far cheaper for
    DeepSeek-V3 over 8 servers than NCCL's all-to-all); every other collective is the base model's."""
    from echo_plan.cost.collectives import collective_model_for
    from echo_plan.cost.expert_exchange import deepep_collectives
    from echo_plan.specs import load_model
    from echo_plan.trace.records import CollectiveKind, CommGroup, GroupKind

    h800 = load_cluster("h800")
    base = collective_model_for(h800)
    deepep = deepep_collectives(base, load_model("deepseek-v3"))
    ep64 = CommGroup(GroupKind.EP, 64)
    nbytes = 4096 * 8 * 7168  # 4,096 tokens x 8 copies, FP8
    assert deepep.time(CollectiveKind.ALL_TO_ALL, nbytes, ep64, h800).time_s < \
        0.5 * base.time(CollectiveKind.ALL_TO_ALL, nbytes, ep64, h800).time_s
    tp = CommGroup(GroupKind.TP, 8)
    assert deepep.time(CollectiveKind.ALL_REDUCE, 1 << 26, tp, h800) == base.time(CollectiveKind.ALL_REDUCE, 1 << 26, tp,
                                                                                 h800)
    hash(deepep)  # keys the layer memo


def test_a_blockwise_stack_runs_the_experts_grouped_fp8_gemms_at_the_blockwise_rate():
    """The grouped GEMMs' operands cannot show their scales: the stack's recipe decides (cost/base.py)."""
    from echo_plan.cost.base import with_stack_kernels
    from echo_plan.cost.compute import AnalyticalComputeModel
    from echo_plan.specs import load_stack
    from echo_plan.specs.cluster import DType
    from echo_plan.specs.moe import ExpertLayout, LayerKind
    from echo_plan.trace.tracer import StageKind, trace_stage

    model = load_model_small()
    trace = trace_stage(model, StageKind.BLOCK, tp=1, sequence_parallel=False, micro_batch_size=1, dtype="fp8",
                        recompute="none", kind=LayerKind(moe=True), layout=ExpertLayout(8, 1, 1.0))
    grouped = [op for op in trace.ops if "grouped" in op.name]
    assert grouped
    h800 = load_cluster("h800")
    base = AnalyticalComputeModel()
    tensorwise = with_stack_kernels(base, load_stack("megatron-core", {"fp8_recipe": "current"}))
    blockwise = with_stack_kernels(base, load_stack("megatron-core", {"fp8_recipe": "blockwise"}))
    slow = sum(blockwise.op_time(op, h800.gpu, DType.FP8) for op in grouped)
    fast = sum(tensorwise.op_time(op, h800.gpu, DType.FP8) for op in grouped)
    assert slow > fast and with_stack_kernels(base, load_stack("megatron-core", {"fp8_recipe": "blockwise"})) is blockwise


def load_model_small():
    from echo_plan.specs import load_model

    return load_model("qwen3-30b-a3b").replace(num_layers=2)  # 4,096 tokens: GEMMs past the bf16 floor


def test_the_note_says_what_a_token_costs_the_network_with_and_without_the_limit():
    """DeepSeek-V3 at EP 64 over 8 servers: 3.5 remote servers a token (4 of 8, its own among them half the time),
    each sent an FP8 row of 7,168 bytes and 56 fp32 scales, and a bf16 row back."""
    import re

    from echo_plan.cost.expert_exchange import deepep_note
    from echo_plan.specs import load_model
    from echo_plan.trace.records import CommGroup, GroupKind

    note = deepep_note(load_model("deepseek-v3"), CommGroup(GroupKind.EP, 64), 8, "2025-02",
                       (7168 * (1 + 4 / 128), 7168 * 2, "FP8"))
    assert note.startswith("DeepEP exchange (2025-02 kernels)")
    assert f"FP8 dispatch {3.5 * 7392 / 1024:.1f} KiB a token, bf16 combine {3.5 * 14336 / 1024:.1f} KiB" in note
    pairs = [tuple(map(float, m)) for m in re.findall(r"\(([\d.]+) / ([\d.]+) KiB\)", note)]
    assert len(pairs) == 2 and 3.5 * 7392 / 1024 < pairs[0][0] < pairs[1][0]  # without the limit, then per expert
    assert pairs[1] == pytest.approx((7 * 7392 / 1024, 7 * 14336 / 1024), abs=0.05)
