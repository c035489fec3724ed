"""data.images_on=disk's decode worker processes (gstrain/data/decoders.py): what a user relies on
beyond the bytes (which tests/test_image_store.py compares with resident images): a worker that
dies is one line, Ctrl-C does not kill the workers (the training process saves first), closing
the store ends them, and a worker starts without torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_data_colmap import write_scene

from gstrain.data.colmap import load_scene
from gstrain.data.decoders import ProcessDecoder
from gstrain.data.image_store import DiskStore
from gstrain.errors import UserError

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lazy_scene(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("decode_scene")
    write_scene(root, n_images=4, ext=".jpg")
    return load_scene(root, test_every=0), load_scene(root, test_every=0, lazy=True)


def _store(lazy, workers: int = 1) -> DiskStore:
    store = DiskStore(lazy.train, CPU, workers=workers, depth=2)
    assert isinstance(store.decoder, ProcessDecoder)
    return store


def test_a_killed_worker_is_one_user_error(lazy_scene) -> None:
    _, lazy = lazy_scene
    store = _store(lazy)
    (worker,) = store.decoder.workers
    worker.kill()
    worker.wait()
    try:
        with pytest.raises(UserError, match="image decode process exited with code -9") as caught:
            store.get(0)
        assert "\n" not in str(caught.value)
    finally:
        store.close()


def test_workers_ignore_ctrl_c_and_keep_decoding(lazy_scene) -> None:
    eager, lazy = lazy_scene
    store = _store(lazy, workers=2)
    try:
        assert torch.equal(store.get(0), eager.train[0].image)
        time.sleep(1.0)  # both workers past their start (a signal there would meet the default handler)
        for worker in store.decoder.workers:
            os.kill(worker.pid, signal.SIGINT)
        time.sleep(0.2)
        assert all(worker.poll() is None for worker in store.decoder.workers)
        for idx in (1, 2, 3):
            assert torch.equal(store.get(idx), eager.train[idx].image)
    finally:
        store.close()


def test_closing_the_store_ends_its_workers(lazy_scene) -> None:
    eager, lazy = lazy_scene
    store = _store(lazy, workers=2)
    workers = list(store.decoder.workers)
    store.prefetch([0, 1, 2, 3])
    assert torch.equal(store.get(1), eager.train[1].image)
    store.close()  # decodes still pending: the workers finish or drop them and exit
    assert all(worker.poll() is not None for worker in workers)
    assert all(worker.returncode == 0 for worker in workers)
    store.close()  # twice is harmless


def test_a_worker_starts_without_torch() -> None:
    code = "import sys, gstrain.data.decode_worker; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))  # fmt: skip
    assert out.stdout.strip() == "False"


def test_a_store_dropped_without_close_still_ends_its_workers(lazy_scene) -> None:
    """An error that leaves the training loop skips close(): once the store is garbage, its
    workers see the request pipe end and exit."""
    import gc

    _, lazy = lazy_scene
    store = _store(lazy, workers=2)
    workers = list(store.decoder.workers)
    store.get(0)
    del store
    gc.collect()
    for worker in workers:
        assert worker.wait(10) == 0
