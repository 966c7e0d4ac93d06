"""MSCCL-IR collective algorithms: parse and validate the XML that MSCCLang (msccl-tools) emits.

The format, as the MSCCL runtime reads it::

    <algo name=.. proto="Simple" nchannels=.. nchunksperloop=.. ngpus=.. coll="allreduce" inplace=..>
      <gpu id=.. i_chunks=.. o_chunks=.. s_chunks=..>
        <tb id=.. send=PEER|-1 recv=PEER|-1 chan=..>
          <step s=.. type=s|r|rrc|rcs|rrs|rrcs|cpy|re|nop srcbuf=i|o|s srcoff=.. dstbuf=.. dstoff=..
                cnt=.. depid=TB|-1 deps=STEP|-1 hasdep=0|1/>

A thread block (tb) runs its steps in order; a step may also wait for step ``deps`` of thread block
``depid`` on the same GPU (``hasdep=1`` marks a step others wait for). Sends go to the tb's ``send``
peer and receives come from its ``recv`` peer over channel ``chan``; the k-th send from GPU a to b on
a channel meets the k-th receive on b from a on that channel. Every problem found is a
FileFormatError naming the file, the line and the element.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from echo_plan.errors import FileFormatError
from echo_plan.files import read_text
from echo_plan.trace.records import CollectiveKind


class StepType(str, Enum):
    SEND = "s"
    RECV = "r"
    RECV_REDUCE_COPY = "rrc"
    RECV_COPY_SEND = "rcs"
    RECV_REDUCE_SEND = "rrs"
    RECV_REDUCE_COPY_SEND = "rrcs"
    COPY = "cpy"
    REDUCE = "re"
    NOP = "nop"

    @property
    def receives(self) -> bool:
        return self in (StepType.RECV, StepType.RECV_REDUCE_COPY, StepType.RECV_COPY_SEND,
                        StepType.RECV_REDUCE_SEND, StepType.RECV_REDUCE_COPY_SEND)

    @property
    def sends(self) -> bool:
        return self in (StepType.SEND, StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_SEND,
                        StepType.RECV_REDUCE_COPY_SEND)

    @property
    def local(self) -> bool:
        """A step that moves data inside one GPU's memory (copy, reduce) or only waits (nop)."""
        return self in (StepType.COPY, StepType.REDUCE, StepType.NOP)


class Buffer(str, Enum):
    INPUT = "i"
    OUTPUT = "o"
    SCRATCH = "s"


# MSCCL's collective names -> echo-plan's kinds (nccl-tests size conventions apply to both).
COLLECTIVES = {
    "allreduce": CollectiveKind.ALL_REDUCE,
    "allgather": CollectiveKind.ALL_GATHER,
    "reducescatter": CollectiveKind.REDUCE_SCATTER,
    "alltoall": CollectiveKind.ALL_TO_ALL,
    "broadcast": CollectiveKind.BROADCAST,
}
PROTOCOLS = ("Simple", "LL", "LL128")


@dataclass(frozen=True, slots=True)
class Step:
    index: int
    type: StepType
    srcbuf: Buffer
    srcoff: int
    dstbuf: Buffer
    dstoff: int
    cnt: int  # chunks moved
    deps: tuple[tuple[int, int], ...]  # (tb id, step index) on the same GPU
    hasdep: bool
    line: int


@dataclass(frozen=True, slots=True)
class ThreadBlock:
    id: int
    send: int  # peer GPU, -1 for none
    recv: int
    chan: int
    steps: tuple[Step, ...]
    line: int


@dataclass(frozen=True, slots=True)
class Gpu:
    id: int
    i_chunks: int
    o_chunks: int
    s_chunks: int
    tbs: tuple[ThreadBlock, ...]
    line: int

    def tb(self, tb_id: int) -> ThreadBlock | None:
        return next((t for t in self.tbs if t.id == tb_id), None)


