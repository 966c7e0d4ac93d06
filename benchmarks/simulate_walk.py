"""Issue 30: follow one plan through ``simulate`` and count how its calls move between the floors.

Every Python call made while ``simulate`` predicts one plan (GPT-3 175B, tp 8 pp 8, 1,024 H800, a warm
trace cache) is recorded with ``sys.setprofile``; each call is a move from the caller's module to the
callee's. Printed: the echo_plan modules visited, the calls that climb back up (a callee on a higher
floor than its caller: a lower stage calling into a higher one), and the calls between cost/ and
replay/ in each direction. Floors are those of tests/test_import_order.py (DESIGN.md).

    python benchmarks/simulate_walk.py            # this checkout
    PYTHONPATH=OTHER_TREE python benchmarks/simulate_walk.py   # another tree of echo_plan, same floors
"""

from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(HERE / "tests"))

from test_import_order import floor_of  # noqa: E402  (the floors the test holds)


def module_of(filename: str, root: Path) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(root.parent)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[0] != "echo_plan":
        return None
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


GPT3_PLAN = dict(tp=8, pp=8, dp=16, micro_batch_size=1, global_batch_size=1536, virtual_stages=2,
                 schedule="interleaved", sequence_parallel=True, distributed_optimizer=True)


def walk(with_faults: bool = False, model_name: str = "gpt3-175b", gpus: int = 1024,
         plan_fields: dict | None = None) -> dict:
    import echo_plan
    from echo_plan.simulate import simulate
    from echo_plan.specs import PlanSpec, load_cluster, load_model
    from echo_plan.trace.cache import TraceCache

    root = Path(echo_plan.__file__).resolve().parent
    model, cluster = load_model(model_name), load_cluster("h800").resized(gpus=gpus)
    plan = PlanSpec.build(dict(plan_fields or GPT3_PLAN), "plan")
    faults = ()
    if with_faults:  # a slow GPU and a slow NIC: the path that re-times stages on their own cluster view
        try:
            from echo_plan.specs.faults import fault_from_mapping
        except ImportError:  # a tree from before issue 30 (resilience/faults.py)
            from echo_plan.resilience.faults import fault_from_mapping

        faults = (fault_from_mapping({"kind": "straggler", "rank": 1, "compute": 1.25}, "walk"),
                  fault_from_mapping({"kind": "link", "node": 1, "nic": 1, "bw": 0.5}, "walk"))
    with tempfile.TemporaryDirectory() as tmp:
        cache = TraceCache(tmp)
        simulate(model, cluster, plan, cache=cache, faults=faults)  # traces into the cache: the walk is of a warm simulate
        moves: collections.Counter = collections.Counter()
        names: dict[str, str | None] = {}

        def name(code) -> str | None:  # noqa: ANN001
            f = code.co_filename
            if f not in names:
                names[f] = module_of(f, root)
            return names[f]

        def profile(frame, event, arg) -> None:  # noqa: ANN001
            if event != "call":
                return
            callee = name(frame.f_code)
            caller = name(frame.f_back.f_code) if frame.f_back is not None else None
            if callee and caller and callee != caller:
                moves[(caller, callee)] += 1

        sys.setprofile(profile)
        try:
            simulate(model, cluster, plan, cache=cache, faults=faults)
        finally:
            sys.setprofile(None)
    visited = {m for pair in moves for m in pair}
    climbs = {pair: n for pair, n in moves.items() if floor_of(pair[1]) > floor_of(pair[0])}
    between = {pair: n for pair, n in moves.items()
               if {package(pair[0]), package(pair[1])} == {"echo_plan.cost", "echo_plan.replay"}}
    return {"root": root, "visited": visited, "moves": moves, "climbs": climbs, "between": between}


def main() -> None:
    for with_faults in (False, True):
        report(walk(with_faults), "with a slow GPU and a slow NIC" if with_faults else "healthy")


def report(got: dict, label: str) -> None:
    print(f"== {label}: echo_plan at {got['root']}")
    print(f"modules visited: {len(got['visited'])}; distinct caller->callee module moves: {len(got['moves'])}")
    print(f"moves climbing back up (callee on a higher floor): {len(got['climbs'])} distinct, "
          f"{sum(got['climbs'].values())} calls")
    for (a, b), n in sorted(got["climbs"].items()):
        print(f"   {a} -> {b}: {n} calls")
    up = {p: n for p, n in got["between"].items() if package(p[0]) == "echo_plan.replay"}
    print(f"moves between cost/ and replay/: {len(got['between'])} distinct; replay -> cost {len(up)} distinct "
          f"({sum(up.values())} calls), cost -> replay {len(got['between']) - len(up)} distinct")


if __name__ == "__main__":
    main()
