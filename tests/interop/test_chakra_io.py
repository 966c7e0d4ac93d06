"""The Chakra .et stream format: schema, length prefixes, tolerant reading, clear errors."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from echo_plan.errors import FileFormatError
from echo_plan.interop import chakra_io as cio
from echo_plan.interop import chakra_schema as cs


def _node(nid, ntype, deps=(), **attrs):
    n = cs.Node(id=nid, name=f"n{nid}", type=ntype, duration_micros=7)
    n.data_deps.extend(deps)
    for k, v in attrs.items():
        n.attr.append(cio.attr(k, v))
    return n


def test_schema_matches_chakra_numbers():
    # Field numbers and enum values of Chakra's public et_def.proto.
    f = cs.Node.DESCRIPTOR.fields_by_name
    assert (f["id"].number, f["type"].number, f["data_deps"].number, f["duration_micros"].number, f["attr"].number) \
        == (1, 3, 5, 7, 10)
    assert cs.COMP_NODE == 4 and cs.COMM_SEND_NODE == 5 and cs.COMM_RECV_NODE == 6 and cs.COMM_COLL_NODE == 7
    assert cs.COMM_TYPES["ALL_REDUCE"] == 0 and cs.COMM_TYPES["ALL_GATHER"] == 2 and cs.COMM_TYPES["REDUCE_SCATTER"] == 7
    a = cs.AttributeProto.DESCRIPTOR.fields_by_name
    assert (a["int64_val"].number, a["uint64_val"].number, a["bool_val"].number, a["string_val"].number) == (9, 13, 27, 29)


def test_built_descriptor_equals_generated_code():
    from google.protobuf import descriptor_pb2

    try:
        from echo_plan.interop import chakra_pb2
    except Exception as exc:  # an older protobuf runtime: the built path is the one in use
        pytest.skip(f"generated code does not load on this runtime: {exc}")
    generated = descriptor_pb2.FileDescriptorProto.FromString(chakra_pb2.DESCRIPTOR.serialized_pb)
    assert generated == cs.build_file_descriptor()


def test_built_classes_round_trip_bytes():
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.Add(cs.build_file_descriptor())
    built = message_factory.GetMessageClass(pool.FindMessageTypeByName("ChakraProtoMsg.Node"))
    msg = _node(3, cs.COMM_COLL_NODE, (1, 2), comm_size=1 << 40, pg_name="dp0")
    again = built.FromString(msg.SerializeToString())
    assert list(again.data_deps) == [1, 2] and again.attr[0].int64_val == 1 << 40


@given(st.integers(min_value=0, max_value=(1 << 32) - 1))
def test_varint32_round_trip(value):
    enc = cio.encode_varint32(value)
    assert len(enc) <= 5
    assert cio.decode_varint32(enc + b"\x00", 0) == (value, len(enc))


def test_varint32_rejects_out_of_range():
    with pytest.raises(ValueError):
        cio.encode_varint32(1 << 32)
    with pytest.raises(ValueError):
        cio.decode_varint32(b"\xff\xff\xff\xff\xff\x01", 0)


def test_write_read_round_trip(tmp_path):
    nodes = [
        _node(0, cs.COMP_NODE, num_ops=10, tensor_size=5),
        _node(1, cs.COMM_COLL_NODE, (0,), comm_type=0, comm_size=4096, pg_name="tp0"),
        _node(2, cs.COMM_SEND_NODE, (1,), comm_src=0, comm_dst=1, comm_tag=9, comm_size=64),
    ]
    path = cio.write_et(tmp_path / "x.0.et", cio.metadata({"producer": "test"}), nodes)
    et = cio.read_et(path)
    assert et.version == "1.0.0" and et.metadata == {"producer": "test"}
    assert [n.id for n in et.nodes] == [0, 1, 2]
    assert et.nodes[1].attrs == {"comm_type": 0, "comm_size": 4096, "pg_name": "tp0"}
    assert et.nodes[2].deps == (1,) and et.nodes[0].duration_micros == 7
    assert et.notes == () and cio.check_graph(et) == []
    assert not list(tmp_path.glob(".*.tmp"))  # atomic write leaves no temporary behind


def test_tolerates_other_tools(tmp_path):
    """Old version strings, unknown node types, unknown attributes and fields are notes, not errors."""
    odd = _node(1, 42, (0,), my_attr=3)
    extra_field = odd.SerializeToString() + bytes([0x98, 0x06, 0x05])  # field 99, varint 5
    data = cio.encode_stream([cio.metadata(version="0.0.4"), _node(0, cs.COMP_NODE)])
    data += cio.encode_varint32(len(extra_field)) + extra_field
    (tmp_path / "old.0.et").write_bytes(data)
    et = cio.read_et(tmp_path / "old.0.et")
    assert et.version == "0.0.4" and len(et.nodes) == 2
    text = " | ".join(et.notes)
    assert "0.0.4" in text and "unknown type 42" in text and "'my_attr'" in text and "99" in text
    assert et.nodes[1].type_name == "UNKNOWN_NODE_TYPE_42"


def test_truncated_file_is_a_clear_error(tmp_path):
    data = cio.encode_stream([cio.metadata(), _node(0, cs.COMP_NODE), _node(1, cs.COMP_NODE, (0,))])
    for cut in (len(data) - 3, len(data) - 1):
        (tmp_path / "t.et").write_bytes(data[:cut])
        with pytest.raises(FileFormatError, match=r"t\.et: message 2 at byte \d+ .*truncated"):
            cio.read_et(tmp_path / "t.et")
    (tmp_path / "p.et").write_bytes(data + b"\x80")  # a length prefix cut short
    with pytest.raises(FileFormatError, match="ends inside a length prefix"):
        cio.read_et(tmp_path / "p.et")


def test_corrupt_and_missing_files(tmp_path):
    (tmp_path / "e.et").write_bytes(b"")
    with pytest.raises(FileFormatError, match="empty file"):
        cio.read_et(tmp_path / "e.et")
    with pytest.raises(FileFormatError, match="no such file"):
        cio.read_et(tmp_path / "missing.et")
    bad = b"\x0f\xff\xff\xff"  # field 1 with wire type 7: invalid
    data = cio.encode_stream([cio.metadata()]) + cio.encode_varint32(len(bad)) + bad
    (tmp_path / "c.et").write_bytes(data)
    with pytest.raises(FileFormatError, match=r"message 1 \(Node\) at byte \d+ is corrupt"):
        cio.read_et(tmp_path / "c.et")
    headless = cio.encode_stream([_node(5, cs.COMP_NODE)])
    (tmp_path / "h.et").write_bytes(headless)
    with pytest.raises(FileFormatError, match="not a GlobalMetadata"):
        cio.read_et(tmp_path / "h.et")


def test_check_graph_finds_dangling_deps_and_cycles():
    def et(*nodes):
        return cio.EtFile("x", "1.0.0", {}, tuple(nodes), ())

    n = lambda i, deps: cio.EtNode(i, f"n{i}", cs.COMP_NODE, tuple(deps), (), 1)  # noqa: E731
    assert cio.check_graph(et(n(0, []), n(1, [0]))) == []
    assert "missing node 7" in cio.check_graph(et(n(0, [7])))[0]
    assert cio.check_graph(et(n(0, [1]), n(1, [0]))) == ["the dependencies form a cycle"]
    assert "appears twice" in cio.check_graph(et(n(0, []), n(0, [])))[0]
