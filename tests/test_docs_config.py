"""docs/config.md's tables name every config key (user and dev) with its default, and no other key."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import yaml

from gstrain.config import Config, _Loader

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _documented() -> dict[str, str]:
    """{'section.key': default cell text} from every table row whose first cell names keys in
    backticks; `a.x`, `y` names a.x and a.y, with the defaults given in the same order."""
    out: dict[str, str] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("key", "---"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        if not names or "." not in names[0]:
            continue
        section = names[0].split(".")[0]
        keys = [n if "." in n else f"{section}.{n}" for n in names]
        defaults = [cells[1]] if len(keys) == 1 else [d.strip() for d in cells[1].split(", ")]
        assert len(defaults) == len(keys), f"docs/config.md: {cells[0]} has defaults {cells[1]!r}"
        for key, default in zip(keys, defaults, strict=True):
            assert key not in out, f"docs/config.md lists {key} twice"
            out[key] = default
    return out


def _actual() -> dict[str, object]:
    cfg = Config()
    return {
        f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
        for section in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, section.name))
    }


def test_every_key_is_documented_and_no_other() -> None:
    documented, actual = set(_documented()), set(_actual())
    assert not actual - documented, f"missing from docs/config.md: {sorted(actual - documented)}"
    assert not documented - actual, f"unknown keys in docs/config.md: {sorted(documented - actual)}"


def _same(doc_value: object, value: object) -> bool:
    if isinstance(value, list):
        return isinstance(doc_value, list) and len(doc_value) == len(value) and all(
            _same(a, b) for a, b in zip(doc_value, value, strict=True)
        )
    if isinstance(value, bool) or isinstance(value, str):
        return doc_value == value
    return isinstance(doc_value, (int, float)) and math.isclose(doc_value, value, rel_tol=1e-9)


def test_documented_defaults_match_the_dataclasses() -> None:
    actual = _actual()
    wrong = {
        key: (text, actual[key])
        for key, text in _documented().items()
        if key in actual and not _same(yaml.load(text, Loader=_Loader), actual[key])
    }
    assert not wrong, f"docs/config.md defaults differ from the code: {wrong}"
