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
from cli_util import assert_one_error, call_cli
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
    code, err = call_cli("demo-scene", root / "scene", "--views", "8", "--size", "64")
    assert code == 0, err
    code, err = call_cli(
        "fit", root / "scene", "--out", root / "run", "--steps", "40", "--device", "cpu",
        "--set", "model.sh_degree=1", "--set", "log.eval_steps=[40]", "--set", "log.save_steps=[40]",
    )
    assert code == 0, err
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


def _image(scene: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A view's image in [0,1] and its object mask (the demo's background is black)."""
    truth = np.asarray(Image.open(scene / "images" / name).convert("RGB"), np.float64) / 255
    mask = truth.max(axis=2) > 0.25
    mask[[0, -1], :] = mask[:, [0, -1]] = False
    assert mask.mean() > 0.2
    return truth, mask


def _settle(page, path: Path, truth: np.ndarray, mask: np.ndarray, limit: float = 30) -> tuple[np.ndarray, float]:
    """Screenshots until the object shows (SwiftShader needs a few frames) or `limit` s pass; the last one."""
    deadline, error = time.monotonic() + limit, 1.0
    while time.monotonic() < deadline and error > 0.15:
        page.wait_for_timeout(1000)
        shot = np.asarray(Image.open(io.BytesIO(page.screenshot(path=str(path)))))
        error = _object_error(shot, truth, mask)
    return shot, error


def _frustum_pixel(scene: Path, start: str) -> tuple[str, tuple[float, float]]:
    """A training camera whose frustum image lies on the empty background of the start view, and
    where that image's centre falls on the page (viser draws it ~2.4 frustum scales ahead of the camera)."""
    from gstrain.data.colmap import load_scene

    loaded = load_scene(scene)
    views = loaded.train + loaded.test
    centres = np.stack([-(v.viewmat[:3, :3].T @ v.viewmat[:3, 3]).double().numpy() for v in views])
    size = 0.05 * np.linalg.norm(centres - centres.mean(0), axis=1).max()
    ref = next(v for v in views if v.name == start)
    vm = ref.viewmat.double().numpy()
    h = VIEWPORT["height"]
    f = float(ref.K[1, 1]) * h / ref.height
    _truth, mask = _image(scene, start)
    for v, c in zip(views, centres, strict=True):
        if v.name == start:
            continue
        p = vm[:3, :3] @ (c + v.viewmat[2, :3].double().numpy() * 2.4 * size) + vm[:3, 3]
        x, y = f * p[0] / p[2] + VIEWPORT["width"] / 2, f * p[1] / p[2] + h / 2
        sq = (int((x - (VIEWPORT["width"] - h) / 2) * ref.width / h), int(y * ref.height / h))
        if p[2] > 0 and 0 <= sq[0] < ref.width and 20 <= y < h - 20 and not mask[min(sq[1], ref.height - 1), sq[0]]:
            return v.name, (x, y)
    raise AssertionError("no training camera in view to click")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
@pytest.mark.slow
def test_view_draws_the_scene_in_chromium(trained_run, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api", reason="needs the playwright package (pip, dev extras)")
    scene = trained_run.parent / "scene"
    truth, mask = _image(scene, "000.png")  # the first test view: where the page starts
    clicked, pixel = _frustum_pixel(scene, "000.png")
    truth_k, mask_k = _image(scene, clicked)
    port = _free_port()
    server = _start_view(trained_run, port)
    paths = {k: tmp_path / f"{k}.png" for k in ("splats", "clicked", "empty", "render")}
    try:
        with playwright.sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(  # a new, empty --user-data-dir
                tmp_path / "profile", executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, viewport=VIEWPORT
            )
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}")
            page.get_by_text("Gaussians", exact=False).first.wait_for(timeout=30_000)
            shot, error_on = _settle(page, paths["splats"], truth, mask)
            # clicking a camera's frustum flies the view there: the page then shows that camera's image
            page.mouse.click(*pixel)
            _, error_clicked = _settle(page, paths["clicked"], truth_k, mask_k, limit=15)
            page.get_by_label("Show Gaussians").uncheck()
            page.wait_for_timeout(2000)
            empty = np.asarray(Image.open(io.BytesIO(page.screenshot(path=str(paths["empty"])))))
            error_off = _object_error(empty, truth_k, mask_k)
            # the "render" toggle: our own renderer's image of the browser's view, as the background
            page.get_by_label("Render (gstrain)").check()
            _, error_render = _settle(page, paths["render"], truth_k, mask_k)
            browser.close()
    finally:
        server.terminate()
        _out, err = server.communicate(timeout=20)
    ARTIFACTS.mkdir(exist_ok=True)
    for name, path in paths.items():
        if path.exists():
            shutil.copy(path, ARTIFACTS / f"viewer_chromium_{name}.png")
    assert error_on < 0.15, f"the Gaussians do not show the object (error {error_on:.3f}); see {paths['splats']}"
    assert error_clicked < 0.15, f"clicking camera {clicked} did not move the view there ({error_clicked:.3f})"
    assert error_off > error_clicked + 0.2, (error_clicked, error_off)
    assert error_render < 0.15, f"the render toggle does not show our render (error {error_render:.3f})"
    assert server.returncode == 0 and err.strip().splitlines()[-1] == "gstrain: viewer stopped", err


def test_view_bad_input(tmp_path, trained_run):
    assert_one_error(*call_cli("view", tmp_path, "--port", str(_free_port())), "not a gstrain run")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert_one_error(*call_cli("view", trained_run, "--port", str(busy.getsockname()[1])), "cannot listen")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
@pytest.mark.slow
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
