"""The layout's rules, read from the source and from what is installed: one import name, which package
and which subfolder may import which, no cycles, and written maps that name what exists.

docs/architecture.md, "Layout and import direction": the top-level folders install as subpackages of
one import package, `specloop`; daemon → engine, storage, consent, kernels; engine → consent, storage,
kernels; storage and consent import neither each other nor anything above them; kernels import nothing
of ours; only tests import tests. Inside a package, its subfolders import only those below them
(`SUBFOLDER_ORDER`). Every import counts, including those inside functions and under `TYPE_CHECKING`:
a cycle deferred to run time is still a cycle to a reader.
"""

import ast
import importlib.metadata
import importlib.util
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specloop"
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
# Each package's subfolders, lowest first: a subfolder imports only those before it. A package's own
# top-level modules (`daemon/cli.py`, `daemon/stack.py`) are outside this order; the cycle test covers them.
SUBFOLDER_ORDER = {
    "engine": ("model", "cpu", "loaders", "speculation", "runtime", "server"),
    "daemon": ("evaluation", "training", "traffic", "retrain", "fleet"),
}
PY_REFERENCE = re.compile(r"`([\w./-]+\.py)(?::[\w.]+)?`")


def module_name(path: Path) -> str:
    """The graph's name of a file of the checkout: engine/x.py is `engine.x` (product modules are named
    without the `specloop.` that every import of them starts with)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ours(name: str) -> str | None:
    """`name` as the graph names it when it is a module of ours (`specloop.engine.x` → `engine.x`), else None."""
    first, _, rest = name.partition(".")
    if first == PACKAGE and rest.split(".")[0] in PRODUCT:
        return rest
    return name if first in ("benchmarks", "tests") else None


def top_level_imports(tree: ast.AST) -> Iterator[str]:
    """Every absolute import in `tree`, as written."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def imported(tree: ast.AST) -> Iterator[str]:
    """Every module of ours that `tree` imports, as a graph name (`from a import b` yields `a.b` too,
    since `b` may be a module)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (name for a in node.names if (name := ours(a.name)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (name := ours(node.module)):
            yield name
            yield from (f"{name}.{a.name}" for a in node.names)


def python_files(packages: tuple[str, ...]) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in python_files(packages)}
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


def subfolder(module: str) -> tuple[str, str] | None:
    """(package, subfolder) of a module in a subfolder (`engine.model.x` → ("engine", "model")), else None."""
    parts = module.split(".")
    if len(parts) > 2 and parts[0] in SUBFOLDER_ORDER:
        return parts[0], parts[1]
    if len(parts) == 2 and parts[0] in SUBFOLDER_ORDER and (ROOT / parts[0] / parts[1]).is_dir():
        return parts[0], parts[1]
    return None


def upward_imports(graph: dict[str, set[str]], order: dict[str, tuple[str, ...]]) -> list[str]:
    """Each import of a subfolder from one at or above it in its package's `order`, as a sentence."""
    wrong = []
    for name, targets in graph.items():
        here = subfolder(name)
        for target in targets:
            there = subfolder(target)
            if here and there and here[0] == there[0] and here[1] != there[1]:
                layers = order[here[0]]
                assert here[1] in layers and there[1] in layers, f"{here} or {there} has no place in {layers}"
                if layers.index(there[1]) > layers.index(here[1]):
                    wrong.append(f"{name} imports {target}")
    return sorted(wrong)


def subfolders(package: str) -> set[str]:
    return {p.parent.name for p in (ROOT / package).glob("*/__init__.py")}


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


@pytest.mark.parametrize("package", sorted(SUBFOLDER_ORDER))
def test_every_subfolder_has_its_place(package: str) -> None:
    assert subfolders(package) == set(SUBFOLDER_ORDER[package])


def test_subfolders_import_only_those_below() -> None:
    assert upward_imports(import_graph(OURS), SUBFOLDER_ORDER) == []


def test_an_upward_import_between_subfolders_is_found() -> None:
    graph = {"engine.model.transformer": {"engine.runtime.kv_cache"}, "engine.runtime.kv_cache": set()}
    assert upward_imports(graph, SUBFOLDER_ORDER) == ["engine.model.transformer imports engine.runtime.kv_cache"]


def test_the_product_imports_itself_only_as_specloop() -> None:
    """`import engine` would work in a checkout's root and nowhere else: every import of ours says `specloop.`."""
    bare = sorted(f"{path.relative_to(ROOT)}: {name}" for path in python_files(OURS)
                  for name in top_level_imports(ast.parse(path.read_text())) if name.split(".")[0] in PRODUCT)
    assert bare == []


