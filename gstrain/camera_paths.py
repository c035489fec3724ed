"""Camera paths through a scene: the dataset's own cameras (test / train), an orbit around the
point the cameras look at, or an LLFF-style spiral around the mean pose; plus frame sizing."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import torch

from gstrain.choices import CAMERA_PATHS
from gstrain.data.scene import View
from gstrain.errors import UserError

MIN_SIZE, MAX_SIZE = 8, 8192
SPIRAL_ROTATIONS = 2
SPIRAL_ZRATE = 0.5  # forward/backward oscillations per rotation

Camera = tuple[torch.Tensor, torch.Tensor, int, int]  # (viewmat [4,4], K [3,3], width, height)



def camera_path(
    views: Sequence[View], kind: str, n_frames: int = 120, points: np.ndarray | None = None
) -> list[Camera]:
    """Cameras to render: the views themselves (test/train) or an orbit/spiral fitted to them.

    Orbit and spiral frames use the first view's intrinsics and size; `points` (the SfM cloud)
    sets the spiral's focus depth the LLFF way when given.
    """
    if kind not in CAMERA_PATHS:
        raise UserError(f"unknown camera path '{kind}' (choose from {' | '.join(CAMERA_PATHS)})")
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
