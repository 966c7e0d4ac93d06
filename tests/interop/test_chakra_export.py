"""Chakra export of a simulated step, decoded with the protobuf package, and the import round trip."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from echo_plan.cli import main
from echo_plan.errors import FileFormatError
from echo_plan.interop import chakra_io as cio
from echo_plan.interop import chakra_schema as cs
from echo_plan.interop.chakra_export import coords, export_chakra
from echo_plan.interop.chakra_import import import_chakra
from echo_plan.interop.chakra_step import RING_TAG_BASE, build_step_graph
from echo_plan.specs import ModelSpec, PlanSpec, load_cluster

MODEL = ModelSpec(name="gpt-tiny", num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1024,
                  seq_length=128)
CLUSTER = load_cluster("dgx-a100", nodes=1)
PLANS = {
    "sp-distopt": PlanSpec(tp=2, pp=2, dp=2, global_batch_size=8, sequence_parallel=True, distributed_optimizer=True),
    "pp4": PlanSpec(tp=1, pp=4, dp=2, global_batch_size=16),
    "tp-gather": PlanSpec(tp=2, pp=2, dp=2, global_batch_size=8),
    "cp2": PlanSpec(tp=2, cp=2, pp=2, dp=1, global_batch_size=4, sequence_parallel=True,
                    distributed_optimizer=True),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from echo_plan.trace.cache import TraceCache

    root = tmp_path_factory.mktemp("chakra")
    cache = TraceCache(str(root / "cache"))
    out = {}
    for name, plan in PLANS.items():
        graph = build_step_graph(MODEL, CLUSTER, plan, cache=cache)
        export_chakra(graph, root / name / "step")
        out[name] = (graph, root / name / "step")
    return out


def _raw_messages(path):
    data = path.read_bytes()
    return [payload for _, _, payload in cio.split_stream(data, str(path))]


@pytest.mark.parametrize("name", list(PLANS))
def test_files_decode_with_protobuf(exported, name):
    graph, prefix = exported[name]
    plan = graph.plan
    files = sorted(prefix.parent.glob("step.*.et"))
    assert len(files) == plan.world_size
    groups = json.loads((prefix.parent / "step.comm_groups.json").read_text())
    for path in files:
        rank = int(path.name.split(".")[1])
        head, *body = _raw_messages(path)
        meta = cs.GlobalMetadata.FromString(head)  # metadata first
        assert meta.version == "1.0.0"
        assert {a.name: cio.attr_value(a) for a in meta.attr}["rank"] == rank
        nodes = [cs.Node.FromString(b) for b in body]
        ids = [n.id for n in nodes]
        assert len(set(ids)) == len(ids)
        known = set(ids)
        for n in nodes:
            assert set(n.data_deps) <= known  # every dependency points to an existing node
            attrs = {a.name: cio.attr_value(a) for a in n.attr}
            assert n.type in (cs.COMP_NODE, cs.COMM_COLL_NODE, cs.COMM_SEND_NODE, cs.COMM_RECV_NODE)
            if n.type == cs.COMP_NODE:
                assert {"num_ops", "tensor_size"} <= set(attrs)
            elif n.type == cs.COMM_COLL_NODE:
                assert rank in groups[attrs["pg_name"]] and attrs["comm_size"] > 0
                assert attrs["comm_type"] in cs.COMM_TYPE_NAMES
            else:
                assert rank in (attrs["comm_src"], attrs["comm_dst"]) and attrs["comm_size"] > 0
        assert cio.check_graph(cio.read_et(path)) == []


@pytest.mark.parametrize("name", list(PLANS))
def test_sends_meet_receives(exported, name):
    graph, prefix = exported[name]
    sends, recvs = Counter(), Counter()
    for path in prefix.parent.glob("step.*.et"):
        for n in cio.read_et(path).nodes:
            key = (n.attrs.get("comm_src"), n.attrs.get("comm_dst"), n.attrs.get("comm_tag"), n.attrs.get("comm_size"))
            if n.type == cs.COMM_SEND_NODE:
                sends[key] += 1
            elif n.type == cs.COMM_RECV_NODE:
                recvs[key] += 1
    assert sends == recvs and sends


def test_sizes_add_up_to_the_plans_traffic(exported):
    from echo_plan.replay.transfers import _params

    graph, prefix = exported["sp-distopt"]
    plan = graph.plan
    block, emb, out = _params(MODEL, plan)
    m = plan.num_microbatches
    act = plan.micro_batch_size * MODEL.seq_length * MODEL.hidden_size * 2 // plan.tp
    per_stage_layers = MODEL.num_layers // plan.pp
    for rank in range(plan.world_size):
        c = coords(rank, plan)
        et = cio.read_et(prefix.parent / f"step.{rank}.et")
        by = Counter()
        for n in et.nodes:
            if n.type == cs.COMM_COLL_NODE:
                by[(n.attrs["pg_name"].split("_")[0], cs.COMM_TYPE_NAMES[n.attrs["comm_type"]])] += n.attrs["comm_size"]
            elif n.type in (cs.COMM_SEND_NODE, cs.COMM_RECV_NODE):
                ring = n.attrs["comm_tag"] >= RING_TAG_BASE  # userbuffers' TP ring exchange (default stack)
                by[("ring " if ring else "") + cs.NODE_TYPE_NAMES[n.type]] += n.attrs["comm_size"]
        params = per_stage_layers * block + (emb if c.stage == 0 else 0) + (out if c.stage == plan.pp - 1 else 0)
        assert by[("dp", "REDUCE_SCATTER")] == params * 4  # fp32 main grads (bf16 training)
        assert by[("dp", "ALL_GATHER")] == params * 2  # bf16 parameters
        assert by["COMM_SEND_NODE"] == m * act and by["COMM_RECV_NODE"] == m * act  # one each way per micro-batch
        assert by[("tp", "ALL_GATHER")] > 0 and by[("tp", "REDUCE_SCATTER")] > 0  # sequence-parallel layers
        assert by["ring COMM_SEND_NODE"] == by["ring COMM_RECV_NODE"] > 0  # TP overlap of the megatron-core stack


@pytest.mark.parametrize("name", ["sp-distopt", "pp4"])
def test_round_trip_reproduces_the_simulated_step(exported, name):
    graph, prefix = exported[name]
    result = import_chakra(prefix, CLUSTER)
    assert result.recorded_step_s == pytest.approx(graph.simulated_step_s)
    assert result.step_time_s == pytest.approx(graph.simulated_step_s, rel=0.01)
    assert result.notes == ()
    assert max(result.rank_time_s.values()) == pytest.approx(result.step_time_s)


def test_round_trip_with_receiver_side_gather(exported):
    """Without sequence parallelism the receiver all-gathers the activation over TP (Megatron-LM's
    scatter/gather); the level-2 replay and the Chakra graph both put that gather on the receiver."""
    graph, prefix = exported["tp-gather"]
    t = import_chakra(prefix, CLUSTER).step_time_s
    assert t == pytest.approx(graph.simulated_step_s, rel=0.01)


def test_import_subset_and_errors(exported, tmp_path):
    graph, prefix = exported["pp4"]
    # a subset of ranks still replays; receives from ranks not read are timed alone and reported
    for rank in (0, 1):
        (tmp_path / f"sub.{rank}.et").write_bytes((prefix.parent / f"step.{rank}.et").read_bytes())
    (tmp_path / "sub.comm_groups.json").write_text((prefix.parent / "step.comm_groups.json").read_text())
    sub = import_chakra(tmp_path / "sub", CLUSTER)
    assert set(sub.rank_time_s) == {0, 1} and any("sender file was not read" in n for n in sub.notes)
    # truncation is a clear error naming the file
    data = (prefix.parent / "step.0.et").read_bytes()
    (tmp_path / "cut.0.et").write_bytes(data[: len(data) // 2])
    with pytest.raises(FileFormatError, match=r"cut\.0\.et: message \d+ at byte \d+ .*truncated"):
        import_chakra(tmp_path / "cut", CLUSTER)
    # a group the JSON lacks
    (tmp_path / "g.0.et").write_bytes(data)
    (tmp_path / "g.comm_groups.json").write_text("{}")
    with pytest.raises(FileFormatError, match="names group 'dp_s0_t0'"):
        import_chakra(tmp_path / "g", CLUSTER)
    with pytest.raises(FileFormatError, match="no files nothing.<rank>.et"):
        import_chakra(tmp_path / "nothing", CLUSTER)


def test_foreign_nodes_are_reported_not_fatal(tmp_path):
    meta = cio.metadata({"schema": "1.0.2-chakra.0.0.4"}, version="0.0.4")
    comp = cs.Node(id=0, name="gemm", type=cs.COMP_NODE, duration_micros=100)
    load = cs.Node(id=1, name="load", type=cs.NODE_TYPES["MEM_LOAD_NODE"])
    load.data_deps.append(0)
    odd = cs.Node(id=2, name="future", type=77)
    odd.data_deps.append(1)
    coll = cs.Node(id=3, name="ar", type=cs.COMM_COLL_NODE)
    coll.data_deps.append(2)
    coll.attr.extend([cio.attr("comm_type", 0), cio.attr("comm_size", 1 << 20), cio.attr("pg_name", "0")])
    for rank in (0, 1):
        cio.write_et(tmp_path / f"w.{rank}.et", meta, [comp, load, odd, coll])
    result = import_chakra(tmp_path / "w", CLUSTER)
    text = " | ".join(result.notes)
    assert "0.0.4" in text and "unknown type 77" in text and "MEM_LOAD_NODE" in text and "comm_groups.json" in text
    assert result.step_time_s > 100e-6  # the compute, then an all-reduce over both ranks


def test_cli_import_and_collective(exported, tmp_path, capsys):
    _, prefix = exported["pp4"]
    assert main(["import", "chakra", str(prefix), "--cluster", "dgx-a100", "--nodes", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["rank_time_s"]) == {str(r) for r in range(8)}
    assert main(["import", "chakra", str(tmp_path / "none"), "--cluster", "dgx-a100"]) == 2
    assert "no files none.<rank>.et" in capsys.readouterr().err


def test_rank_ranges_are_checked_before_they_are_expanded():
    from echo_plan.errors import SpecError
    from echo_plan.interop.chakra_export import parse_ranks

    assert parse_ranks("0,2-3", 8) == (0, 2, 3)
    for bad in ("0-99999999999999", "5-2", "-1", "8"):
        with pytest.raises(SpecError, match="--ranks"):
            parse_ranks(bad, 8)


def test_moe_collectives_name_their_expert_groups(tmp_path):
    """The all-to-all goes to the expert-parallel communicator and expert gradients to the expert DP one."""
    moe = ModelSpec.build(dict(name="moe-tiny", num_layers=2, hidden_size=256, num_attention_heads=8, vocab_size=1024,
                               seq_length=128, activation="swiglu", norm="rmsnorm", position_embedding="rotary",
                               ffn_hidden_size=256, moe=dict(num_experts=4, top_k=2, expert_ffn_hidden_size=128)))
    plan = PlanSpec(tp=1, pp=1, dp=8, ep=4, global_batch_size=8, distributed_optimizer=True)
    graph = build_step_graph(moe, CLUSTER, plan)
    export_chakra(graph, tmp_path / "moe")
    groups = json.loads((tmp_path / "moe.comm_groups.json").read_text())
    assert groups["ep_s0_x0_t0"] == [0, 1, 2, 3] and groups["ep_s0_x1_t0"] == [4, 5, 6, 7]
    assert groups["edp_s0_e1_t0"] == [1, 5]
    refs = {n.group.value for n in graph.stages[0] if n.group is not None}
    assert {"ep", "edp", "dp"} <= refs


def test_cp_ring_peers_are_the_cp_group_neighbours(exported):
    graph, prefix = exported["cp2"]
    groups = json.loads((prefix.parent / "step.comm_groups.json").read_text())
    assert groups["cp_s0_d0_t0"] == [0, 2] and groups["dp_s0_t0"] == [0, 2]  # dp x cp gradient group
    peers = {(n.attrs["comm_src"], n.attrs["comm_dst"]) for n in cio.read_et(prefix.parent / "step.0.et").nodes
             if n.type == cs.COMM_SEND_NODE and "cp_exchange" in n.name}
    assert peers == {(0, 2)}


def test_deepspeeds_bf16_optimizer_exports_the_all_reduce_it_runs(tmp_path):
    """DeepSpeed's BF16_Optimizer all-reduces the whole fp32 gradient buffer before each rank steps its shard
    (stack megatron-deepspeed): the export names the collective the replay costs, not a reduce-scatter."""
    from echo_plan.specs import load_stack
    from echo_plan.trace.cache import TraceCache

    plan = PlanSpec(tp=2, pp=2, dp=2, global_batch_size=8, distributed_optimizer=True, recompute="full")
    graph = build_step_graph(MODEL, CLUSTER, plan, stack=load_stack("megatron-deepspeed"),
                             cache=TraceCache(str(tmp_path / "cache")))
    export_chakra(graph, tmp_path / "ds" / "step")
    kinds = Counter()
    for rank in range(plan.world_size):
        for n in cio.read_et(tmp_path / "ds" / f"step.{rank}.et").nodes:
            if n.type == cs.COMM_COLL_NODE and n.attrs["pg_name"].startswith("dp"):
                kinds[cs.COMM_TYPE_NAMES[n.attrs["comm_type"]]] += 1
    assert kinds["ALL_REDUCE"] > 0 and kinds["ALL_GATHER"] > 0 and not kinds["REDUCE_SCATTER"]