# -- one import name ---------------------------------------------------------------------------------

def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def top_level_names(packages: list[str]) -> set[str]:
    return {name.split(".")[0] for name in packages}


def test_the_distribution_installs_one_import_name() -> None:
    config = setuptools_config()
    assert top_level_names(config["packages"]) == {PACKAGE}
    assert config["package-dir"] == {f"{PACKAGE}.{folder}": folder for folder in PRODUCT}


def test_a_second_top_level_name_is_found() -> None:
    assert top_level_names(["specloop.engine", "kernels"]) == {"specloop", "kernels"}


def test_the_package_list_names_every_folder_with_an_init() -> None:
    """The list is explicit (a folder cannot be found under another name), so a new subfolder must join it."""
    on_disk = {f"{PACKAGE}.{module_name(p.parent)}" for pkg in PRODUCT for p in (ROOT / pkg).rglob("__init__.py")}
    assert set(setuptools_config()["packages"]) == on_disk


def shared_names(distributions: dict[str, list[str]], ours: str) -> dict[str, list[str]]:
    """The import names that distribution `ours` installs and another installed distribution provides too."""
    return {name: sorted(set(dists) - {ours}) for name, dists in distributions.items()
            if ours in dists and set(dists) - {ours}}


def test_no_installed_distribution_shares_an_import_name_with_specloop() -> None:
    distributions = importlib.metadata.packages_distributions()
    assert [name for name, dists in distributions.items() if "specloop" in dists] == [PACKAGE]
    assert shared_names(distributions, "specloop") == {}


def test_a_shared_import_name_is_found() -> None:
    installed = {"specloop": ["specloop"], "kernels": ["specloop", "kernels"], "numpy": ["numpy"]}
    assert shared_names(installed, "specloop") == {"kernels": ["kernels"]}


def test_installed_packages_are_not_shadowed_by_the_checkout() -> None:
    """Under pytest, `kernels` is Hugging Face's (transformers imports it) or nothing, never our folder."""
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin).parent.resolve() != (ROOT / "kernels").resolve(), spec
    assert Path(importlib.util.find_spec("specloop.kernels").origin).parts[-2:] == ("kernels", "__init__.py")


# -- written maps ------------------------------------------------------------------------------------

def written_texts() -> Iterator[tuple[Path, str]]:
    """Every docstring and comment of our Python files, and every Markdown file of the checkout."""
    for path in python_files(OURS):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if doc := ast.get_docstring(node, clean=False):
                    yield path, doc
        yield path, "\n".join(line[line.index("#"):] for line in source.splitlines() if "#" in line)
    markdown = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *(p for pkg in OURS for p in (ROOT / pkg).rglob("*.md"))]
    for path in sorted(markdown):
        yield path, path.read_text()


def missing_py_references(path: Path, text: str) -> list[str]:
    """Backticked `*.py` paths in `text` that name no file: a path with a folder from the checkout's root
    or from `path`'s folder; a bare file name from `path`'s folder (from anywhere ours, in Markdown)."""
    missing = []
    for ref in PY_REFERENCE.findall(text):
        places = [ROOT / ref, path.parent / ref]
        if "/" not in ref and path.suffix == ".md":
            places += [p for pkg in OURS for p in (ROOT / pkg).rglob(ref)]
        if not any(p.is_file() for p in places):
            missing.append(ref)
    return missing


def test_every_py_path_in_docstrings_and_docs_exists() -> None:
    missing = sorted(f"{path.relative_to(ROOT)}: {ref}" for path, text in written_texts()
                     for ref in missing_py_references(path, text))
    assert missing == []


def test_a_py_path_that_does_not_exist_is_found() -> None:
    text = "the scheduler (`daemon/retrain/scheduler.py`, `run.py`) and `daemon/retrain/nowhere.py:f`"
    assert missing_py_references(ROOT / "daemon/retrain/run.py", text) == ["daemon/retrain/scheduler.py",
                                                                          "daemon/retrain/nowhere.py"]


@pytest.mark.parametrize("package", sorted(SUBFOLDER_ORDER))
def test_package_docstrings_name_every_subfolder(package: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc is not None
    assert sorted(name for name in subfolders(package) if f"`{name}/`" not in doc) == []


def test_the_architecture_layout_table_names_every_subfolder() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:engine|daemon)/\w+)/`", doc))
    assert {f"{package}/{name}" for package in SUBFOLDER_ORDER for name in subfolders(package)} <= named
    assert {n for n in named if not (ROOT / n).is_dir()} == set()
