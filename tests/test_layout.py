"""The layout's import rules, read from the source: which package may import which, and no cycles.

docs/architecture.md, "Layout and import direction": daemon → engine, storage, consent, kernels;
engine → consent, storage, kernels; storage and consent import neither each other nor anything
above them; kernels import nothing of ours; only tests import tests. Every import counts, including
those inside functions and under `TYPE_CHECKING`: a cycle deferred to run time is still a cycle to
a reader.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("daemon", "engine", "storage", "consent", "kernels")
OURS = (*PRODUCT, "benchmarks", "tests")
MAY_IMPORT = {
    "daemon": {"daemon", "engine", "storage", "consent", "kernels"},
    "engine": {"engine", "consent", "storage", "kernels"},
    "storage": {"storage"},
    "consent": {"consent"},
    "kernels": {"kernels"},
    "benchmarks": {"benchmarks", *PRODUCT},
    "tests": set(OURS),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST) -> Iterator[str]:
    """Every module of ours that `tree` imports, as a dotted name (`from a import b` yields `a.b` too,
    since `b` may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] in OURS)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in OURS:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    files = [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]
    modules = {module_name(p): p for p in files}
    return {name: {m for m in imported(ast.parse(path.read_text())) if m in modules and m != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_run_one_way(package: str) -> None:
    wrong = sorted(f"{name} imports {target}" for name, targets in import_graph(OURS).items()
                   if name.split(".")[0] == package for target in targets
                   if target.split(".")[0] not in MAY_IMPORT[package])
    assert wrong == []


def test_no_import_cycle() -> None:
    assert cycles(import_graph(OURS)) == []


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
