"""An MSCCL-IR algorithm as Chakra graphs, one per GPU, as "Towards a Standardized Representation
for Deep Learning Collective Algorithms" (2024) proposes: point-to-point sends and receives with
dependencies, plus local compute for reductions and copies.

Per step of a thread block: a receive becomes COMM_RECV_NODE, a send COMM_SEND_NODE, a reduction or
copy a COMP_NODE (``tensor_size`` = bytes touched, ``num_ops`` = elements reduced); rcs/rrs/rrcs
chain receive -> (reduce) -> send. A step waits for the previous step of its thread block and for
its ``depid``/``deps`` steps; a nop is a zero-length COMP_NODE so dependencies through it stay.
``comm_tag`` identifies the message on its connection: ``channel * 2**20 + k`` for the k-th
message from the source to the destination on that channel (MSCCL's matching rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from echo_plan.errors import SpecError
from echo_plan.interop import chakra_io as cio
from echo_plan.interop import chakra_schema as cs
from echo_plan.interop.msccl import MscclAlgorithm, StepType, connections

TAG_CHANNEL = 1 << 20
ELEMENT_BYTES = 2  # bf16/fp16 elements, for num_ops of reductions


def algorithm_graphs(algo: MscclAlgorithm, nbytes: int) -> dict[int, list[Any]]:
    """GPU id -> its Node messages (metadata not included)."""
    if nbytes <= 0:
        raise SpecError("--size", nbytes, "a positive number of bytes")
    chunk = algo.chunk_bytes(nbytes)
    tag_of: dict[tuple[int, int, int], int] = {}
    for (src, dst, chan), (sends, recvs) in connections(algo).items():
        for k, (ref, _) in enumerate(sends):
            tag_of[("s",) + ref] = chan * TAG_CHANNEL + k  # type: ignore[operator]
        for k, (ref, _) in enumerate(recvs):
            tag_of[("r",) + ref] = chan * TAG_CHANNEL + k  # type: ignore[operator]
    out: dict[int, list[Any]] = {}
    for g in algo.gpus:
        nodes: list[Any] = []
        last_of: dict[tuple[int, int], int] = {}  # (tb, step) -> its last node id

        def add(ntype: int, name: str, deps: list[int], **attrs: Any) -> int:
            msg = cs.Node(id=len(nodes), name=name, type=ntype)
            msg.data_deps.extend(dict.fromkeys(deps))
            for key, (value, kind) in attrs.items():
                msg.attr.append(cio.attr(key, value, kind))
            nodes.append(msg)
            return msg.id

        # steps in an order where every dependency comes first: thread blocks interleaved by step index
        pending = [(tb, s) for tb in g.tbs for s in tb.steps]
        while pending:
            progressed = False
            rest = []
            for tb, step in pending:
                if step.index > 0 and (tb.id, step.index - 1) not in last_of or \
                        any(d not in last_of for d in step.deps):
                    rest.append((tb, step))
                    continue
                prev = [last_of[(tb.id, step.index - 1)]] if step.index > 0 else []
                deps = prev + [last_of[d] for d in step.deps]
                size = int(round(step.cnt * chunk))
                label = f"tb{tb.id} s{step.index} {step.type.value}"
                cur = deps
                if step.type.receives:
                    cur = [add(cs.COMM_RECV_NODE, f"{label} recv from {tb.recv}", cur,
                               comm_src=(tb.recv, "int32_val"), comm_dst=(g.id, "int32_val"),
                               comm_tag=(tag_of[("r", g.id, tb.id, step.index)], "int32_val"),
                               comm_size=(size, "int64_val"))]
                if step.type in (StepType.RECV_REDUCE_COPY, StepType.RECV_REDUCE_SEND,
                                 StepType.RECV_REDUCE_COPY_SEND, StepType.REDUCE):
                    cur = [add(cs.COMP_NODE, f"{label} reduce", cur, num_ops=(size // ELEMENT_BYTES, "int64_val"),
                               tensor_size=(3 * size, "uint64_val"))]
                elif step.type is StepType.COPY:
                    cur = [add(cs.COMP_NODE, f"{label} copy", cur, num_ops=(0, "int64_val"),
                               tensor_size=(2 * size, "uint64_val"))]
                elif step.type is StepType.NOP:
                    cur = [add(cs.COMP_NODE, f"{label} nop", cur, num_ops=(0, "int64_val"),
                               tensor_size=(0, "uint64_val"))]
                if step.type.sends:
                    cur = [add(cs.COMM_SEND_NODE, f"{label} send to {tb.send}", cur,
                               comm_src=(g.id, "int32_val"), comm_dst=(tb.send, "int32_val"),
                               comm_tag=(tag_of[("s", g.id, tb.id, step.index)], "int32_val"),
                               comm_size=(size, "int64_val"))]
                last_of[(tb.id, step.index)] = cur[0]
                progressed = True
            if not progressed:  # a dependency cycle inside one GPU
                tb, step = rest[0]
                raise SpecError("algorithm", algo.path, f"gpu {g.id} tb {tb.id} step {step.index} is in a "
                                                        f"dependency cycle (line {step.line})")
            pending = rest
        out[g.id] = nodes
    return out


def export_collective(algo: MscclAlgorithm, nbytes: int, out: str | Path) -> list[Path]:
    base = Path(out)
    if base.name in ("", ".", ".."):
        raise SpecError("-o", str(out), "DIR/NAME: a folder and a file-name prefix")
    written = []
    for gpu, nodes in algorithm_graphs(algo, nbytes).items():
        meta = cio.metadata({"producer": "echo-plan", "msccl_algorithm": algo.name, "collective": algo.coll,
                             "size_bytes": nbytes, "rank": gpu, "world_size": algo.ngpus})
        written.append(cio.write_et(base.parent / f"{base.name}.{gpu}.et", meta, nodes))
    return written
