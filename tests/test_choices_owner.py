"""Each list of allowed values has one owner, gstrain/choices.py: no other module of gstrain/ or
bench/ spells one of its lists out again (as a tuple, list or set of the same strings), where it
could drift from the owner's. Tests may, to state a known answer."""

from __future__ import annotations

import ast
from pathlib import Path

from gstrain import choices

ROOT = Path(__file__).resolve().parents[1]


def owned_lists() -> dict[frozenset[str], str]:
    return {frozenset(v): k for k, v in vars(choices).items() if k.isupper() and isinstance(v, tuple)}


def string_collections(path: Path) -> list[tuple[int, frozenset[str]]]:
    """(line, strings) of every tuple, list or set literal of two or more string constants."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
        ):
            found.append((node.lineno, frozenset(e.value for e in node.elts)))
    return found


def copies_of_owned_lists(files: list[Path], owned: dict[frozenset[str], str]) -> list[str]:
    return [f"{f.relative_to(ROOT)}:{line} repeats choices.{owned[values]}"
            for f in files for line, values in string_collections(f) if values in owned]  # fmt: skip


def test_choices_are_spelled_out_only_by_their_owner() -> None:
    owned = owned_lists()
    assert {"ATOMIC_MODES", "PARTITIONS", "BACKENDS", "EXPORT_FORMATS"} <= set(owned.values())
    files = [p for d in ("gstrain", "bench") for p in sorted((ROOT / d).rglob("*.py"))
             if p != ROOT / "gstrain" / "choices.py" and "tests" not in p.relative_to(ROOT).parts]  # fmt: skip
    assert len(files) > 50
    copies = copies_of_owned_lists(files, owned)
    assert copies == [], "; ".join(copies)


def test_a_copy_is_found(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text('MODES = ("warp", "arc", "atomic", "distwar")\nOTHER = ["arc", "warp"]\n')
    found = string_collections(module)
    assert found == [(1, frozenset(choices.ATOMIC_MODES)), (2, frozenset({"arc", "warp"}))]
    assert [owned_lists()[v] for _, v in found if v in owned_lists()] == ["ATOMIC_MODES"]
