"""The order `make test` runs the files in (conftest.py): files holding a `slow` test first, and
xdist keeps that order instead of queueing files by their number of tests (which put the
one-test files of the longest runs last, one behind the other on a worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collected(*files: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line.split("::")[0] for line in proc.stdout.splitlines() if "::" in line]


def test_a_file_with_a_slow_test_is_collected_before_files_without_one():
    # named last, the slow-marked file (one test) must come first; the others keep the given order
    quick, other, slow = "tests/test_choices_owner.py", "tests/test_allocator.py", "tests/test_pose_refine_frozen.py"
    files = _collected(quick, other, slow)
    order = [f for i, f in enumerate(files) if i == 0 or files[i - 1] != f]
    assert order == [slow, quick, other], files


def test_xdist_keeps_the_collected_order(request):
    if not hasattr(request.config.option, "loadscopereorder"):
        pytest.skip("pytest-xdist is not loaded")
    assert request.config.option.loadscopereorder is False
