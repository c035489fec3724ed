"""`gstrain view` in a real browser: headless Chromium (Debian's) through Playwright.

Trains a tiny demo run with the CLI, serves it, and checks the screenshot against the run's own
test image: where the object is, the page must show the object's colours with the Gaussians on,
and not with them hidden (the empty scene).
"""

from __future__ import annotations

import io
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_util import assert_user_error, run_cli
from PIL import Image

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
# As root in a container: no sandbox; no GPU, so WebGL runs on SwiftShader (Chromium's default then).
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1600, "height": 600}  # the 3D view's square is x 500..1100: clear of the panels


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("viewer")
    proc = run_cli("demo-scene", root / "scene", "--views", "8", "--size", "64")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "fit", root / "scene", "--out", root / "run", "--steps", "40", "--device", "cpu",
        "--set", "model.sh_degree=1", "--set", "log.eval_steps=[40]", "--set", "log.save_steps=[40]",
    )
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def _start_view(run: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gstrain", "view", str(run), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("gstrain view did not start listening within 30 s")


def _object_error(shot: np.ndarray, truth: np.ndarray, mask: np.ndarray) -> float:
    """Mean |screenshot - test image| over the object's pixels, the view's square brought to 64x64."""
    h = shot.shape[0]
    x0 = (shot.shape[1] - h) // 2
    square = Image.fromarray(shot[:, x0:x0 + h, :3]).resize(truth.shape[1::-1], Image.BOX)
    return float(np.abs(np.asarray(square, np.float64) / 255 - truth)[mask].mean())


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_view_draws_the_scene_in_chromium(trained_run, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip, dev extras)")
    truth = np.asarray(Image.open(trained_run.parent / "scene" / "images" / "000.png").convert("RGB"), np.float64) / 255
    mask = truth.max(axis=2) > 0.25  # the lit sphere and disc; the demo's background is black
    mask[[0, -1], :] = mask[:, [0, -1]] = False
    assert mask.mean() > 0.2
    port = _free_port()
    server = _start_view(trained_run, port)
    try:
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(  # a new, empty --user-data-dir
                tmp_path / "profile", executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, viewport=VIEWPORT
            )
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_text("Gaussians", exact=False).first.wait_for(timeout=30_000)
            shot_path = tmp_path / "view.png"
            error_on = 1.0
            deadline = time.monotonic() + 30  # SwiftShader needs a few frames to sort and draw the splats
            while time.monotonic() < deadline and error_on > 0.15:
                page.wait_for_timeout(1000)
                shot = np.asarray(Image.open(io.BytesIO(page.screenshot(path=str(shot_path)))))
                error_on = _object_error(shot, truth, mask)
            page.get_by_label("Show Gaussians").uncheck()
            page.wait_for_timeout(2000)
            empty_path = tmp_path / "empty.png"
            page.screenshot(path=str(empty_path))
            empty = np.asarray(Image.open(empty_path))
            error_off = _object_error(empty, truth, mask)
            # the "render" toggle: our own renderer's image of the browser's view, as the background
            page.get_by_label("Render (gstrain)").check()
            render_path = tmp_path / "render.png"
            error_render = 1.0
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and error_render > 0.15:
                page.wait_for_timeout(1000)
                rendered = np.asarray(Image.open(io.BytesIO(page.screenshot(path=str(render_path)))))
                error_render = _object_error(rendered, truth, mask)
            browser.close()
    finally:
        server.terminate()
        _out, err = server.communicate(timeout=20)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot_path, ARTIFACTS / "viewer_chromium.png")
    shutil.copy(empty_path, ARTIFACTS / "viewer_chromium_empty.png")
    shutil.copy(render_path, ARTIFACTS / "viewer_chromium_render_toggle.png")
    assert error_on < 0.15, f"the Gaussians do not show the object (error {error_on:.3f}); see {shot_path}"
    assert error_off > error_on + 0.2, (error_on, error_off)
    assert np.abs(shot.astype(int) - empty.astype(int)).mean() > 5
    assert error_render < 0.15, f"the render toggle does not show our render (error {error_render:.3f})"
    assert server.returncode == 0 and err.strip().splitlines()[-1] == "gstrain: viewer stopped", err


def test_view_bad_input(tmp_path, trained_run):
    assert_user_error(run_cli("view", tmp_path, "--port", str(_free_port())), "not a gstrain run")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert_user_error(run_cli("view", trained_run, "--port", str(busy.getsockname()[1])), "cannot listen")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_fit_viewer_pause_and_resume_in_chromium(trained_run, tmp_path):
    """The page's pause button holds training between steps, and resume lets it go on."""
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip, dev extras)")
    port = _free_port()
    fit = subprocess.Popen(
        [sys.executable, "-m", "gstrain", "fit", str(trained_run.parent / "scene"), "--out", str(tmp_path / "run"),
         "--steps", "5000", "--device", "cpu", "--viewer", "--set", f"viewer.port={port}",
         "--set", "viewer.refresh_every=2", "--set", "model.sh_degree=0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    step_re = re.compile(r"^step (\d+)$")

    def shown_step(page) -> int:
        return int(step_re.match(page.get_by_text(step_re).first.inner_text().strip()).group(1))

    try:
        deadline = time.monotonic() + 60
        while True:  # the fit loads the scene first, then opens the port
            assert fit.poll() is None and time.monotonic() < deadline, fit.communicate()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.3)
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(
                tmp_path / "profile", executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, viewport=VIEWPORT
            )
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_text(step_re).first.wait_for(timeout=30_000)
            page.get_by_role("button", name="Pause training").click()
            page.get_by_role("button", name="Resume training").wait_for(timeout=10_000)
            page.wait_for_timeout(1000)  # a refresh in flight may still land
            paused_at = shown_step(page)
            page.wait_for_timeout(2000)
            assert shown_step(page) == paused_at, "training went on while paused"
            page.get_by_role("button", name="Resume training").click()
            page.wait_for_function(
                f"() => /step (\\d+)/.exec(document.body.innerText) && "
                f"+/step (\\d+)/.exec(document.body.innerText)[1] > {paused_at}", timeout=20_000,
            )
            page.screenshot(path=str(tmp_path / "live.png"))
            browser.close()
    finally:
        fit.send_signal(signal.SIGINT)
        fit.communicate(timeout=60)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "live.png", ARTIFACTS / "viewer_live_chromium.png")
