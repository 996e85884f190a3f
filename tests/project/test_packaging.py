"""Packaging: one version string, and a type stub for ``dpvr._C`` that matches the compiled bindings.

pybind11 functions carry no introspectable signature, so the stub is checked against the signature line that
pybind11 writes at the top of each docstring: same names, same positional parameters, same types.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

import pytest

import dpvr
from dpvr import _C

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(dpvr.__file__).with_name("_C.pyi")

# pybind11's spellings of the stub's types (3.x accepts int- and float-like objects; 2.x says list[...]).
RUNTIME_SPELLINGS = [
    (r"typing\.SupportsInt \| typing\.SupportsIndex|typing\.SupportsInt", "int"),
    (r"typing\.SupportsFloat \| typing\.SupportsIndex|typing\.SupportsFloat", "float"),
    (r"collections\.abc\.Sequence\[|\blist\[", "Sequence["),
]


def stub_module() -> ast.Module:
    return ast.parse(STUB.read_text())


def stub_signatures() -> dict[str, list[str]]:
    """name -> annotations of the positional parameters and of the return, private aliases expanded."""
    module = stub_module()
    aliases = {
        node.target.id: node.value
        for node in module.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None
    }

    class Expand(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            return self.visit(aliases[node.id]) if node.id in aliases else node

    def spelled(annotation: ast.expr | None) -> str:
        assert annotation is not None, "every parameter and return of the stub is annotated"
        return ast.unparse(Expand().visit(annotation))

    return {
        f.name: [spelled(a.annotation) for a in f.args.posonlyargs + f.args.args] + [spelled(f.returns)]
        for f in module.body
        if isinstance(f, ast.FunctionDef)
    }


def runtime_signature(function: object) -> list[str]:
    """The annotations of pybind11's docstring signature, in the stub's spelling."""
    line = inspect.getdoc(function).splitlines()[0]
    for pattern, replacement in RUNTIME_SPELLINGS:
        line = re.sub(pattern, replacement, line)
    f = ast.parse(f"def {line}: ...").body[0]
    assert isinstance(f, ast.FunctionDef)
    return [ast.unparse(a.annotation) for a in f.args.args] + [ast.unparse(f.returns)]


def test_version_is_the_one_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dpvr.__version__ == importlib.metadata.version("dpvr") == declared


def test_no_other_version_literal_in_the_package():
    literal = f'"{dpvr.__version__}"'
    sources = sorted(Path(dpvr.__file__).parent.rglob("*.py"))
    assert sources
    assert [p.name for p in sources if literal in p.read_text()] == []


def test_stub_names_are_the_extension_names():
    stubbed = {
        node.name
        for node in stub_module().body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }
    public = {name for name in dir(_C) if not name.startswith("_")}
    assert stubbed == public


@pytest.mark.parametrize("name", sorted(stub_signatures()))
def test_stub_signature_matches_the_binding(name):
    stub = stub_signatures()[name]
    assert stub == runtime_signature(getattr(_C, name)), f"dpvr/_C.pyi: {name}"


def test_stub_exception_bases():
    classes = {node.name: node for node in stub_module().body if isinstance(node, ast.ClassDef)}
    assert classes
    for name, node in classes.items():
        assert [ast.unparse(b) for b in node.bases] == [b.__name__ for b in getattr(_C, name).__bases__]


def test_package_is_marked_typed():
    assert STUB.with_name("py.typed").is_file()


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower() for r in requirements}


# Import name -> distribution name, where they differ.
_DISTRIBUTIONS = {"attr": "attrs", "dp_accounting": "dp-accounting"}
# Modules that import an optional package at their top and are themselves imported only when it is in use.
_OPTIONAL_AT_TOP = {"transformers": ["grads/ghost/huggingface.py"]}  # when a model holds a transformers layer


def _module_level_imports(tree: ast.Module) -> set[str]:
    """Top-level names imported outside functions (imports inside functions are the optional, lazy ones)."""
    names: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return names


def test_the_hard_dependencies_are_the_librarys_own():
    """``pip install dpvr`` pulls the numerics, torch, the accountant and the hashing, and nothing for the
    experiments: matplotlib and scikit-learn belong to dpvr-lab (lab/) and to extras."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _requirement_names(project["dependencies"]) == {
        "numpy", "torch", "scipy", "dp-accounting", "attrs", "blake3", "tqdm"}
    assert _requirement_names(project["optional-dependencies"]["datasets"]) == {"scikit-learn"}
    assert _requirement_names(project["optional-dependencies"]["plot"]) == {"matplotlib"}
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())
    assert lab["project"]["name"] == "dpvr-lab"
    assert _requirement_names(lab["project"]["dependencies"]) == {"dpvr", "matplotlib", "scikit-learn"}
    assert lab["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == ["dpvr_lab"]


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is new in Python 3.10")
def test_every_module_level_import_of_the_library_is_a_declared_dependency():
    """What the package imports when it is imported is declared in its dependencies (a transitive one
    included, such as attrs): an import that only works because something else pulled it in fails here."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    found: dict[str, list[str]] = {}
    for source in sorted((ROOT / "python" / "dpvr").rglob("*.py")):
        for name in _module_level_imports(ast.parse(source.read_text(encoding="utf-8"))):
            if name not in sys.stdlib_module_names and name not in ("dpvr", "__future__"):
                where = source.relative_to(ROOT / "python" / "dpvr").as_posix()
                found.setdefault(_DISTRIBUTIONS.get(name, name), []).append(where)
    assert {"numpy", "torch", "dp-accounting"} <= set(found)
    assert {name: files for name, files in found.items() if name not in declared} == _OPTIONAL_AT_TOP