@dataclass(frozen=True, slots=True)
class MscclAlgorithm:
    path: str
    name: str
    coll: str  # MSCCL's name, e.g. "allreduce"
    proto: str  # Simple, LL or LL128
    ngpus: int
    nchunksperloop: int
    nchannels: int
    inplace: bool
    min_bytes: int
    max_bytes: int  # 0: no upper bound
    gpus: tuple[Gpu, ...]

    @property
    def kind(self) -> CollectiveKind | None:
        return COLLECTIVES.get(self.coll.lower())

    def chunk_bytes(self, nbytes: int) -> float:
        """Bytes in one chunk when the collective moves ``nbytes`` (nccl-tests size).

        MSCCL splits the collective's whole buffer (all ranks' parts for all-gather) into
        ``nchunksperloop`` chunks.
        """
        return nbytes / self.nchunksperloop

    @property
    def num_steps(self) -> int:
        return sum(len(tb.steps) for g in self.gpus for tb in g.tbs)


# ---------------------------------------------------------------------------------------------
# parsing


@dataclass
class _Elem:
    tag: str
    attrs: dict[str, str]
    line: int
    children: list["_Elem"]


def _parse_tree(text: str, path: str) -> _Elem:
    import xml.parsers.expat

    parser = xml.parsers.expat.ParserCreate()
    stack: list[_Elem] = []
    roots: list[_Elem] = []

    def start(tag: str, attrs: dict[str, str]) -> None:
        elem = _Elem(tag, dict(attrs), parser.CurrentLineNumber, [])
        (stack[-1].children if stack else roots).append(elem)
        stack.append(elem)

    def end(tag: str) -> None:
        stack.pop()

    parser.StartElementHandler = start
    parser.EndElementHandler = end
    try:
        parser.Parse(text, True)
    except xml.parsers.expat.ExpatError as exc:
        raise FileFormatError(path, f"malformed XML: {xml.parsers.expat.ErrorString(exc.code)}", line=exc.lineno)
    if not roots:
        raise FileFormatError(path, "no <algo> element")
    return roots[0]


def _int(elem: _Elem, name: str, path: str, default: int | None = None, lo: int | None = None) -> int:
    raw = elem.attrs.get(name)
    if raw is None:
        if default is None:
            raise FileFormatError(path, f"<{elem.tag}> lacks the {name}= attribute", line=elem.line)
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise FileFormatError(path, f"<{elem.tag}> {name}={raw!r} is not an integer", line=elem.line)
    if lo is not None and value < lo:
        raise FileFormatError(path, f"<{elem.tag}> {name}={value} must be >= {lo}", line=elem.line)
    return value


