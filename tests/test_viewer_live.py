"""The live viewer's trainer-side contract: cheap between refreshes, publishes on refresh steps,
a pause never holds training once no browser is left, and `fit --viewer` trains as without it."""

from __future__ import annotations

import math
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("viser")

from cli_util import assert_one_error, call_cli, run_cli  # noqa: E402

from gstrain.config import build_config  # noqa: E402
from gstrain.data.colmap import load_scene  # noqa: E402
from gstrain.model import init_gaussians  # noqa: E402
from gstrain.render import Renderer  # noqa: E402
from gstrain.viewer.convert import wxyz_of  # noqa: E402
from gstrain.viewer.live import LiveViewer  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_live_viewer_publishes_on_refresh_steps_only(demo_scene):
    scene = load_scene(demo_scene)
    cfg = build_config(overrides=[{"viewer": {"port": _free_port(), "refresh_every": 5}}])
    params = init_gaussians(scene.points, scene.point_colors, sh_degree=1)
    viewer = LiveViewer(cfg, scene, log=lambda _m: None)
    try:
        viewer.on_step(3, params, torch.tensor(0.5), None)
        time.sleep(0.3)
        assert "step 3" not in viewer.page.info.content
        viewer.on_step(5, params, torch.tensor(0.25), torch.tensor(21.5))
        assert _wait_for(lambda: "step 5" in viewer.page.info.content), viewer.page.info.content
        text = viewer.page.info.content
        assert f"{len(scene.points)} Gaussians" in text and "0.2500" in text and "21.50 dB" in text
        # the copy handed over is the host's own: later in-place updates on the trainer side do not reach it
        with torch.no_grad():
            params["means"].add_(1.0)
        assert not torch.equal(viewer.page._params["means"], params["means"].detach())

        # the render toggle's image for a browser camera placed on a test view equals our renderer's
        # image of that view (DC colour: the live copy leaves the SH rest behind)
        view = scene.test[0]
        R = view.viewmat[:3, :3].double().numpy().T
        camera = SimpleNamespace(
            wxyz=wxyz_of(R), position=R @ -view.viewmat[:3, 3].double().numpy(),
            fov=2 * math.atan(0.5 * view.height / float(view.K[1, 1])),
            image_width=view.width, image_height=view.height,
        )
        got = viewer.page.render_for(camera)
        dc = {k: v.detach() for k, v in params.items()}
        dc["means"] = dc["means"] - 1.0  # undo the in-place change above: the copy was taken before it
        dc["shN"] = dc["shN"][:, :0]
        want, _, _ = Renderer(cfg.render, torch.device("cpu"))(dc, view.viewmat, view.K, view.width, view.height, 0,
                                                               torch.zeros(3))
        want = (want.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
        assert got.shape == want.shape
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1

        viewer._set_running(False)  # the pause button, with no browser connected
        done = threading.Event()
        threading.Thread(target=lambda: (viewer.wait_if_paused(), done.set()), daemon=True).start()
        assert done.wait(5), "a pause with no browser connected must not hold training"
        assert not viewer.paused
    finally:
        viewer.close()


def test_fit_viewer_trains_and_rejects_busy_port(demo_scene, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = call_cli("fit", demo_scene, "--out", tmp_path / "bad", "--steps", "2", "--device", "cpu",
                             "--viewer", "--set", f"viewer.port={port}")
        assert_one_error(code, err, "cannot listen")
        assert not (tmp_path / "bad").exists()
    proc = run_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "10", "--device", "cpu", "--viewer",
                   "--set", f"viewer.port={_free_port()}", "--set", "viewer.refresh_every=5",
                   "--set", "log.eval_steps=[10]", "--set", "log.save_steps=[10]")
    assert proc.returncode == 0, proc.stderr
    assert "live viewer at http://127.0.0.1:" in proc.stderr
    assert (tmp_path / "run" / "train_summary.json").is_file()
