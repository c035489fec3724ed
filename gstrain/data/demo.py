"""The embedded demo scene: an analytic textured object, ray-cast and written as a real COLMAP scene.

A sphere with a colourful checker texture sits on a textured ground disc over a black background.
Cameras (one shared PINHOLE camera) look at the sphere from two rings at different elevations.
The sparse model holds surface samples with their true colours and exact 2D observations, so it
is a valid reconstruction (reprojection error ~0) and goes through the same loader as user scenes.

With masks=True a distractor, a solid magenta disc that moves from view to view like a passer-by,
is painted into the images, and masks/ marks it as ignored (black). Views whose index is a
multiple of DISTRACTOR_FREE_EVERY (the default held-out views, data.test_every=8) stay clean and
have no mask file, so held-out scores measure whether the distractor leaked into the model.

With distances, the cameras sit at those distances from the sphere's centre (cycled over the
views) instead of all at CAMERA_DISTANCE, as in a handheld capture where some photos are taken
close and some far; with elevations, on one ring per elevation instead of ELEVATIONS_DEG's two.
bench/pose_schedule.py measures what such layouts do to pose refinement.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pycolmap
from PIL import Image

from gstrain import __version__
from gstrain.errors import UserError
from gstrain.scene_folder import check_replace, install, workspace, write_manifest

SPHERE_RADIUS = 1.0  # centred at the origin; world z is up
DISC_Z = -1.0  # the sphere rests on the disc
DISC_RADIUS = 2.6
CAMERA_DISTANCE = 4.5
# the closest a camera may be: the sphere's silhouette (half-angle asin(1 / d)) plus the 0.2 the
# cameras look below its centre must stay within the half field of view of 25 degrees
MIN_CAMERA_DISTANCE = 3.0
ELEVATIONS_DEG = (18.0, 42.0)
ELEVATION_RANGE_DEG = (0.0, 80.0)  # above the disc, and short of the pole where "up" is undefined
FOV_DEG = 50.0
BACKGROUND = np.zeros(3)
LIGHT = np.array([0.4, -0.5, 0.75]) / np.linalg.norm([0.4, -0.5, 0.75])
_SUPERSAMPLE = 2  # per axis, so edges are antialiased like a real photo
DISTRACTOR_RGB = (255, 0, 255)
DISTRACTOR_RADIUS = 0.16  # of the image's smaller side
DISTRACTOR_FREE_EVERY = 8
MANIFEST = "demo-scene.json"  # every file the demo scene wrote: all that --force may replace


def write_demo_scene(
    out_dir: str | Path, n_views: int = 32, width: int = 128, height: int = 128, seed: int = 0,
    masks: bool = False, force: bool = False, distances: Sequence[float] | None = None,
    elevations: Sequence[float] | None = None,
) -> Path:
    """Write out_dir/images/*.png and out_dir/sparse/0/*.bin (a COLMAP scene) and return out_dir.

    masks: also paint the moving distractor and write out_dir/masks/*.png (module docstring).
    distances: view i's camera at distances[i % len(distances)] from the sphere's centre (None:
    every camera at CAMERA_DISTANCE); each at least MIN_CAMERA_DISTANCE.
    elevations: the rings' elevations in degrees, in the order given (None: ELEVATIONS_DEG), each
    within ELEVATION_RANGE_DEG, at most one ring per view.
    out_dir must be new or empty, or (with force) hold an earlier demo scene: then only the
    files its demo-scene.json lists are replaced (gstrain.scene_folder).
    """
    out = Path(out_dir)
    if n_views < 2 or width < 8 or height < 8:
        raise UserError(f"demo scene needs >= 2 views of >= 8x8 pixels, got {n_views} of {width}x{height}")
    if distances is not None:
        distances = tuple(float(d) for d in distances)
        if not distances or not all(MIN_CAMERA_DISTANCE <= d < math.inf for d in distances):
            raise UserError(f"demo scene camera distances must be finite and >= {MIN_CAMERA_DISTANCE}, "
                            f"got {list(distances)}")
    if elevations is not None:
        elevations = tuple(float(e) for e in elevations)
        low, high = ELEVATION_RANGE_DEG
        if not 1 <= len(elevations) <= n_views or not all(low <= e <= high for e in elevations):
            raise UserError(f"demo scene ring elevations must be 1 to {n_views} angles from {low} to {high} "
                            f"degrees, got {list(elevations)}")
    if os.path.lexists(out) and not out.is_dir():
        raise UserError(f"demo scene output is not a directory: {out}")
    check_replace(out, MANIFEST, "demo scene", force)
    with workspace(out, "demo") as work:
        result = work / "scene"
        _write_scene(result, n_views, width, height, seed, masks, distances, elevations)
        record = {"gstrain": __version__, "views": n_views, "width": width, "height": height, "seed": seed,
                  "masks": masks}
        if distances is not None:  # only then: the default scene's files stay as they were
            record["distances"] = list(distances)
        if elevations is not None:
            record["elevations"] = list(elevations)
        try:
            write_manifest(result, MANIFEST, record)
            install(result, out, MANIFEST, work / "previous", "demo scene")
        except OSError as exc:
            raise UserError(f"cannot write the demo scene to {out}: {exc.strerror or exc}") from None
    return out


def _write_scene(out: Path, n_views: int, width: int, height: int, seed: int, masks: bool,
                 distances: tuple[float, ...] | None, elevations: tuple[float, ...] | None) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    focal = 0.5 * width / np.tan(np.radians(FOV_DEG) / 2)
    K = np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1.0]])
    poses = [_look_at(center) for center in _camera_centers(n_views, distances, elevations)]

    image_dir = out / "images"
    model_dir = out / "sparse" / "0"
    image_dir.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    names = [f"{i:03d}.png" for i in range(n_views)]
    for i, (name, (R, t)) in enumerate(zip(names, poses, strict=True)):
        pixels = _render(R, t, K, width, height)
        if masks and i % DISTRACTOR_FREE_EVERY != 0:
            (out / "masks").mkdir(exist_ok=True)
            keep = _paint_distractor(pixels, i)
            Image.fromarray(keep.astype(np.uint8) * 255).save(out / "masks" / name)
        Image.fromarray(pixels).save(image_dir / name)

    points, colors = _sample_surface(rng)
    rec = _build_reconstruction(names, poses, K, width, height, points, colors)
    rec.write(str(model_dir))


def _paint_distractor(pixels: np.ndarray, index: int) -> np.ndarray:
    """Paint view `index`'s distractor disc in place; returns the keep mask (False on the disc + 1 px)."""
    h, w = pixels.shape[:2]
    # golden-ratio steps: the disc lands somewhere else in every view, never twice in a row nearby
    cx = w * (0.25 + 0.5 * ((index * 0.618) % 1.0))
    cy = h * (0.3 + 0.45 * ((index * 0.382 + 0.1) % 1.0))
    radius = DISTRACTOR_RADIUS * min(w, h)
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    dist = np.hypot(xs - cx, ys - cy)
    pixels[dist <= radius] = DISTRACTOR_RGB
    return dist > radius + 1.0


def _camera_centers(n_views: int, distances: tuple[float, ...] | None = None,
                    elevations: tuple[float, ...] | None = None) -> np.ndarray:  # fmt: skip
    """One ring per elevation (None: ELEVATIONS_DEG's two), ring k turned by k half-steps of azimuth
    so that neighbouring rings interleave. View i sits at distances[i % len(distances)] (None:
    CAMERA_DISTANCE) from the origin."""
    elevations = ELEVATIONS_DEG if elevations is None else elevations
    step = 2 * np.pi * len(elevations) / n_views  # azimuth step within a ring
    centers = []
    for i in range(n_views):
        ring = (i * len(elevations)) // n_views
        az = i * step + ring * step / 2
        el = np.radians(elevations[ring])
        distance = CAMERA_DISTANCE if distances is None else distances[i % len(distances)]
        centers.append(distance * np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)]))
    return np.array(centers)


def _look_at(center: np.ndarray, target: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cam_from_world (R, t) in COLMAP's convention: x right, y down, z forward."""
    target = np.array([0.0, 0.0, -0.2]) if target is None else target
    forward = target - center
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    R = np.stack([right, down, forward])
    return R, -R @ center


def _hsv_to_rgb(h: np.ndarray, s: np.ndarray | float, v: np.ndarray | float) -> np.ndarray:
    h6 = (h % 1.0) * 6.0
    rgb = np.clip(np.abs(np.stack([h6 - 3, h6 - 2, h6 - 4], -1)) * [1, -1, -1] + [-1, 2, 2], 0, 1)
    s = np.asarray(s)[..., None]
    v = np.asarray(v)[..., None]
    return v * (1 - s + s * rgb)


def _shade(points: np.ndarray, on_sphere: np.ndarray) -> np.ndarray:
    """Linear RGB in [0, 1] of surface points: texture x fixed diffuse light (view-independent)."""
    x, y, z = points[:, 0], points[:, 1], points[:, 2]
    # Sphere: hue runs with longitude, checker in (longitude, latitude), thin white latitude stripes.
    lon = np.arctan2(y, x) / (2 * np.pi) + 0.5
    lat = np.arccos(np.clip(z / SPHERE_RADIUS, -1, 1)) / np.pi
    checker = (np.floor(lon * 12) + np.floor(lat * 8)) % 2
    sphere = _hsv_to_rgb(lon, 0.85, 0.45 + 0.55 * checker)
    stripe = np.abs(((lat * 8) % 1.0) - 0.5) < 0.06
    sphere[stripe] = 0.95
    sphere_n = points / np.linalg.norm(points, axis=1, keepdims=True)
    # Disc: polar checker in two earthy tones, darkening towards the rim.
    r = np.hypot(x, y)
    polar = (np.floor(r / DISC_RADIUS * 6) + np.floor(lon * 16)) % 2
    disc = np.where(polar[:, None] > 0, [0.85, 0.75, 0.45], [0.25, 0.45, 0.6])
    disc = disc * (1.0 - 0.35 * (r / DISC_RADIUS))[:, None]
    disc_n = np.broadcast_to([0.0, 0.0, 1.0], points.shape)
    albedo = np.where(on_sphere[:, None], sphere, disc)
    normal = np.where(on_sphere[:, None], sphere_n, disc_n)
    light = 0.35 + 0.65 * np.clip(normal @ LIGHT, 0, None)
    return np.clip(albedo * light[:, None], 0, 1)


def _ray_cast(origin: np.ndarray, dirs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distance along unit rays to the first surface (inf for a miss), and whether it is the sphere."""
    # Sphere |o + s d|^2 = r^2 with |d| = 1.
    b = dirs @ origin
    c = origin @ origin - SPHERE_RADIUS**2
    disc_sq = b * b - c
    root = np.sqrt(np.maximum(disc_sq, 0))
    s_sphere = np.where(disc_sq >= 0, -b - root, np.inf)
    s_sphere = np.where(s_sphere > 1e-9, s_sphere, np.inf)
    # Ground disc z = DISC_Z, |xy| <= DISC_RADIUS.
    with np.errstate(divide="ignore", invalid="ignore"):
        s_plane = (DISC_Z - origin[2]) / dirs[:, 2]
    hit = origin + np.nan_to_num(s_plane, posinf=0, neginf=0)[:, None] * dirs
    ok = (s_plane > 1e-9) & (np.hypot(hit[:, 0], hit[:, 1]) <= DISC_RADIUS)
    s_plane = np.where(ok, s_plane, np.inf)
    return np.minimum(s_sphere, s_plane), s_sphere <= s_plane


def _render(R: np.ndarray, t: np.ndarray, K: np.ndarray, width: int, height: int) -> np.ndarray:
    ss = _SUPERSAMPLE
    # Sub-pixel sample positions; pixel (x, y) covers [x, x+1) x [y, y+1) in COLMAP's convention.
    offs = (np.arange(ss) + 0.5) / ss
    xs = (np.arange(width)[:, None] + offs[None, :]).ravel()
    ys = (np.arange(height)[:, None] + offs[None, :]).ravel()
    gx, gy = np.meshgrid(xs, ys)
    cam_dirs = np.stack([(gx - K[0, 2]) / K[0, 0], (gy - K[1, 2]) / K[1, 1], np.ones_like(gx)], -1).reshape(
        -1, 3
    )
    dirs = cam_dirs @ R  # rows of R are the camera axes in world: d_world = R^T d_cam
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    origin = -R.T @ t
    dist, on_sphere = _ray_cast(origin, dirs)
    rgb = np.tile(BACKGROUND, (len(dirs), 1))
    hit = np.isfinite(dist)
    rgb[hit] = _shade(origin + dist[hit, None] * dirs[hit], on_sphere[hit])
    rgb = rgb.reshape(height, ss, width, ss, 3).mean(axis=(1, 3))
    return _to_uint8(rgb)


def _to_uint8(rgb: np.ndarray) -> np.ndarray:
    return np.clip(np.round(rgb * 255.0), 0, 255).astype(np.uint8)


def _sample_surface(
    rng: np.random.Generator, n_sphere: int = 3000, n_disc: int = 1500
) -> tuple[np.ndarray, np.ndarray]:
    """Surface points (area-uniform on the sphere and disc) and their colours with a little noise."""
    v = rng.normal(size=(n_sphere, 3))
    sphere = SPHERE_RADIUS * v / np.linalg.norm(v, axis=1, keepdims=True)
    r = DISC_RADIUS * np.sqrt(rng.uniform(0, 1, n_disc))
    a = rng.uniform(0, 2 * np.pi, n_disc)
    disc = np.stack([r * np.cos(a), r * np.sin(a), np.full(n_disc, DISC_Z)], -1)
    points = np.concatenate([sphere, disc])
    on_sphere = np.arange(len(points)) < n_sphere
    colors = _shade(points, on_sphere) + rng.normal(scale=3.0 / 255.0, size=points.shape)
    return points, _to_uint8(colors)


def _build_reconstruction(
    names: list[str],
    poses: list[tuple[np.ndarray, np.ndarray]],
    K: np.ndarray,
    width: int,
    height: int,
    points: np.ndarray,
    colors: np.ndarray,
) -> pycolmap.Reconstruction:
    """Images with their visible points as keypoints, and points with tracks of >= 2 images."""
    n_views, n_points = len(poses), len(points)
    visible = np.zeros((n_views, n_points), bool)
    pixels = np.zeros((n_views, n_points, 2))
    for i, (R, t) in enumerate(poses):
        cam_pts = points @ R.T + t
        z = cam_pts[:, 2]
        uv = cam_pts[:, :2] / np.maximum(z, 1e-9)[:, None] * [K[0, 0], K[1, 1]] + K[:2, 2]
        in_frame = (z > 1e-6) & (uv[:, 0] >= 0.5) & (uv[:, 0] <= width - 0.5)
        in_frame &= (uv[:, 1] >= 0.5) & (uv[:, 1] <= height - 0.5)
        # Depth test: cast the ray towards the point; it must reach this very point first.
        center = -R.T @ t
        to_pt = points - center
        dist = np.linalg.norm(to_pt, axis=1)
        hit, _ = _ray_cast(center, to_pt / dist[:, None])
        visible[i] = in_frame & (np.abs(hit - dist) < 1e-6 * (1 + dist))
        pixels[i] = uv
    keep = visible.sum(axis=0) >= 2
    visible, pixels, points, colors = visible[:, keep], pixels[:, keep], points[keep], colors[keep]

    rec = pycolmap.Reconstruction()
    camera = pycolmap.Camera.create_from_model_name(1, "PINHOLE", float(K[0, 0]), width, height)
    camera.params = [K[0, 0], K[1, 1], K[0, 2], K[1, 2]]
    rec.add_camera_with_trivial_rig(camera)
    point2d_idx = np.full(visible.shape, -1, np.int64)
    for i, ((R, t), name) in enumerate(zip(poses, names, strict=True)):
        cols = np.flatnonzero(visible[i])
        point2d_idx[i, cols] = np.arange(len(cols))
        image = pycolmap.Image(name=name, keypoints=pixels[i, cols], camera_id=1, image_id=i + 1)
        rec.add_image_with_trivial_frame(image, pycolmap.Rigid3d(np.hstack([R, t[:, None]])))
    for j in range(len(points)):
        views = np.flatnonzero(visible[:, j])
        track = pycolmap.Track([pycolmap.TrackElement(int(i) + 1, int(point2d_idx[i, j])) for i in views])
        rec.add_point3D(points[j], track, colors[j])
    return rec