def _int_list(elem: _Elem, name: str, path: str) -> list[int]:
    raw = elem.attrs.get(name, "-1")
    try:
        return [int(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise FileFormatError(path, f"<{elem.tag}> {name}={raw!r} is not an integer (or a comma list)", line=elem.line)


def _children(elem: _Elem, tag: str, path: str) -> list[_Elem]:
    for child in elem.children:
        if child.tag != tag:
            raise FileFormatError(path, f"unexpected <{child.tag}> inside <{elem.tag}> (expected <{tag}>)",
                                  line=child.line)
    return elem.children


def _parse_step(e: _Elem, path: str) -> Step:
    raw_type = e.attrs.get("type")
    try:
        stype = StepType(raw_type)
    except ValueError:
        valid = ", ".join(t.value for t in StepType)
        raise FileFormatError(path, f"<step> type={raw_type!r} is not one of {valid}", line=e.line)
    bufs = {}
    for key in ("srcbuf", "dstbuf"):
        raw = e.attrs.get(key, "i")
        try:
            bufs[key] = Buffer(raw)
        except ValueError:
            raise FileFormatError(path, f"<step> {key}={raw!r} is not one of i, o, s", line=e.line)
    depids, depsteps = _int_list(e, "depid", path), _int_list(e, "deps", path)
    if len(depids) != len(depsteps):
        raise FileFormatError(path, f"<step> depid and deps list {len(depids)} and {len(depsteps)} entries",
                              line=e.line)
    deps = tuple((t, s) for t, s in zip(depids, depsteps) if t >= 0 or s >= 0)
    for t, s in deps:
        if t < 0 or s < 0:
            raise FileFormatError(path, f"<step> dependency depid={t} deps={s}: both must be >= 0, or both -1",
                                  line=e.line)
    return Step(
        index=_int(e, "s", path, lo=0), type=stype, srcbuf=bufs["srcbuf"], srcoff=_int(e, "srcoff", path, 0, 0),
        dstbuf=bufs["dstbuf"], dstoff=_int(e, "dstoff", path, 0, 0), cnt=_int(e, "cnt", path, 1, 0),
        deps=deps, hasdep=_int(e, "hasdep", path, 0) != 0, line=e.line,
    )


def _parse_tb(e: _Elem, ngpus: int, gpu_id: int, path: str) -> ThreadBlock:
    tb = ThreadBlock(
        id=_int(e, "id", path, lo=0), send=_int(e, "send", path, -1, -1), recv=_int(e, "recv", path, -1, -1),
        chan=_int(e, "chan", path, 0, 0), steps=tuple(_parse_step(s, path) for s in _children(e, "step", path)),
        line=e.line,
    )
    for peer, role in ((tb.send, "send"), (tb.recv, "recv")):
        if peer >= ngpus or peer == gpu_id:
            raise FileFormatError(path, f"gpu {gpu_id} <tb id={tb.id}> {role}={peer}: a peer must be another "
                                        f"GPU in [0, {ngpus})", line=e.line)
    for i, step in enumerate(tb.steps):
        if step.index != i:
            raise FileFormatError(path, f"gpu {gpu_id} tb {tb.id}: step s={step.index} found where s={i} was "
                                        "expected (steps are numbered 0, 1, ... in order)", line=step.line)
        if step.type.sends and tb.send < 0:
            raise FileFormatError(path, f"gpu {gpu_id} tb {tb.id} step {i} ({step.type.value}) sends but the tb "
                                        "has send=-1", line=step.line)
        if step.type.receives and tb.recv < 0:
            raise FileFormatError(path, f"gpu {gpu_id} tb {tb.id} step {i} ({step.type.value}) receives but the "
                                        "tb has recv=-1", line=step.line)
    return tb


def parse_msccl(text: str, path: str = "<xml>") -> MscclAlgorithm:
    """Parse and validate an MSCCL-IR XML document."""
    root = _parse_tree(text, path)
    if root.tag != "algo":
        raise FileFormatError(path, f"the root element is <{root.tag}>, expected <algo>", line=root.line)
    gpu_elems = _children(root, "gpu", path)
    ngpus = _int(root, "ngpus", path, default=len(gpu_elems), lo=1)
    proto = root.attrs.get("proto", "Simple")
    if proto not in PROTOCOLS:
        raise FileFormatError(path, f"<algo> proto={proto!r} is not one of {', '.join(PROTOCOLS)}", line=root.line)
    gpus = []
    for e in gpu_elems:
        gid = _int(e, "id", path, lo=0)
        if gid >= ngpus:
            raise FileFormatError(path, f"<gpu id={gid}> is outside [0, ngpus={ngpus})", line=e.line)
        gpus.append(Gpu(
            id=gid, i_chunks=_int(e, "i_chunks", path, 0, 0), o_chunks=_int(e, "o_chunks", path, 0, 0),
            s_chunks=_int(e, "s_chunks", path, 0, 0),
            tbs=tuple(_parse_tb(t, ngpus, gid, path) for t in _children(e, "tb", path)), line=e.line,
        ))
    algo = MscclAlgorithm(
        path=path, name=root.attrs.get("name", Path(path).stem), coll=root.attrs.get("coll", "allreduce"),
        proto=proto, ngpus=ngpus, nchunksperloop=_int(root, "nchunksperloop", path, lo=1),
        nchannels=_int(root, "nchannels", path, 1, 1), inplace=_int(root, "inplace", path, 1) != 0,
        min_bytes=_int(root, "minBytes", path, 0, 0), max_bytes=_int(root, "maxBytes", path, 0, 0),
        gpus=tuple(sorted(gpus, key=lambda g: g.id)),
    )
    validate(algo, root)
    return algo


def load_msccl(path: str | Path) -> MscclAlgorithm:
    p = Path(path)
    text = read_text(p)
    return parse_msccl(text, str(p))


# ---------------------------------------------------------------------------------------------
# validation beyond single elements


def validate(algo: MscclAlgorithm, root: _Elem) -> None:
    path = algo.path
    seen = [g.id for g in algo.gpus]
    if sorted(seen) != list(range(algo.ngpus)):
        dup = sorted({g for g in seen if seen.count(g) > 1})
        missing = sorted(set(range(algo.ngpus)) - set(seen))
        raise FileFormatError(path, f"<gpu> ids must be 0..{algo.ngpus - 1} once each "
                                    f"(repeated {dup}, missing {missing})", line=root.line)
    kind = algo.kind
    if kind is None:
        raise FileFormatError(path, f"<algo> coll={algo.coll!r} is not one of {', '.join(COLLECTIVES)}",
                              line=root.line)
    depended: set[tuple[int, int, int]] = set()
    for g in algo.gpus:
        tb_ids = [t.id for t in g.tbs]
        if len(set(tb_ids)) != len(tb_ids):
            raise FileFormatError(path, f"gpu {g.id} has two thread blocks with the same id", line=g.line)
        for tb in g.tbs:
            for step in tb.steps:
                for dep_tb, dep_step in step.deps:
                    target = g.tb(dep_tb)
                    if target is None or dep_step >= len(target.steps):
                        raise FileFormatError(
                            path, f"gpu {g.id} tb {tb.id} step {step.index} depends on tb {dep_tb} step "
                                  f"{dep_step}, which does not exist (dangling dependency)", line=step.line)
                    if dep_tb == tb.id and dep_step >= step.index:
                        raise FileFormatError(
                            path, f"gpu {g.id} tb {tb.id} step {step.index} depends on a later step of its own "
                                  "thread block", line=step.line)
                    depended.add((g.id, dep_tb, dep_step))
    for gid, tid, sidx in sorted(depended):
        step = algo.gpus[gid].tb(tid).steps[sidx]  # type: ignore[union-attr]
        if not step.hasdep:
            raise FileFormatError(path, f"gpu {gid} tb {tid} step {sidx} is waited on by another step but has "
                                        "hasdep=0 (MSCCL would never signal it)", line=step.line)
    _check_matching(algo)


StepRef = tuple[int, int, int]  # (gpu, tb id, step index)


def connections(algo: MscclAlgorithm) -> dict[tuple[int, int, int], tuple[list[tuple[StepRef, Step]], list[tuple[StepRef, Step]]]]:
    """(src gpu, dst gpu, channel) -> (its sending steps in order, its receiving steps in order)."""
    conns: dict = {}
    for g in algo.gpus:
        for tb in g.tbs:
            for step in tb.steps:
                ref = (g.id, tb.id, step.index)
                if step.type.sends:
                    conns.setdefault((g.id, tb.send, tb.chan), ([], []))[0].append((ref, step))
                if step.type.receives:
                    conns.setdefault((tb.recv, g.id, tb.chan), ([], []))[1].append((ref, step))
    return conns


def _check_matching(algo: MscclAlgorithm) -> None:
    for (src, dst, chan), (sends, recvs) in sorted(connections(algo).items()):
        if len(sends) != len(recvs):
            where = (sends or recvs)[0][1].line
            raise FileFormatError(algo.path, f"gpu {src} sends {len(sends)} message(s) to gpu {dst} on channel "
                                             f"{chan} but gpu {dst} receives {len(recvs)}", line=where)
        for k, ((_, s), (_, r)) in enumerate(zip(sends, recvs)):
            if s.cnt != r.cnt:
                raise FileFormatError(algo.path, f"message {k} from gpu {src} to gpu {dst} (channel {chan}) is "
                                                 f"sent with cnt={s.cnt} but received with cnt={r.cnt}", line=r.line)
