"""bench/ imports nothing from tests/: a study runs without the test suite on its path, and a test
may change without breaking a study. What both need lives in bench/ (or gstrain/), and tests
import it from there."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def names_of_test_modules(tests_dir: Path) -> set[str]:
    """The names under which a file of tests/ could be imported: `tests` and each module's stem."""
    return {"tests"} | {p.stem for p in tests_dir.glob("*.py")}


def _mentions_tests(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "tests" in n.value
               for n in ast.walk(node))  # fmt: skip


def _is_sys_path(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"  # fmt: skip


def reaches_into_tests(path: Path, tests_modules: set[str]) -> list[str]:
    """What in `path` imports a tests/ module or puts a path naming tests on sys.path."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        found += [f"line {node.lineno}: imports {n}" for n in names if n.split(".")[0] in tests_modules]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_path(node.func.value) \
                and _mentions_tests(node):  # fmt: skip
            found.append(f"line {node.lineno}: sys.path.{node.func.attr} names tests")
        if isinstance(node, (ast.AugAssign, ast.Assign)) and _mentions_tests(node.value) and any(
            _is_sys_path(t) for t in ([node.target] if isinstance(node, ast.AugAssign) else node.targets)
        ):
            found.append(f"line {node.lineno}: sys.path set to a path naming tests")
    return found


def test_no_bench_file_reaches_into_tests() -> None:
    modules = names_of_test_modules(ROOT / "tests")
    files = sorted((ROOT / "bench").rglob("*.py"))
    assert len(files) > 20 and "test_graph_cuda" in modules
    bad = [f"{p.relative_to(ROOT)} {what}" for p in files for what in reaches_into_tests(p, modules)]
    assert bad == [], "; ".join(bad)


def test_each_way_of_reaching_in_is_caught(tmp_path: Path) -> None:
    script = tmp_path / "study.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\n"
        "sys.path.insert(0, str(Path(__file__).parents[1] / 'tests'))\n"
        "import test_graph_cuda as T\n"
        "from tests.cli_util import run_cli\n"
        "sys.path += ['tests']\n"
        "def f():\n    from cuda_scenes import camera\n"
        "import json\nfrom bench.graph_cases import mixed_sizes\nsys.path.insert(0, 'elsewhere')\n"
    )
    found = reaches_into_tests(script, names_of_test_modules(ROOT / "tests"))
    assert sorted(found) == sorted([
        "line 3: sys.path.insert names tests", "line 4: imports test_graph_cuda", "line 5: imports tests.cli_util",
        "line 6: sys.path set to a path naming tests", "line 8: imports cuda_scenes",
    ])  # fmt: skip
