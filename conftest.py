"""Test setup shared by tests/ and bench/tests/ (here at the root, so that neither imports the
other): the `cuda` marker skips cleanly where no GPU is present, and the scenes tests read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# gstrain eval fetches LPIPS weights on first use; tests never download (subprocesses inherit this)
os.environ["GSTRAIN_OFFLINE"] = "1"

REPO_ROOT = Path(__file__).resolve().parent
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_configure(config: pytest.Config) -> None:
    # `make test` hands whole files to two workers (--dist loadfile). By default xdist queues the
    # files by their number of tests, which put the one-test files of the longest known-answer
    # runs at the very end, one behind the other; the order of the items below is kept instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Files holding a `slow` test first (stable: collection order otherwise), so that the
    workers start with the long ones and the many short files even out the end of the run."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_tests.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="session")
def demo_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated COLMAP scene on disk, shared by the tests that only read it."""
    from gstrain.data.demo import write_demo_scene

    out = tmp_path_factory.mktemp("demo") / "scene"
    write_demo_scene(out, n_views=16, width=64, height=64, seed=0)
    return out


@pytest.fixture(scope="session")
def beer_scene() -> Path:
    path = SHARED_DATA / "beer"
    if not path.is_dir():
        pytest.skip("../shared/data/beer is not present on this machine")
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, demo_scene: Path) -> Path:
    """A 4-step run of the 64 px demo scene with checkpoints at steps 2 and 4 (one per test module)."""
    from cli_util import fit_tiny_run

    return fit_tiny_run(tmp_path_factory.mktemp("tiny") / "run", demo_scene)


@pytest.fixture
def run_copy(tiny_run: Path, tmp_path: Path) -> Path:
    """A copy of tiny_run, for a test that damages or overwrites its files."""
    from cli_util import copy_run

    return copy_run(tiny_run, tmp_path)
