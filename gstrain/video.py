"""Camera paths through a trained scene, and rendering them to an MP4 or a folder of PNG frames.

Paths: the dataset's own cameras (test / train), an orbit around the point the cameras look at,
or an LLFF-style spiral around the mean pose. Frames show colour, alpha, or expected depth
through a turbo-like colour map normalised by robust percentiles.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gstrain.data.scene import View
from gstrain.errors import UserError
from gstrain.frames import check_output, start_frames

if TYPE_CHECKING:
    from gstrain.render import Renderer

PATHS = ("test", "train", "orbit", "spiral")
WHATS = ("rgb", "depth", "alpha")
VIDEO_SUFFIX = ".mp4"
MAX_FPS = 240
MIN_SIZE, MAX_SIZE = 8, 8192
DEPTH_SAMPLE_FRAMES = 8  # frames rendered up front to fix one depth range for the whole video
SPIRAL_ROTATIONS = 2
SPIRAL_ZRATE = 0.5  # forward/backward oscillations per rotation

Camera = tuple[torch.Tensor, torch.Tensor, int, int]  # (viewmat [4,4], K [3,3], width, height)


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
# Camera paths
# ---------------------------------------------------------------------------------------------


def camera_path(
    views: Sequence[View], kind: str, n_frames: int = 120, points: np.ndarray | None = None
) -> list[Camera]:
    """Cameras to render: the views themselves (test/train) or an orbit/spiral fitted to them.

    Orbit and spiral frames use the first view's intrinsics and size; `points` (the SfM cloud)
    sets the spiral's focus depth the LLFF way when given.
    """
    if kind not in PATHS:
        raise UserError(f"unknown camera path '{kind}' (choose from {' | '.join(PATHS)})")
    if not views:
        raise UserError(f"no cameras to build the '{kind}' path from")
    if kind in ("test", "train"):
        return [(v.viewmat.float(), v.K.float(), v.width, v.height) for v in views]
    if n_frames < 1:
        raise UserError(f"the {kind} path needs at least 1 frame, got {n_frames}")
    ref = views[0]
    K = ref.K.float()
    if kind == "orbit":
        poses = _orbit(views, n_frames)
    else:
        poses = _spiral(views, n_frames, points)
    return [(vm, K.clone(), ref.width, ref.height) for vm in poses]


def _camera_frames(views: Sequence[View]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Camera centres, forward (+z) and up (-y) axes in world coordinates, each [N,3] float64."""
    vms = np.stack([v.viewmat.double().numpy() for v in views])
    R, t = vms[:, :3, :3], vms[:, :3, 3]
    centres = -np.einsum("nji,nj->ni", R, t)
    return centres, R[:, 2], -R[:, 1]


def focus_point(centres: np.ndarray, forwards: np.ndarray) -> np.ndarray:
    """The point nearest (least squares) to all optical axes: where a capture's cameras look."""
    d = forwards / np.linalg.norm(forwards, axis=1, keepdims=True)
    proj = np.eye(3)[None] - d[:, :, None] * d[:, None, :]  # projectors orthogonal to each axis
    A = proj.sum(0)
    b = np.einsum("nij,nj->i", proj, centres)
    # Parallel axes (a forward-facing capture) leave A singular along them; a tiny ridge towards
    # the camera centroid keeps the solve finite there without moving a well-posed answer.
    ridge = 1e-6 * max(np.trace(A), 1e-12)
    return np.linalg.solve(A + ridge * np.eye(3), b + ridge * centres.mean(0))


def _unit(v: np.ndarray) -> np.ndarray:
    return v / max(float(np.linalg.norm(v)), 1e-12)


def _perpendicular(axis: np.ndarray) -> np.ndarray:
    """Some unit vector orthogonal to axis."""
    trial = np.eye(3)[int(np.argmin(np.abs(axis)))]
    return _unit(trial - axis * (trial @ axis))


def look_at(position: np.ndarray, target: np.ndarray, up: np.ndarray) -> torch.Tensor:
    """World-to-camera [4,4] (COLMAP axes: x right, y down, z forward) at position, facing target."""
    fwd = _unit(target - position)
    right = np.cross(fwd, up)
    right = _unit(right) if np.linalg.norm(right) > 1e-9 else _perpendicular(fwd)
    down = np.cross(fwd, right)
    R = np.stack([right, down, fwd])
    vm = np.eye(4)
    vm[:3, :3] = R
    vm[:3, 3] = -R @ position
    return torch.from_numpy(vm.astype(np.float32))


