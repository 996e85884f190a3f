"""No import circle among dpvr's modules, imports inside functions included.

The graph is read from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every import
statement of module ``a`` anywhere in its file (module level, inside functions or classes, under ``if
TYPE_CHECKING``) that names ``b``. ``from p import n`` is an edge to ``p.n`` when that is a module, else to
``p``; importing ``p.q.r`` also executes the packages ``p`` and ``p.q``, so those are edges too, except
the importer's own enclosing packages (already being imported when it runs). A circle hidden by an import
inside a function still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import dpvr

ROOT = Path(dpvr.__file__).resolve().parent

#: Circles outside dpvr.privacy found when this test was written, each a sorted tuple of its modules; the
#: test fails on any other circle, and on one of these that is gone (so the list only ever shrinks).
KNOWN: set[tuple[str, ...]] = set()


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package at ``root`` (by dotted name) -> the package's modules it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own = set(_ancestors(name))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import dpvr.x.y as z` of a name, not a module
                    target = target.rpartition(".")[0]
                for reached in (*_ancestors(target), target):
                    if reached in modules and reached != name and reached not in own:
                        graph[name].add(reached)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_graph_finds_circles_through_functions_and_packages(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .a import x\n    return x\n",  # the circle a -> b -> a, hidden in f
        "c.py": "import pkg.sub.d\n",  # executes pkg/sub/__init__.py, which imports c: a circle
        "sub/__init__.py": "from .. import c\n",
        "sub/d.py": "from . import e\n",  # its own package is not an edge
        "sub/e.py": "",
        "f.py": "from .a import b\n",  # a name of a, not a circle
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.sub.d"] == {"pkg.sub.e"}
    assert cycles(graph) == [("pkg.a", "pkg.b"), ("pkg.c", "pkg.sub")]


def test_the_old_privacy_circle_would_be_found():
    # The circle issue 45 found (accountant -> backends -> accountant, calibration -> backends -> calibration,
    # the backends' edges inside methods), rebuilt as a graph: it is one component.
    graph = {
        "accountant": {"backends"},
        "backends": {"relations"},
        "calibration": {"accountant", "backends"},
        "relations": set(),
    }
    assert cycles(graph) == []
    graph["backends"] |= {"accountant", "calibration"}  # the imports inside PldBackend.compose/calibrate
    assert cycles(graph) == [("accountant", "backends", "calibration")]


def test_no_import_circle_in_privacy():
    circles = [c for c in cycles(import_graph()) if any(m.startswith("dpvr.privacy") for m in c)]
    assert circles == [], f"import circles through dpvr.privacy: {circles}"


def test_no_new_import_circle_in_the_package():
    circles = set(cycles(import_graph()))
    assert circles - KNOWN == set(), f"new import circles: {sorted(circles - KNOWN)}"
    assert KNOWN - circles == set(), f"circles gone (remove them from KNOWN): {sorted(KNOWN - circles)}"
