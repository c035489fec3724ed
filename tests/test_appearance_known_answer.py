"""train.appearance's known answer on the demo scene: per-view exposure and white balance are
recovered, and compensation pays under the fitted_half protocol. (In its own file so that the test
runner can give these two 600-step runs a worker of their own beside tests/test_appearance.py.)"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gstrain.data.colmap import load_scene
from gstrain.train.trainer import Trainer
from tests.test_appearance import N_VIEWS, _cfg

GAIN_SEED = 7


def _gains() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(GAIN_SEED)
    return rng.uniform(0.6, 1.4, size=(N_VIEWS, 3)), rng.uniform(0.0, 0.05, size=(N_VIEWS, 3))


def changed_demo_scene(out: Path, size: int, change: Callable[[int, np.ndarray], np.ndarray | None]) -> Path:
    """The demo scene (N_VIEWS views of size x size pixels) with view i's photo replaced by
    change(i, clean photo as float64 in [0, 1]), clipped to [0, 1] (None: the photo kept)."""
    from gstrain.data.demo import write_demo_scene

    write_demo_scene(out, n_views=N_VIEWS, width=size, height=size, seed=0)
    for i in range(N_VIEWS):
        path = out / "images" / f"{i:03d}.png"
        changed = change(i, np.asarray(Image.open(path)).astype(np.float64) / 255.0)
        if changed is not None:
            Image.fromarray((np.clip(changed, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)).save(path)
    return out


@pytest.fixture(scope="module")
def exposed_scene(tmp_path_factory) -> Path:
    """The demo scene with per-view RGB gains in [0.6, 1.4] (on 0.7 of the image, so few pixels
    clip) and a per-view colour offset up to 0.05: the photos of a camera whose exposure and white
    balance change from frame to frame."""
    gains, bias = _gains()
    out = tmp_path_factory.mktemp("exposed") / "scene"
    return changed_demo_scene(out, 64, lambda i, clean: 0.7 * clean * gains[i] + bias[i])


def train_demo(scene_dir: Path, run: Path, appearance: str, steps: int = 600,
               train: dict | None = None) -> tuple[Trainer, dict]:  # fmt: skip
    """A CPU run on a changed demo scene with train.appearance `appearance` (rate 0.01 unless
    `train` says otherwise): the trainer and its train_summary.json."""
    cfg = _cfg({"train": {"steps": steps, "sh_degree_interval": 100, "appearance": appearance,
                          "appearance_lr": 0.01, **(train or {})},
                "strategy": {"refine_start": 100, "refine_every": 100, "reset_every": 100_000}})  # fmt: skip
    scene = load_scene(scene_dir, factor=1, test_every=cfg.data.test_every)
    run.mkdir(parents=True)
    trainer = Trainer(cfg, scene, run, torch.device("cpu"), log=lambda m: None)
    assert trainer.fit().status == "done"
    return trainer, json.loads((run / "train_summary.json").read_text())


@pytest.mark.skipif(os.environ.get("GSTRAIN_SKIP_SLOW") == "1", reason="two 600-step CPU runs (about a minute)")
@pytest.mark.slow
def test_learned_corrections_recover_the_gains_and_raise_test_psnr(exposed_scene, tmp_path):
    with_app, summary_with = train_demo(exposed_scene, tmp_path / "affine", "affine")
    _, summary_without = train_demo(exposed_scene, tmp_path / "none", "none")

    # the gauge: the scene's colours times C and every correction times C^-1 render the same
    # photos, so compare each view's colour matrix with the training views' mean (the gains
    # relative to their mean), as the known gains are compared with theirs
    gains, _ = _gains()
    train_ids = [int(Path(v.name).stem) for v in with_app.scene.train]
    assert len(train_ids) == 14 and 0 not in train_ids  # views 0 and 8 are held out
    matrices = with_app.ctx.corrections[0].table.detach().double()[:, :, :3]
    relative = matrices @ torch.linalg.inv(matrices.mean(0))
    learned = torch.diagonal(relative, dim1=1, dim2=2)
    known = torch.tensor(gains[train_ids])
    known = known / known.mean(0)
    error = (learned - known).abs() / known
    assert torch.median(error) < 0.04, error  # measured: 0.028 median
    # the worst of 42 gains after 600 steps at 64 px: 0.14 measured on earlier CI machines, 0.22 on
    # an AMD EPYC one (0.21 there with MKL_CBWR=COMPATIBLE): MKL's code path for the machine
    # changes the small matmuls' rounding, and the 600-step trajectory carries it that far
    assert error.max() < 0.3, error
    spread = (known.max(0).values / known.min(0).values).min()
    assert spread > 1.5  # the gains differ: recovering them is not the identity's doing

    # test views have no learned correction; under the fitted_half protocol compensation pays
    half_with = summary_with["final_test_psnr_fitted_half"]
    half_without = summary_without["final_test_psnr_fitted_half"]
    assert half_with > half_without + 0.7, (half_with, half_without)  # measured: 30.1 against 28.7 dB
    assert summary_with["test_history"][-1]["psnr_fitted_half"] == half_with