def orbit_frame(views: Sequence[View]) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(focus point, up axis, mean height above the focus, mean radius around the up axis)."""
    centres, forwards, ups = _camera_frames(views)
    focus = focus_point(centres, forwards)
    mean_up = ups.mean(0)
    up = mean_up
    if len(centres) >= 3:
        # The plane through the camera centres: its normal is the direction of least spread.
        _, _, vt = np.linalg.svd(centres - centres.mean(0))
        normal = vt[-1]
        if normal @ mean_up < 0:
            normal = -normal
        # Trust the plane unless it stands up (a forward-facing capture: centres spread sideways
        # and up/down, so the "normal" points along the view direction); then use the cameras' up.
        if np.linalg.norm(mean_up) < 1e-6 or abs(normal @ _unit(mean_up)) >= 0.5:
            up = normal
    up = _unit(up) if np.linalg.norm(up) > 1e-9 else np.array([0.0, 0.0, 1.0])
    rel = centres - focus
    heights = rel @ up
    radial = rel - heights[:, None] * up
    return focus, up, float(heights.mean()), float(np.linalg.norm(radial, axis=1).mean())


def _orbit(views: Sequence[View], n_frames: int) -> list[torch.Tensor]:
    focus, up, height, radius = orbit_frame(views)
    centres, _, _ = _camera_frames(views)
    radial = centres - focus - ((centres - focus) @ up)[:, None] * up
    # start at the first camera's azimuth and turn the way the cameras are ordered
    a = _unit(radial[0]) if np.linalg.norm(radial[0]) > 1e-9 else _perpendicular(up)
    b = np.cross(up, a)
    if len(radial) > 1 and (radial[1] - radial[0]) @ b < 0:
        b = -b
    radius = radius if radius > 1e-9 else 1.0
    poses = []
    for k in range(n_frames):
        theta = 2 * math.pi * k / n_frames
        pos = focus + height * up + radius * (math.cos(theta) * a + math.sin(theta) * b)
        poses.append(look_at(pos, focus, up))
    return poses


def _spiral(views: Sequence[View], n_frames: int, points: np.ndarray | None) -> list[torch.Tensor]:
    centres, forwards, ups = _camera_frames(views)
    centre = centres.mean(0)
    fwd = forwards.mean(0)
    fwd = _unit(fwd) if np.linalg.norm(fwd) > 1e-6 else forwards[0]  # 360 captures can cancel out
    right = np.cross(fwd, ups.mean(0))
    right = _unit(right) if np.linalg.norm(right) > 1e-9 else _perpendicular(fwd)
    down = np.cross(fwd, right)
    basis = np.stack([right, down, fwd])  # mean camera's axes, rows

    depth = _spiral_focus_depth(centres, forwards, centre, fwd, points)
    offsets = np.abs((centres - centre) @ basis.T)
    rads = np.maximum(np.percentile(offsets, 90, axis=0), 1e-3 * depth)
    target = centre + depth * fwd
    poses = []
    for k in range(n_frames):
        theta = 2 * math.pi * SPIRAL_ROTATIONS * k / n_frames
        local = rads * np.array([math.cos(theta), math.sin(theta), math.sin(theta * SPIRAL_ZRATE)])
        poses.append(look_at(centre + local @ basis, target, -down))
    return poses


def _spiral_focus_depth(
    centres: np.ndarray, forwards: np.ndarray, centre: np.ndarray, fwd: np.ndarray, points: np.ndarray | None
) -> float:
    """How far ahead of the mean camera the spiral looks."""
    if points is not None and len(points) >= 10:
        z = (np.asarray(points, dtype=np.float64) - centre) @ fwd
        z = z[z > 1e-6]
        if len(z) >= 10:
            # LLFF: weight the far bound heavily (a harmonic blend of near and far scene depth)
            near, far = np.percentile(z, 5), np.percentile(z, 95)
            return float(1.0 / (0.25 / near + 0.75 / far))
    depth = float((focus_point(centres, forwards) - centre) @ fwd)
    if math.isfinite(depth) and depth > 1e-6:
        return depth
    spread = float(np.sqrt(((centres - centre) ** 2).sum(1).mean()))
    return 2.0 * spread if spread > 1e-9 else 1.0


def scale_camera(camera: Camera, width: int, height: int) -> Camera:
    """The same camera rendered at width x height: K's rows scale with the size."""
    vm, K, w, h = camera
    K = K.clone()
    K[0] *= width / w
    K[1] *= height / h
    K[2] = torch.tensor([0.0, 0.0, 1.0])
    return vm, K, width, height


def parse_size(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise UserError(f"--size must look like WIDTHxHEIGHT (e.g. 640x480), got '{text}'")
    w, h = int(m.group(1)), int(m.group(2))
    if not (MIN_SIZE <= w <= MAX_SIZE and MIN_SIZE <= h <= MAX_SIZE):
        raise UserError(f"--size {w}x{h} is out of range: each side must be {MIN_SIZE}..{MAX_SIZE} pixels")
    return w, h


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
) -> RenderReport:
    """Render the run's latest Gaussians along a camera path to FILE.mp4 or to a folder of PNGs.

    out defaults to <run>/renders/<path>_<what>.mp4. PNG frames go into a new or empty folder,
    or with `force` into one holding an earlier render's frames (only those are removed); an
    existing FILE.mp4 outside <run>/renders/ is replaced only with `force`. UserError for bad input.
    """
    from gstrain.run_dir import load_run, open_run

    start = time.perf_counter()
    run = Path(run_dir)
    if path not in PATHS:
        raise UserError(f"unknown --path '{path}' (choose from {' | '.join(PATHS)})")
    if what not in WHATS:
        raise UserError(f"unknown --what '{what}' (choose from {' | '.join(WHATS)})")
    if isinstance(fps, bool) or not isinstance(fps, int) or not 1 <= fps <= MAX_FPS:
        raise UserError(f"--fps must be an integer in 1..{MAX_FPS}, got {fps!r}")
    if isinstance(n_frames, bool) or not isinstance(n_frames, int) or n_frames < 1:
        raise UserError(f"--frames must be an integer >= 1, got {n_frames!r}")
    target_size = parse_size(size) if isinstance(size, str) else size
    out_path = Path(out) if out is not None else run / "renders" / f"{path}_{what}{VIDEO_SUFFIX}"
    is_video = _output_kind(out_path)

    load_run(run)  # a wrong run folder is named before anything is written
    check_output(out_path, is_video, force, ours=run / "renders")
    opened = open_run(run, device, allow_older=allow_older, log=log)
    scene, cfg = opened.scene, opened.cfg
    log(f"gstrain: loaded scene {opened.scene_path} (factor {cfg.data.factor}) for its cameras")
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
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=VIDEO_SUFFIX, dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = imageio.get_writer(
            tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=8, pixelformat="yuv420p",
            macro_block_size=1, ffmpeg_log_level="error",
        )  # fmt: skip
        try:
            for cam in bar:
                writer.append_data(to_image(cam))
        finally:
            writer.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
