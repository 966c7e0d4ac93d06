"""A CollectiveModel that times chosen collectives with MSCCL-IR algorithms and the rest with NCCL.

``MscclCollectiveModel(base, {CollectiveKind.ALL_REDUCE: [algo, ...]})`` answers ``time(kind, nbytes,
group, cluster)`` with the first algorithm for ``kind`` written for ``group.size`` GPUs whose
``minBytes``/``maxBytes`` range holds ``nbytes`` (MSCCL's own selection rule), placed on the group's
ranks; anything else goes to ``base`` (the NCCL model). Predictions are memoised in the instance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from echo_plan.cost.base import Algorithm, CollectiveEstimate, CollectiveModel, Protocol_
from echo_plan.errors import SpecError
from echo_plan.interop.msccl import MscclAlgorithm, load_msccl
from echo_plan.interop.msccl_predict import predict
from echo_plan.specs.cluster import ClusterSpec
from echo_plan.trace.records import CollectiveKind, CommGroup


class MscclCollectiveModel:
    def __init__(self, base: CollectiveModel, algorithms: Mapping[CollectiveKind, Sequence[MscclAlgorithm]],
                 max_cache: int = 100_000) -> None:
        for kind, algos in algorithms.items():
            for a in algos:
                if a.kind is not kind:
                    raise SpecError("--collective-algorithm", f"{kind.value}={a.path}",
                                    f"the file is a {a.coll} algorithm, not {kind.value}")
        self.base = base
        self.algorithms = {k: tuple(v) for k, v in algorithms.items()}
        self.max_cache = max_cache
        self._memo: dict[tuple, CollectiveEstimate] = {}

    def pick(self, kind: CollectiveKind, nbytes: int, group: CommGroup) -> MscclAlgorithm | None:
        for a in self.algorithms.get(kind, ()):
            if a.ngpus == group.size and nbytes >= a.min_bytes and (a.max_bytes == 0 or nbytes <= a.max_bytes):
                return a
        return None

    def time(self, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec) -> CollectiveEstimate:
        algo = self.pick(kind, nbytes, group) if nbytes > 0 else None
        if algo is None:
            return self.base.time(kind, nbytes, group, cluster)
        key = (kind, nbytes, group, cluster.model_dump_json())
        hit = self._memo.get(key)
        if hit is None:
            params = getattr(self.base, "params", None)
            p = predict(algo, nbytes, cluster, group, params)
            hit = CollectiveEstimate(p.time_s, Algorithm.CUSTOM, Protocol_(algo.proto), p.algbw_GBps, p.busbw_GBps)
            if len(self._memo) >= self.max_cache:
                self._memo.clear()
            self._memo[key] = hit
        return hit


def parse_algorithm_options(options: Sequence[str]) -> dict[CollectiveKind, list[MscclAlgorithm]]:
    """``["all_reduce=ring.xml", ...]`` -> algorithms per kind (several per kind: first that fits wins)."""
    out: dict[CollectiveKind, list[MscclAlgorithm]] = {}
    valid = ", ".join(k.value for k in CollectiveKind if k is not CollectiveKind.SEND_RECV)
    for opt in options:
        name, sep, path = opt.partition("=")
        if not sep or not path:
            raise SpecError("--collective-algorithm", opt, f"KIND=FILE.xml with KIND one of {valid}")
        try:
            kind = CollectiveKind(name.strip().replace("-", "_"))
        except ValueError:
            raise SpecError("--collective-algorithm", opt, f"KIND=FILE.xml with KIND one of {valid}") from None
        out.setdefault(kind, []).append(load_msccl(Path(path)))
    return out


def compare_with_nccl(path: str | Path, kind: CollectiveKind, nbytes: int, group: CommGroup, cluster: ClusterSpec,
                      nccl: Any) -> dict[str, Any]:
    """An MSCCL algorithm's predicted time beside the NCCL model's best ring and best tree (``comm --algorithm``)."""
    algo = load_msccl(path)
    if algo.kind is not kind:
        raise SpecError("--op", kind.value, f"{path} is a {algo.coll} algorithm")
    if algo.ngpus != group.size:
        raise SpecError("--gpus", group.size, f"{path} is written for {algo.ngpus} GPUs")
    p = predict(algo, nbytes, cluster, group, getattr(nccl, "params", None))
    rows = [{"name": f"msccl:{algo.name}", "algorithm": Algorithm.CUSTOM.value, "protocol": algo.proto,
             "time_us": p.time_s * 1e6, "algbw_GBps": p.algbw_GBps, "busbw_GBps": p.busbw_GBps}]
    cands = nccl.candidates(kind, nbytes, group, cluster)
    for alg in (Algorithm.RING, Algorithm.TREE):
        best = min((c for c in cands if c.algorithm is alg), key=lambda c: c.time_s, default=None)
        if best is not None:
            rows.append({"name": f"nccl:{alg.value}", "algorithm": alg.value, "protocol": best.protocol.value,
                         "time_us": best.time_s * 1e6, "algbw_GBps": best.algbw_GBps, "busbw_GBps": best.busbw_GBps})
    return {"algorithm_file": str(path), "messages": p.messages, "nvlink_bytes": p.nvlink_bytes,
            "network_bytes": p.network_bytes, "rows": rows}
