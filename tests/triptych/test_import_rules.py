"""Import rules of the house (BRIEF, DESIGN.md), read from the source tree with `ast`:

- the router imports no torch/transformers and nothing from worker/engine or worker/models,
  neither directly (anywhere in a router file, lazy imports included) nor through the
  module-level imports of what it imports;
- the operator imports nothing from the worker's engine (same two checks);
- no import cycles among triptych modules (module-level imports: the ones that run at import).

tests/router/test_router_imports.py complements this at run time (a served request loads no
torch). The folders are mapped to import names by setup.py's ROOTS, read here, not copied.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "torchvision")
ENGINE = ("triptych.worker.engine", "triptych.worker.models")


def package_roots(setup_py: Path) -> dict[str, str]:
    """setup.py's ROOTS literal: import name -> folder."""
    for node in ast.parse(setup_py.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROOTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    top_level: set[str] = field(default_factory=set)  # imported when the module is imported
    anywhere: set[str] = field(default_factory=set)  # any import statement, lazy ones too


def _modules(root: Path, roots: dict[str, str]) -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package, folder in roots.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            found[name] = Module(name, path, is_package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, module: Module, *, top: bool) -> Iterator[tuple[str, bool]]:
    """(imported module name, runs at import time) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if isinstance(child, ast.If) and _is_type_checking(child):
            lazy = True
        if isinstance(child, ast.Import):
            for alias in child.names:
                yield alias.name, top
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: resolve against the importing module's package
                package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
                package = package[: len(package) - (child.level - 1)]
                base = ".".join([*package, base] if base else package)
            yield base, top
            for alias in child.names:  # `from pkg import mod` imports pkg.mod when it is a module
                yield f"{base}.{alias.name}", top
        yield from _imports(child, module, top=top and not lazy)


def load(root: Path) -> dict[str, Module]:
    modules = _modules(root, package_roots(root / "setup.py"))
    for module in modules.values():
        for name, top in _imports(ast.parse(module.path.read_text()), module, top=True):
            if name.startswith("triptych.") and name not in modules and name.rpartition(".")[0] in modules:
                continue  # `from triptych.x import function`: the module is recorded separately
            module.anywhere.add(name)
            if top:
                module.top_level.add(name)
    return modules


def _hits(name: str, banned: Iterable[str]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


def _ancestors(name: str, modules: dict[str, Module]) -> list[str]:
    """Importing a.b.c runs a/__init__ and a.b/__init__ first."""
    parts = name.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in modules]


def reach(start: str, modules: dict[str, Module]) -> dict[str, list[str]]:
    """Every module (triptych or third-party) imported at import time of `start`, with a path."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        current = todo.pop()
        module = modules.get(current)
        if module is None:
            continue
        for name in sorted(module.top_level):
            for target in (*_ancestors(name, modules), name):
                if target not in paths:
                    paths[target] = [*paths[current], target]
                    todo.append(target)
    return paths


def violations(modules: dict[str, Module], prefix: str, banned: tuple[str, ...]) -> list[str]:
    found = []
    for name, module in sorted(modules.items()):
        if not _hits(name, (prefix,)):
            continue
        found += [f"{name} imports {imp}" for imp in sorted(module.anywhere) if _hits(imp, banned)]
        found += [f"{name} reaches {target} via {' -> '.join(path)}"
                  for target, path in sorted(reach(name, modules).items()) if _hits(target, banned)]
    return found


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), over top-level imports."""
    graph = {n: sorted(i for i in m.top_level if i in modules and i != n) for n, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


@pytest.fixture(scope="module")
def tree() -> dict[str, Module]:
    return load(ROOT)


def test_the_tree_is_read(tree: dict[str, Module]) -> None:
    names = set(tree)
    assert {"triptych.router.main", "triptych.operator.reconcile", "triptych.kube.names",
            "triptych.worker.engine.engine"} <= names
    assert "triptych.kube.names" in tree["triptych.router.k8s_discovery"].top_level


def test_router_imports_no_torch_and_no_engine(tree: dict[str, Module]) -> None:
    assert violations(tree, "triptych.router", HEAVY + ENGINE) == []


def test_operator_imports_nothing_from_the_engine(tree: dict[str, Module]) -> None:
    assert violations(tree, "triptych.operator", ("triptych.worker.engine",)) == []


def test_no_import_cycles(tree: dict[str, Module]) -> None:
    assert cycles(tree) == []


def test_the_rules_catch_violations(tmp_path: Path) -> None:
    """The checker itself: a router file that lazily imports torch, one that reaches the
    engine through a helper, and a two-module cycle are all reported."""
    (tmp_path / "setup.py").write_text('ROOTS = {"triptych": "triptych", "triptych.router": "router", '
                                       '"triptych.worker": "worker"}\n')
    files = {
        "triptych/helper.py": "from triptych.worker.engine import engine\n",
        "triptych/a.py": "from triptych import b\n",
        "triptych/b.py": "from . import a\n",
        "router/lazy.py": "def f():\n    import torch\n",
        "router/via.py": "from triptych.helper import thing\n",
        "router/typing_only.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
        "worker/engine/__init__.py": "",
        "worker/engine/engine.py": "import torch\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = load(tmp_path)
    found = violations(modules, "triptych.router", HEAVY + ENGINE)
    assert "triptych.router.lazy imports torch" in found
    assert any(v.startswith("triptych.router.via reaches triptych.worker.engine via") for v in found)
    assert any(v.startswith("triptych.router.via reaches torch via") for v in found)
    assert "triptych.router.typing_only imports torch" in found  # even type-only: keep the router clean
    assert not any(v.startswith("triptych.router.typing_only reaches") for v in found)
    assert cycles(modules) == [["triptych.a", "triptych.b"]]


def test_no_component_module_outgrows_450_lines() -> None:
    """One concept per module (issue 13): nothing in worker/, router/ or operator/ over 450 lines."""
    too_long = {str(p.relative_to(ROOT)): n for folder in ("worker", "router", "operator")
                for p in (ROOT / folder).rglob("*.py")
                if (n := len(p.read_text().splitlines())) > 450}
    assert not too_long, too_long
