"""Imports go down the floors (DESIGN.md): every module's imports, at module level and inside
functions, read from its syntax tree, may name only its own package or a lower floor. An import
inside a function is allowed only for a heavy library deferred on purpose, with the reason beside it
(checked for echo_plan's own modules: deferring one of ours is never a reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "echo_plan"

# The floors, lowest first (DESIGN.md, "The floors, and the one rule about them"). A module belongs
# to the most specific prefix listed; modules of one floor may import each other.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("echo_plan", "echo_plan.errors", "echo_plan.limits", "echo_plan.files", "echo_plan.output_paths"),
    ("echo_plan.specs",),
    ("echo_plan.trace",),
    ("echo_plan.layout",),
    ("echo_plan.cost",),
    ("echo_plan.replay",),
    ("echo_plan.simulate",),
    ("echo_plan.interop",),
    ("echo_plan.search",),
    ("echo_plan.resilience",),
    ("echo_plan.validation",),
    ("echo_plan.calibrate",),
    ("echo_plan.report",),
    ("echo_plan.commands",),
    ("echo_plan.cli",),
)


def floor_of(module: str) -> int:
    best, floor = -1, None
    for n, prefixes in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), n
    assert floor is not None, module
    return floor


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only(tree: ast.AST) -> set[int]:
    """Nodes under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    return {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and getattr(f.test, "id", "") == "TYPE_CHECKING"
            for b in f.body for n in ast.walk(b)}


def imports(path: Path, runtime_only: bool = False) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each echo_plan import of the file; with
    ``runtime_only``, without the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    skip = _type_only(tree) if runtime_only else set()
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name == "echo_plan" or name.startswith("echo_plan."):
                out.append((name, node.lineno, id(node) in in_function))
    return out


def target(name: str) -> str:
    """The module an imported name belongs to (``echo_plan.cost.memory.StageMemory`` -> the module)."""
    parts = name.split(".")
    while len(parts) > 1:
        cand = ROOT.parent.joinpath(*parts)
        if cand.with_suffix(".py").is_file() or (cand / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return "echo_plan"


def upward_imports(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        here = module_name(path)
        for name, line, in_fn in imports(path):
            there = target(name)
            if floor_of(there) > floor_of(here):
                where = "in a function" if in_fn else "at module level"
                found.append(f"{path.relative_to(ROOT.parent)}:{line} imports {there} {where} "
                             f"(floor {floor_of(there)} above {floor_of(here)})")
    return sorted(set(found))


def test_every_import_goes_down_the_floors():
    assert upward_imports() == []


def test_the_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / "echo_plan"
    (pkg / "cost").mkdir(parents=True)
    (pkg / "replay").mkdir()
    for p in (pkg / "__init__.py", pkg / "cost" / "__init__.py", pkg / "replay" / "__init__.py"):
        p.write_text("")
    (pkg / "replay" / "engine.py").write_text("")
    (pkg / "cost" / "memory.py").write_text("def f():\n    from echo_plan.replay.engine import replay\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        found = upward_imports(pkg)
    finally:
        ROOT = saved
    assert found == ["echo_plan/cost/memory.py:2 imports echo_plan.replay.engine in a function (floor 5 above 4)"]


@pytest.mark.parametrize("module,floor", [("echo_plan.cost.memory", 4), ("echo_plan.cost.goodput", 4),
                                          ("echo_plan.layout.schedules", 3), ("echo_plan.resilience.diagnose.emit", 9),
                                          ("echo_plan.files", 0), ("echo_plan.cli", 14)])
def test_floors_by_most_specific_prefix(module, floor):
    assert floor_of(module) == floor


def file_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the echo_plan modules it imports when it runs (module level and inside functions)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        here = module_name(path)
        graph.setdefault(here, set())
        for name, _, _ in imports(path, runtime_only=True):
            there = target(name)
            if there != here and not (here.startswith(there + ".") and there == "echo_plan"):
                graph[here].add(there)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between packages (echo_plan.X, or the top-level module)."""
    def pkg(m: str) -> str:
        return ".".join(m.split(".")[:2])
    out: dict[str, set[str]] = {}
    for a, bs in graph.items():
        out.setdefault(pkg(a), set()).update(pkg(b) for b in bs if pkg(b) != pkg(a))
    return out


def test_no_file_level_circle():
    assert circles(file_graph()) == []


def test_no_package_level_loop_counting_imports_inside_functions():
    assert circles(package_graph(file_graph())) == []


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def unexplained_function_imports(root: Path = ROOT) -> list[str]:
    """Imports of echo_plan modules inside functions without a reason on their line (DESIGN.md: an import
    inside a function only defers something heavy on purpose, and says so in a few words)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        type_only = _type_only(tree)
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(f):
                if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in type_only:
                    continue
                mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if mod and mod.startswith("echo_plan") and not any(
                        "#" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return sorted(set(found))


def test_an_import_inside_a_function_says_why():
    assert unexplained_function_imports() == []


def test_the_check_finds_an_unexplained_function_import(tmp_path):
    pkg = tmp_path / "echo_plan"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from echo_plan.b import g  # deferred: loads torch\n\n\n"
                              "def h():\n    from echo_plan.b import g\n")
    assert unexplained_function_imports(pkg) == ["echo_plan/a.py:6"]
