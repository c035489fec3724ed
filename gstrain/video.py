"""`gstrain render`: a trained run along a camera path (gstrain.camera_paths) to an MP4 or a folder
of PNG frames. Frames show colour, alpha, or expected depth through a turbo-like colour map
normalised by robust percentiles.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gstrain.camera_paths import Camera, camera_path, parse_size, scale_camera
from gstrain.choices import CAMERA_PATHS, RENDER_OUTPUTS
from gstrain.errors import UserError
from gstrain.files import VIDEO_MARK, create_beside
from gstrain.frames import check_output, start_frames
from gstrain.train.appearance import render_protocol

if TYPE_CHECKING:
    from gstrain.render import Renderer

VIDEO_SUFFIX = ".mp4"
MAX_FPS = 240
DEPTH_SAMPLE_FRAMES = 8  # frames rendered up front to fix one depth range for the whole video


@dataclass
class RenderReport:
    out: Path
    frames: int
    width: int
    height: int
    kind: str  # "mp4" | "png"
    backend: str
    seconds: float


# ---------------------------------------------------------------------------------------------
# Colour maps
# ---------------------------------------------------------------------------------------------

# Our own turbo-like ramp: dark blue -> blue -> cyan -> green -> yellow -> orange -> dark red.
_RAMP_T = np.array([0.0, 0.15, 0.35, 0.5, 0.65, 0.8, 1.0])
_RAMP_RGB = np.array([
    [0.19, 0.07, 0.23],
    [0.27, 0.42, 0.92],
    [0.10, 0.80, 0.86],
    [0.32, 0.96, 0.42],
    [0.86, 0.90, 0.20],
    [0.98, 0.55, 0.12],
    [0.55, 0.05, 0.02],
])  # fmt: skip


def colormap(t: np.ndarray) -> np.ndarray:
    """[...] values in [0,1] -> [..., 3] RGB in [0,1] (piecewise linear along the ramp)."""
    t = np.clip(np.nan_to_num(t, nan=0.0), 0.0, 1.0)
    return np.stack([np.interp(t, _RAMP_T, _RAMP_RGB[:, c]) for c in range(3)], axis=-1)


def depth_range(depths: list[np.ndarray]) -> tuple[float, float]:
    """(near, far): 2nd / 98th percentiles of covered (non-zero) depths, so outliers don't wash it out."""
    vals = np.concatenate([d[d > 0].ravel() for d in depths]) if depths else np.zeros(0)
    if vals.size == 0:
        return 0.0, 1.0
    near, far = np.percentile(vals, [2, 98])
    if far - near < 1e-9:
        far = near + max(abs(near) * 1e-3, 1e-6)
    return float(near), float(far)


def colorize_depth(depth: np.ndarray, near: float, far: float) -> np.ndarray:
    """[H,W] or [H,W,1] depth -> [H,W,3] uint8: near is warm, far is cool, nothing hit is black."""
    d = depth.reshape(depth.shape[0], depth.shape[1])
    rgb = colormap((far - d) / (far - near))
    rgb[d <= 0] = 0.0
    return _to_uint8(rgb)


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.round(x * 255.0), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------
# Rendering a run
# ---------------------------------------------------------------------------------------------


