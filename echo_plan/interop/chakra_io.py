"""Reading and writing Chakra execution-trace (.et) files.

The format (Chakra's protolib and ASTRA-sim's feeder): a stream of protobuf messages, each preceded
by its length as a varint (at most 32 bits); the first message is a GlobalMetadata, every later one
a Node. Reading is tolerant of what other tools write (any version string, node types and
attributes echo-plan does not interpret, fields this schema lacks): those are collected as notes,
not errors. What cannot be read (a truncated or corrupt stream, no metadata) raises
FileFormatError naming the file, the message and its byte offset.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from echo_plan.errors import FileFormatError
from echo_plan.files import read_bytes, write_atomic
from echo_plan.interop import chakra_schema as cs

WRITE_VERSION = "1.0.0"
MAX_VARINT32_BYTES = 5

# Node attributes echo-plan interprets (Chakra's names); others are reported when read.
KNOWN_ATTRS = frozenset({
    "num_ops", "tensor_size", "comm_type", "comm_size", "pg_name", "comm_src", "comm_dst", "comm_tag",
    "is_cpu_op", "op_type", "stream", "echo_plan_mix",
})
SUPPORTED_NODE_TYPES = frozenset({cs.COMP_NODE, cs.COMM_COLL_NODE, cs.COMM_SEND_NODE, cs.COMM_RECV_NODE})


@dataclass(frozen=True, slots=True)
class EtNode:
    """One Node of a Chakra trace, decoded into plain Python values."""

    id: int
    name: str
    type: int  # Chakra NodeType number (may be one this schema does not know)
    data_deps: tuple[int, ...]
    ctrl_deps: tuple[int, ...]
    duration_micros: int
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def type_name(self) -> str:
        return cs.NODE_TYPE_NAMES.get(self.type, f"UNKNOWN_NODE_TYPE_{self.type}")

    @property
    def deps(self) -> tuple[int, ...]:
        """Data and control dependencies together, in order, without repeats."""
        return tuple(dict.fromkeys(self.data_deps + self.ctrl_deps))


@dataclass(frozen=True, slots=True)
class EtFile:
    path: str
    version: str
    metadata: dict[str, Any]
    nodes: tuple[EtNode, ...]
    notes: tuple[str, ...]  # what was read but not understood: unknown types, attributes, fields


# ---------------------------------------------------------------------------------------------
# varint32 length prefixes


def encode_varint32(value: int) -> bytes:
    if value < 0 or value >= 1 << 32:
        raise ValueError(f"a varint32 length must be in [0, 2^32), not {value}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint32(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError when the bytes end or run past five bytes."""
    value = 0
    for i in range(MAX_VARINT32_BYTES):
        if pos + i >= len(data):
            raise ValueError("the stream ends inside a length prefix")
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if value >= 1 << 32:
                raise ValueError("a length prefix exceeds 32 bits")
            return value, pos + i + 1
    raise ValueError("a length prefix runs past five bytes")


def encode_stream(messages: Iterable[Any]) -> bytes:
    parts = []
    for msg in messages:
        payload = msg.SerializeToString()
        parts.append(encode_varint32(len(payload)))
        parts.append(payload)
    return b"".join(parts)


def split_stream(data: bytes, path: str) -> Iterator[tuple[int, int, bytes]]:
    """(message index, byte offset, payload) for each length-delimited message of ``data``."""
    pos = 0
    index = 0
    while pos < len(data):
        start = pos
        try:
            length, pos = decode_varint32(data, pos)
        except ValueError as exc:
            raise FileFormatError(path, f"message {index} at byte {start}: {exc} (truncated or not a Chakra .et file)")
        if pos + length > len(data):
            raise FileFormatError(
                path, f"message {index} at byte {start} declares {length} bytes but only "
                      f"{len(data) - pos} remain (truncated file)")
        yield index, start, data[pos:pos + length]
        pos += length
        index += 1


# ---------------------------------------------------------------------------------------------
# writing


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    """Write a whole binary file or nothing (see echo_plan.files.write_atomic)."""
    return write_atomic(path, data)


def attr(name: str, value: Any, kind: str | None = None) -> Any:
    """An AttributeProto; ``kind`` picks the oneof field (e.g. "int64_val"), else from the value."""
    if kind is None:
        if isinstance(value, bool):
            kind = "bool_val"
        elif isinstance(value, int):
            kind = "int64_val"
        elif isinstance(value, float):
            kind = "double_val"
        elif isinstance(value, str):
            kind = "string_val"
        else:
            raise TypeError(f"no Chakra attribute type for {type(value).__name__}")
    return cs.AttributeProto(name=name, **{kind: value})


def metadata(attrs: dict[str, Any] | None = None, version: str = WRITE_VERSION) -> Any:
    msg = cs.GlobalMetadata(version=version)
    for name, value in (attrs or {}).items():
        msg.attr.append(attr(name, value))
    return msg


def write_et(path: str | Path, meta: Any, nodes: Iterable[Any]) -> Path:
    """Write one rank's trace: ``meta`` (a GlobalMetadata) then the Node messages, atomically."""
    return write_bytes_atomic(path, encode_stream([meta, *nodes]))


# ---------------------------------------------------------------------------------------------
# reading


def attr_value(a: Any) -> Any:
    which = a.WhichOneof("value")
    if which is None:
        return None
    value = getattr(a, which)
    if which.endswith("_list"):
        return tuple(value.values)
    return value


