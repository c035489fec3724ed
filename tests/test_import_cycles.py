"""gstrain/ has no import cycle, counting the imports inside functions too.

A lazy import only moves a cycle from start-up to the first call; it still ties the two modules
together. The graph is read from the source with `ast` (nothing is imported), every gstrain import
resolved to the module it loads, and searched for a cycle, which the failure message spells out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "gstrain"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of `name` that exists (`a.b.func` -> `a.b`); None outside the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run: all of ast.walk but the body of `if TYPE_CHECKING:` (never
    executed, so it loads nothing; its else branch does run)."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports anywhere it can run (top level, functions,
    methods; not `if TYPE_CHECKING:`): `from x import y` counts x.y when y is a submodule, else x, and with
    either the packages above it that Python runs first."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # a relative import counts from the module's package (a package's own __init__ is its package)
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            names = [f"{stem}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None:
                found.update(_loaded_with(target, module, modules))
    return found


def _loaded_with(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """`target` and the packages Python runs first to load it, less the importer's own packages
    (loaded before the importer starts) and the importer itself."""
    parts = target.split(".")
    chain = {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
    importer_parts = importer.split(".")
    own = {".".join(importer_parts[:i]) for i in range(1, len(importer_parts) + 1)}
    return (chain - own) | ({target} - {importer})


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None when the graph is acyclic (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_gstrain_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "gstrain.render.cuda" in graph  # the walk found the package
    groups = all_cycles(graph)
    cycle = find_cycle(graph)
    assert cycle is None, (
        f"import cycle: {' -> '.join(cycle)}; modules tied in cycles: "
        + "; ".join(", ".join(g) for g in groups)
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_finds_a_cycle_through_an_import_inside_a_function(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/sub/__init__.py": "",
        "pkg/b.py": "def f():\n    from .sub import c\n    return c\n",
        "pkg/sub/c.py": "import os\n\ndef g():\n    from ..a import x\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}  # loading pkg.sub.c runs pkg/sub/__init__ first
    assert graph["pkg.sub.c"] == {"pkg.a"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c"}
    assert all_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_an_acyclic_package_passes(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg import a\n",
        "pkg/a.py": "from pkg.b import f\nimport pkg.c\n",
        "pkg/b.py": "from . import c\n",
        "pkg/c.py": "import json\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.c"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert find_cycle(graph) is None and all_cycles(graph) == []


def test_a_package_init_run_on_the_way_closes_a_cycle(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/config.py": "from pkg.sub.names import NAMES\n",
        "pkg/sub/__init__.py": "from pkg.config import X\n",
        "pkg/sub/names.py": "NAMES = ()\n",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.config"] == {"pkg.sub", "pkg.sub.names"}
    assert graph["pkg.sub.names"] == set()  # its own package ran before it
    assert all_cycles(graph) == [["pkg.config", "pkg.sub"]]


def test_type_checking_imports_load_nothing(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    from pkg import b\nelse:\n    import pkg.c\n",
        "pkg/b.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\n",
        "pkg/c.py": "",
    })  # fmt: skip
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.c"} and graph["pkg.b"] == set()