def render_run(
    run_dir: str | Path,
    path: str = "orbit",
    out: str | Path | None = None,
    what: str = "rgb",
    fps: int = 30,
    size: str | tuple[int, int] | None = None,
    device: str = "auto",
    log: Callable[[str], None] = print,
    n_frames: int = 120,
    force: bool = False,
    allow_older: bool = False,
    scene: str | Path | None = None,
) -> RenderReport:
    """Render the run's latest Gaussians along a camera path to FILE.mp4 or to a folder of PNGs.

    out defaults to <run>/renders/<path>_<what>.mp4. PNG frames go into a new or empty folder,
    or with `force` into one holding an earlier render's frames (only those are removed); an
    existing FILE.mp4 outside <run>/renders/ is replaced only with `force`, and only if it carries
    gstrain's mark (files.carries_gstrain_mark). `scene`: the run's scene after a move (checked and
    recorded by run_dir.open_run). UserError for bad input.
    """
    from gstrain.run_dir import load_run, open_run

    start = time.perf_counter()
    run = Path(run_dir)
    if path not in CAMERA_PATHS:
        raise UserError(f"unknown --path '{path}' (choose from {' | '.join(CAMERA_PATHS)})")
    if what not in RENDER_OUTPUTS:
        raise UserError(f"unknown --what '{what}' (choose from {' | '.join(RENDER_OUTPUTS)})")
    if isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= MAX_FPS:
        raise UserError(f"--fps must be an integer in 1..{MAX_FPS}, got {fps!r}")
    if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 1:
        raise UserError(f"--frames must be an integer >= 1, got {n_frames!r}")
    target_size = parse_size(size) if isinstance(size, str) else size
    out_path = Path(out) if out is not None else run / "renders" / f"{path}_{what}{VIDEO_SUFFIX}"
    is_video = _output_kind(out_path)

    load_run(run)  # a wrong run folder is named before anything is written
    check_output(out_path, is_video, force, ours=run / "renders")
    opened = open_run(run, device, allow_older=allow_older, log=log,
                      scene_path=Path(scene) if scene is not None else None)
    scene, cfg = opened.scene, opened.cfg
    log(f"gstrain: loaded scene {opened.scene_path} (factor {cfg.data.factor}) for its cameras")
    log(f"gstrain: {render_protocol(cfg)}")
    if path == "test":
        views = scene.test
        if not views:
            raise UserError("this run's scene has no test views (data.test_every=0); use another --path")
    elif path == "train":
        views = scene.train
    else:
        views = sorted([*scene.train, *scene.test], key=lambda v: v.name)
    cams = camera_path(views, path, n_frames, points=scene.points)
    if target_size is None and is_video and len({(w, h) for _, _, w, h in cams}) > 1:
        target_size = (cams[0][2], cams[0][3])  # a video needs one frame size
        log(f"gstrain: views differ in size; rendering all at {target_size[0]}x{target_size[1]}")
    if target_size is not None:
        cams = [scale_camera(c, *target_size) for c in cams]
    if is_video:
        # libx264 with yuv420p needs even sides: drop the last row/column (K unchanged = a crop)
        cams = [(vm, K, w - w % 2, h - h % 2) for vm, K, w, h in cams]

    dev, renderer, params = opened.device, opened.renderer, opened.params
    sh_degree, background = opened.sh_degree, opened.background
    frame_fn = _frame_renderer(renderer, dev, params, sh_degree, background, what)
    if what == "depth":
        picks = np.linspace(0, len(cams) - 1, min(len(cams), DEPTH_SAMPLE_FRAMES)).round().astype(int)
        near, far = depth_range([frame_fn(cams[i]) for i in np.unique(picks)])
        log(f"gstrain: depth range {near:.3g} .. {far:.3g} (2nd-98th percentile)")

        def to_image(cam: Camera) -> np.ndarray:
            return colorize_depth(frame_fn(cam), near, far)
    else:

        def to_image(cam: Camera) -> np.ndarray:
            return _to_uint8(frame_fn(cam))

    _write_frames(out_path, is_video, cams, to_image, fps)
    w, h = cams[0][2], cams[0][3]
    return RenderReport(
        out=out_path, frames=len(cams), width=w, height=h, kind="mp4" if is_video else "png",
        backend=renderer.backend, seconds=time.perf_counter() - start,
    )  # fmt: skip


def _output_kind(out: Path) -> bool:
    """True for a video file, False for a PNG folder; the suffix decides."""
    suffix = out.suffix.lower()
    if suffix == VIDEO_SUFFIX:
        return True
    if suffix == "":
        return False
    raise UserError(f"unsupported output '{out}': use FILE.mp4 for a video, or a folder (no suffix) for PNGs")


def _frame_renderer(
    renderer: Renderer,
    dev: torch.device,
    params: torch.nn.ParameterDict,
    sh_degree: int,
    background: torch.Tensor,
    what: str,
) -> Callable[[Camera], np.ndarray]:
    """cam -> float [H,W,3] in [0,1] for rgb/alpha, or [H,W,1] depth (0 = nothing hit)."""

    @torch.no_grad()
    def frame(cam: Camera) -> np.ndarray:
        vm, K, w, h = cam
        vm, K = vm.to(dev), K.to(dev)
        if what == "depth":
            return renderer.render_depth(params, vm, K, w, h).float().cpu().numpy()
        image, alpha, _ = renderer(params, vm, K, w, h, sh_degree, background)
        x = image if what == "rgb" else alpha.expand(-1, -1, 3)
        return x.clamp(0, 1).float().cpu().numpy()

    return frame


def _write_frames(
    out: Path,
    is_video: bool,
    cams: list[Camera],
    to_image: Callable[[Camera], np.ndarray],
    fps: int,
) -> None:
    import imageio.v2 as imageio
    from tqdm import tqdm

    bar = tqdm(cams, desc="render", unit="frame", leave=False, dynamic_ncols=True)
    if not is_video:
        names = start_frames(out, len(cams))
        for name, cam in zip(names, bar, strict=True):
            imageio.imwrite(out / name, to_image(cam))
        return
    # Write next to the target and rename at the end: an interrupted render leaves no broken file.
    fd, tmp = create_beside(out, suffix=VIDEO_SUFFIX)  # the mode open() would give, not mkstemp's 0600
    os.close(fd)
    try:
        writer = imageio.get_writer(
            tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8, pixelformat="yuv420p",
            macro_block_size=1, ffmpeg_log_level="error",
            output_params=["-metadata", f"comment={VIDEO_MARK}"],  # the mark that lets --force replace it
        )  # fmt: skip
        try:
            for cam in bar:
                writer.append_data(to_image(cam))
        finally:
            writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