def _unknown_field_numbers(msg: Any) -> tuple[int, ...]:
    try:
        from google.protobuf.unknown_fields import UnknownFieldSet
    except ImportError:  # protobuf < 4.24 has no public API for it
        return ()
    return tuple(sorted({f.field_number for f in UnknownFieldSet(msg)}))


def _version_note(version: str) -> str | None:
    if not version:
        return "metadata has no version string; read with the Chakra 1.0 schema"
    major = version.split(".", 1)[0]
    if major != WRITE_VERSION.split(".", 1)[0]:
        return f"version {version!r} differs from {WRITE_VERSION}; read with the Chakra 1.0 schema"
    return None


def _looks_like_node(payload: bytes) -> bool:
    from google.protobuf.message import DecodeError

    try:
        node = cs.Node.FromString(payload)
    except DecodeError:
        return False
    return node.type != 0 and not _unknown_field_numbers(node)


def decode_et(data: bytes, path: str = "<bytes>") -> EtFile:
    from google.protobuf.message import DecodeError

    messages = list(split_stream(data, path))
    if not messages:
        raise FileFormatError(path, "empty file: a Chakra trace starts with a GlobalMetadata message")
    notes: list[str] = []
    _, _, head = messages[0]
    try:
        meta = cs.GlobalMetadata.FromString(head)
    except DecodeError as exc:
        if _looks_like_node(head):
            raise FileFormatError(path, "the first message is a Node, not a GlobalMetadata (Chakra traces start with one)")
        raise FileFormatError(path, f"message 0 (GlobalMetadata) at byte 0 is corrupt: {exc}")
    extra = _unknown_field_numbers(meta)
    if extra:
        if _looks_like_node(head):
            raise FileFormatError(path, "the first message is a Node, not a GlobalMetadata (Chakra traces start with one)")
        notes.append(f"unknown GlobalMetadata field number(s) {list(extra)}, ignored")
    note = _version_note(meta.version)
    if note:
        notes.append(note)
    meta_attrs = {a.name: attr_value(a) for a in meta.attr}

    nodes: list[EtNode] = []
    unknown_types: Counter[int] = Counter()
    unknown_attrs: Counter[str] = Counter()
    unknown_fields: Counter[int] = Counter()
    for index, offset, payload in messages[1:]:
        try:
            msg = cs.Node.FromString(payload)
        except DecodeError as exc:
            raise FileFormatError(path, f"message {index} (Node) at byte {offset} is corrupt: {exc}")
        for number in _unknown_field_numbers(msg):
            unknown_fields[number] += 1
        attrs = {a.name: attr_value(a) for a in msg.attr}
        for name in attrs:
            if name not in KNOWN_ATTRS:
                unknown_attrs[name] += 1
        if msg.type not in cs.NODE_TYPE_NAMES:
            unknown_types[msg.type] += 1
        nodes.append(EtNode(
            id=msg.id, name=msg.name, type=msg.type, data_deps=tuple(msg.data_deps),
            ctrl_deps=tuple(msg.ctrl_deps), duration_micros=msg.duration_micros, attrs=attrs,
        ))
    for t, n in sorted(unknown_types.items()):
        notes.append(f"{n} node(s) of unknown type {t}")
    for name, n in sorted(unknown_attrs.items()):
        notes.append(f"unknown attribute {name!r} on {n} node(s), ignored")
    for number, n in sorted(unknown_fields.items()):
        notes.append(f"unknown Node field number {number} on {n} node(s), ignored")
    return EtFile(path=path, version=meta.version, metadata=meta_attrs, nodes=tuple(nodes), notes=tuple(notes))


def read_et(path: str | Path) -> EtFile:
    p = Path(path)
    return decode_et(read_bytes(p), str(p))


def check_graph(et: EtFile) -> list[str]:
    """Structural problems of one rank's graph: duplicate ids, dependencies on missing nodes, cycles."""
    problems: list[str] = []
    ids: set[int] = set()
    for node in et.nodes:
        if node.id in ids:
            problems.append(f"node id {node.id} appears twice")
        ids.add(node.id)
    for node in et.nodes:
        for dep in node.deps:
            if dep not in ids:
                problems.append(f"node {node.id} ({node.name}) depends on missing node {dep}")
    if not problems and topological_order(et.nodes) is None:
        problems.append("the dependencies form a cycle")
    return problems


def topological_order(nodes: Iterable[EtNode]) -> list[EtNode] | None:
    """Nodes ordered so each comes after its dependencies (file order breaks ties); None on a cycle."""
    import heapq

    nodes = list(nodes)
    by_id = {n.id: n for n in nodes}
    position = {n.id: i for i, n in enumerate(nodes)}
    indegree = {n.id: 0 for n in nodes}
    children: dict[int, list[int]] = {n.id: [] for n in nodes}
    for n in nodes:
        for dep in n.deps:
            if dep in by_id:
                indegree[n.id] += 1
                children[dep].append(n.id)
    ready = [(position[i], i) for i, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[EtNode] = []
    while ready:
        _, nid = heapq.heappop(ready)
        order.append(by_id[nid])
        for child in children[nid]:
            indegree[child] -= 1
            if indegree[child] == 0:
                heapq.heappush(ready, (position[child], child))
    return order if len(order) == len(nodes) else None
