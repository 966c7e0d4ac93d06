"""The Chakra message classes (Node, GlobalMetadata, AttributeProto) and enums, for any protobuf 4+.

``chakra_pb2.py`` is generated from ``chakra.proto`` by protoc (see the header of the .proto), and
generated code only loads on a protobuf runtime at least as new as the protoc that wrote it. The
project accepts older runtimes (``protobuf>=4.21``), so this module uses the generated classes when
they load and otherwise builds the same descriptors at import time from the table below, with
``descriptor_pb2`` and ``message_factory``. A test checks the two give the same schema.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "ChakraProtoMsg"
FILE_NAME = "chakra.proto"

_F = descriptor_pb2.FieldDescriptorProto
_SCALAR = {
    "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32, "uint64": _F.TYPE_UINT64, "sint32": _F.TYPE_SINT32, "sint64": _F.TYPE_SINT64,
    "fixed32": _F.TYPE_FIXED32, "fixed64": _F.TYPE_FIXED64, "sfixed32": _F.TYPE_SFIXED32,
    "sfixed64": _F.TYPE_SFIXED64, "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES,
}

# Enum name -> (value name, number), numbers as in Chakra's et_def.proto.
ENUMS: dict[str, tuple[tuple[str, int], ...]] = {
    "NodeType": (
        ("INVALID_NODE", 0), ("METADATA_NODE", 1), ("MEM_LOAD_NODE", 2), ("MEM_STORE_NODE", 3),
        ("COMP_NODE", 4), ("COMM_SEND_NODE", 5), ("COMM_RECV_NODE", 6), ("COMM_COLL_NODE", 7),
        ("STORAGE_NODE", 8), ("BATCH_NODE", 9), ("CHECKPOINT_NODE", 10),
    ),
    "CollectiveCommType": (
        ("ALL_REDUCE", 0), ("REDUCE", 1), ("ALL_GATHER", 2), ("GATHER", 3), ("SCATTER", 4),
        ("BROADCAST", 5), ("ALL_TO_ALL", 6), ("REDUCE_SCATTER", 7), ("REDUCE_SCATTER_BLOCK", 8),
        ("BARRIER", 9),
    ),
}

# Message name -> fields (name, number, type, "repeated" or a oneof name or "").
# A type that is not a scalar names a message or an enum of this file.
_LISTS = {"DoubleList": "double", "FloatList": "float", "Int32List": "int32", "Int64List": "int64",
          "Uint32List": "uint32", "Uint64List": "uint64", "BoolList": "bool", "StringList": "string"}
_VALUE_FIELDS = (
    ("double_val", 3, "double"), ("double_list", 4, "DoubleList"), ("float_val", 5, "float"),
    ("float_list", 6, "FloatList"), ("int32_val", 7, "int32"), ("int32_list", 8, "Int32List"),
    ("int64_val", 9, "int64"), ("int64_list", 10, "Int64List"), ("uint32_val", 11, "uint32"),
    ("uint32_list", 12, "Uint32List"), ("uint64_val", 13, "uint64"), ("uint64_list", 14, "Uint64List"),
    ("sint32_val", 15, "sint32"), ("sint64_val", 17, "sint64"), ("fixed32_val", 19, "fixed32"),
    ("fixed64_val", 21, "fixed64"), ("sfixed32_val", 23, "sfixed32"), ("sfixed64_val", 25, "sfixed64"),
    ("bool_val", 27, "bool"), ("bool_list", 28, "BoolList"), ("string_val", 29, "string"),
    ("string_list", 30, "StringList"), ("bytes_val", 31, "bytes"),
)
MESSAGES: dict[str, tuple[tuple[str, int, str, str], ...]] = {
    "AttributeProto": (("name", 1, "string", ""), ("doc_string", 2, "string", ""))
    + tuple((n, num, t, "value") for n, num, t in _VALUE_FIELDS),
    **{name: (("values", 1, scalar, "repeated"),) for name, scalar in _LISTS.items()},
    "GlobalMetadata": (("version", 1, "string", ""), ("attr", 2, "AttributeProto", "repeated")),
    "IOInfo": (("values", 1, "string", ""), ("shapes", 2, "string", ""), ("types", 3, "string", "")),
    "Node": (
        ("id", 1, "uint64", ""), ("name", 2, "string", ""), ("type", 3, "NodeType", ""),
        ("ctrl_deps", 4, "uint64", "repeated"), ("data_deps", 5, "uint64", "repeated"),
        ("start_time_micros", 6, "uint64", ""), ("duration_micros", 7, "uint64", ""),
        ("inputs", 8, "IOInfo", ""), ("outputs", 9, "IOInfo", ""), ("attr", 10, "AttributeProto", "repeated"),
    ),
}


def build_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The schema of ``chakra.proto`` as a FileDescriptorProto, built from the tables above."""
    fdp = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    for msg_name, fields in MESSAGES.items():
        msg = fdp.message_type.add(name=msg_name)
        oneofs: list[str] = []
        for name, number, type_name, role in fields:
            field = msg.field.add(name=name, number=number)
            field.label = _F.LABEL_REPEATED if role == "repeated" else _F.LABEL_OPTIONAL
            if type_name in _SCALAR:
                field.type = _SCALAR[type_name]
            else:
                field.type = _F.TYPE_ENUM if type_name in ENUMS else _F.TYPE_MESSAGE
                field.type_name = f".{PACKAGE}.{type_name}"
            if role not in ("", "repeated"):
                if role not in oneofs:
                    oneofs.append(role)
                    msg.oneof_decl.add(name=role)
                field.oneof_index = oneofs.index(role)
    for enum_name, values in ENUMS.items():
        enum = fdp.enum_type.add(name=enum_name)
        for value_name, number in values:
            enum.value.add(name=value_name, number=number)
    return fdp


def _load_generated() -> Any | None:
    try:
        from echo_plan.interop import chakra_pb2  # deferred: it may not load on this protobuf runtime
    except Exception:  # VersionError on an older runtime, or a pool conflict: build it instead
        return None
    return chakra_pb2


def _classes() -> tuple[dict[str, Any], str]:
    generated = _load_generated()
    if generated is not None:
        return {name: getattr(generated, name) for name in MESSAGES}, "generated"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(build_file_descriptor())
    out = {}
    for name in MESSAGES:
        desc = pool.FindMessageTypeByName(f"{PACKAGE}.{name}")
        if hasattr(message_factory, "GetMessageClass"):
            out[name] = message_factory.GetMessageClass(desc)
        else:  # protobuf 4.21
            out[name] = message_factory.MessageFactory(pool).GetPrototype(desc)
    return out, "built"


_CLASSES, SOURCE = _classes()  # set once at import, never mutated; SOURCE says which path loaded

Node = _CLASSES["Node"]
GlobalMetadata = _CLASSES["GlobalMetadata"]
AttributeProto = _CLASSES["AttributeProto"]

NODE_TYPES: dict[str, int] = dict(ENUMS["NodeType"])
NODE_TYPE_NAMES: dict[int, str] = {v: k for k, v in NODE_TYPES.items()}
COMM_TYPES: dict[str, int] = dict(ENUMS["CollectiveCommType"])
COMM_TYPE_NAMES: dict[int, str] = {v: k for k, v in COMM_TYPES.items()}

COMP_NODE = NODE_TYPES["COMP_NODE"]
COMM_SEND_NODE = NODE_TYPES["COMM_SEND_NODE"]
COMM_RECV_NODE = NODE_TYPES["COMM_RECV_NODE"]
COMM_COLL_NODE = NODE_TYPES["COMM_COLL_NODE"]
