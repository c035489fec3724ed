"""A big capture anyone can regenerate (issue 37): the block city of bench/city.py as N flat
Gaussians, photographed by phones in its streets and drones above it, written as a COLMAP folder.

    OUT/images/00000.jpg ...        the views, rendered by gstrain's Renderer (CUDA on a GPU,
                                    the PyTorch reference on the CPU), JPEG, names sorted by index
    OUT/sparse/0/*.bin              pycolmap's Reconstruction: two PINHOLE cameras (1 phone, 2
                                    drone), one image per view, SfM points sampled from the model
                                    (positions with --point-noise metres of noise, colours); the
                                    points carry no tracks (gstrain reads positions and colours)
    OUT/model.ply                   the ground-truth Gaussians (gstrain's 3DGS PLY, SH degree 0)
    OUT/big_scene.json              how it was made (arguments, counts, seconds, bytes)

Phones: eye height 1.5-1.8 m in a street corridor, looking along the street +-35 degrees and up
to 12 degrees up. Drones: 80-200 m up, looking 30-75 degrees down in any direction. Views
alternate so that every 8th (gstrain's test split) holds both. Black where nothing is (the sky),
as gstrain trains with data.background black. Everything follows from --seed.

    python -m bench.big_scene OUT [--views 2000] [--width 1920] [--height 1080] [--n 10000000]
        [--points 1000000] [--aerial 0.5] [--blocks 24] [--seed 0] [--device auto] [--batch 16]
        [--quality 92] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.city import STREET, city_gaussians, look_at, street_centre
from gstrain.errors import UserError

STREET_CAMERA, AERIAL_CAMERA = 1, 2
# horizontal fields of view (degrees): a phone's main camera, a drone's wide one
FOV_DEG = {STREET_CAMERA: 65.0, AERIAL_CAMERA: 80.0}
EYE_HEIGHT = (1.5, 1.8)
STREET_YAW_DEG, STREET_PITCH_DEG = 35.0, 12.0
AERIAL_ALTITUDE = (80.0, 200.0)
AERIAL_PITCH_DEG = (30.0, 75.0)
LATERAL = 4.0  # metres a phone stands off its corridor's middle
SCENE_FILE = "big_scene.json"


@dataclass
class Capture:
    """Where every view was taken from."""

    viewmats: np.ndarray  # [V, 4, 4] float32 world-to-camera
    camera_ids: np.ndarray  # [V] STREET_CAMERA or AERIAL_CAMERA
    intrinsics: dict[int, tuple[float, float, float, float]]  # camera id -> fx, fy, cx, cy

    def K(self, i: int) -> np.ndarray:
        fx, fy, cx, cy = self.intrinsics[int(self.camera_ids[i])]
        return np.array([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=np.float32)


def is_aerial(i: int, fraction: float) -> bool:
    """View i is a drone's when the running count of fraction * views steps up at i (interleaved)."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def capture_cameras(views: int, width: int, height: int, seed: int, blocks: int, aerial: float) -> Capture:
    rng = np.random.default_rng([seed, 1])
    pitch = street_centre(1) - street_centre(0)
    span = blocks * pitch
    up = np.array([0.0, 0.0, 1.0])
    mats, ids = [], []
    for i in range(views):
        if is_aerial(i, aerial):
            eye = np.array([rng.uniform(-STREET, span), rng.uniform(-STREET, span), rng.uniform(*AERIAL_ALTITUDE)])
            yaw, down = rng.uniform(0, 2 * math.pi), math.radians(rng.uniform(*AERIAL_PITCH_DEG))
            look = np.array([math.cos(down) * math.cos(yaw), math.cos(down) * math.sin(yaw), -math.sin(down)])
            ids.append(AERIAL_CAMERA)
        else:
            line = int(rng.integers(0, blocks))
            across = street_centre(line) + rng.uniform(-LATERAL, LATERAL)
            along = rng.uniform(0, span)
            along_x = bool(rng.integers(0, 2))
            eye = np.array([along, across, 0.0]) if along_x else np.array([across, along, 0.0])
            eye[2] = rng.uniform(*EYE_HEIGHT)
            heading = (0.0 if along_x else math.pi / 2) + math.pi * int(rng.integers(0, 2))
            yaw = heading + math.radians(rng.uniform(-STREET_YAW_DEG, STREET_YAW_DEG))
            rise = math.radians(rng.uniform(0, STREET_PITCH_DEG))
            look = np.array([math.cos(rise) * math.cos(yaw), math.cos(rise) * math.sin(yaw), math.sin(rise)])
            ids.append(STREET_CAMERA)
        mats.append(look_at(eye, eye + look, up))
    intrinsics = {}
    for cam, fov in FOV_DEG.items():
        f = width / 2 / math.tan(math.radians(fov) / 2)
        intrinsics[cam] = (f, f, width / 2, height / 2)
    return Capture(np.stack(mats), np.array(ids), intrinsics)


def image_names(views: int) -> list[str]:
    digits = max(5, len(str(views - 1)))
    return [f"{i:0{digits}d}.jpg" for i in range(views)]


def sfm_points(model: dict[str, torch.Tensor], count: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` of the model's means (in index order), moved by N(0, noise) metres, with their
    colours (uint8, plus a little noise): what a structure-from-motion run would have found."""
    from gstrain.model import SH_C0

    rng = np.random.default_rng([seed, 2])
    n = model["means"].shape[0]
    pick = np.sort(rng.choice(n, size=min(count, n), replace=False))
    xyz = model["means"][pick].double().numpy() + rng.normal(scale=noise, size=(len(pick), 3))
    rgb = model["sh0"][pick, 0].double().numpy() * SH_C0 + 0.5
    rgb = np.clip(np.round((rgb + rng.normal(scale=2.0 / 255, size=rgb.shape)) * 255), 0, 255).astype(np.uint8)
    return xyz, rgb


def write_colmap(model_dir: Path, capture: Capture, names: list[str], width: int, height: int,
                 xyz: np.ndarray, rgb: np.ndarray) -> None:  # fmt: skip
    """cameras, images (no keypoints) and points3D (no tracks) through pycolmap, into a fresh folder."""
    import pycolmap

    rec = pycolmap.Reconstruction()
    for cam_id, (fx, fy, cx, cy) in capture.intrinsics.items():
        camera = pycolmap.Camera.create_from_model_name(cam_id, "PINHOLE", fx, width, height)
        camera.params = [fx, fy, cx, cy]
        rec.add_camera_with_trivial_rig(camera)
    for i, name in enumerate(names):
        image = pycolmap.Image(name=name, camera_id=int(capture.camera_ids[i]), image_id=i + 1)
        pose = pycolmap.Rigid3d(capture.viewmats[i, :3, :].astype(np.float64))
        rec.add_image_with_trivial_frame(image, pose)
    track = pycolmap.Track()
    for p, c in zip(xyz, rgb, strict=True):
        rec.add_point3D(p, track, c)
    model_dir.mkdir(parents=True)
    rec.write(str(model_dir))


def _jpeg(path: Path, pixels: np.ndarray, quality: int) -> int:
    from PIL import Image

    from gstrain.files import write_atomic

    write_atomic(path, lambda fh: Image.fromarray(pixels).save(fh, format="JPEG", quality=quality))
    return path.stat().st_size


def render_views(model: dict[str, torch.Tensor], capture: Capture, names: list[str], width: int, height: int,
                 image_dir: Path, device: torch.device, batch: int, quality: int, workers: int) -> int:
    """Render every view with gstrain's Renderer and write it as JPEG; returns the bytes written.
    The GPU renders a batch while a thread pool encodes the batches before it."""
    from tqdm import tqdm

    from gstrain.config import RenderConfig
    from gstrain.render import Renderer

    renderer = Renderer(RenderConfig(), device)
    params = {k: v.to(device) for k, v in model.items()}
    background = torch.zeros(3, device=device)
    written = 0
    pending: list[Future] = []
    bar = tqdm(total=len(names), desc="render", unit="view", dynamic_ncols=True)
    with ThreadPoolExecutor(max_workers=workers) as pool, torch.no_grad():
        for start in range(0, len(names), batch):
            idx = range(start, min(start + batch, len(names)))
            images = []
            for i in idx:
                viewmat = torch.from_numpy(capture.viewmats[i]).to(device)
                K = torch.from_numpy(capture.K(i)).to(device)
                image, _, _ = renderer(params, viewmat, K, width, height, 0, background)
                images.append(image)
            pixels = (torch.stack(images).clamp(0, 1) * 255 + 0.5).to(torch.uint8).cpu().numpy()
            pending += [pool.submit(_jpeg, image_dir / names[i], pixels[j], quality) for j, i in enumerate(idx)]
            while len(pending) > 2 * max(batch, workers):  # a bounded queue: host memory stays flat
                written += pending.pop(0).result()
                bar.update(1)
        for done in pending:
            written += done.result()
            bar.update(1)
    bar.close()
    return written


def check_out(out: Path) -> None:
    """The scene goes into a new or empty folder: nothing a user put there is ever replaced."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; give a new path for the scene")


def write_scene(out: Path, views: int = 2000, width: int = 1920, height: int = 1080, n: int = 10_000_000,
                points: int = 1_000_000, point_noise: float = 0.02, aerial: float = 0.5, blocks: int = 24,
                seed: int = 0, device: str = "auto", batch: int = 16, quality: int = 92, workers: int = 8,
                log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Write the scene into `out` (new or empty); returns what big_scene.json records."""
    from gstrain.files import make_dir, write_text_atomic
    from gstrain.model import save_ply
    from gstrain.render import resolve_device

    if views < 2 or width < 8 or height < 8 or n < 1 or points < 1 or not 0 <= aerial <= 1 or blocks < 1:
        raise UserError(f"need >= 2 views of >= 8x8 pixels, n >= 1, points >= 1, 0 <= aerial <= 1, blocks >= 1; "
                        f"got {views} views of {width}x{height}, n {n}, points {points}, aerial {aerial}, "
                        f"blocks {blocks}")  # fmt: skip
    if not 1 <= quality <= 100 or batch < 1 or workers < 1 or point_noise < 0:
        raise UserError("--quality must be 1..100, --batch and --workers >= 1, --point-noise >= 0")
    check_out(out)
    dev = resolve_device(device)
    torch.manual_seed(seed)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    model = city_gaussians(n, seed, blocks)
    capture = capture_cameras(views, width, height, seed, blocks, aerial)
    names = image_names(views)
    seconds["generate"] = time.perf_counter() - t0
    log(f"big_scene: {n} Gaussians, {views} views ({int(sum(capture.camera_ids == AERIAL_CAMERA))} aerial) "
        f"at {width}x{height} on {dev}")  # fmt: skip
    make_dir(out / "images")
    t0 = time.perf_counter()
    image_bytes = render_views(model, capture, names, width, height, out / "images", dev, batch, quality, workers)
    seconds["render_and_write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    xyz, rgb = sfm_points(model, points, point_noise, seed)
    write_colmap(out / "sparse" / "0", capture, names, width, height, xyz, rgb)
    seconds["colmap"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    save_ply(model, out / "model.ply")
    seconds["ply"] = time.perf_counter() - t0
    record = {
        "n": n, "views": views, "width": width, "height": height, "points": len(xyz), "point_noise": point_noise,
        "aerial_views": int(sum(capture.camera_ids == AERIAL_CAMERA)), "aerial": aerial, "blocks": blocks,
        "seed": seed, "quality": quality, "device": str(dev), "image_bytes": image_bytes,
        "sigma_m": float(torch.exp(model["scales"][0, 0])),
        "seconds": {k: round(v, 2) for k, v in seconds.items()}, "command": " ".join(sys.argv),
    }  # fmt: skip
    write_text_atomic(out / SCENE_FILE, json.dumps(record, indent=1))
    log(f"big_scene: wrote {out}: {image_bytes / 2**30:.2f} GiB of JPEG, {len(xyz)} SfM points, "
        f"times {record['seconds']}")  # fmt: skip
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--views", type=int, default=2000)
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--height", type=int, default=1080)
    ap.add_argument("--n", type=float, default=10_000_000, help="Gaussians in the model (1e7 is fine)")
    ap.add_argument("--points", type=float, default=1_000_000, help="SfM points sampled from the model")
    ap.add_argument("--point-noise", type=float, default=0.02, help="metres of noise on the SfM points")
    ap.add_argument("--aerial", type=float, default=0.5, help="share of drone views (the rest: phones in the streets)")
    ap.add_argument("--blocks", type=int, default=24, help="the city is blocks x blocks (52 m each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--batch", type=int, default=16, help="views rendered before they go to the JPEG threads")
    ap.add_argument("--quality", type=int, default=92, help="JPEG quality")
    ap.add_argument("--workers", type=int, default=8, help="JPEG encoding threads")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # gstrain's CPU path keeps torch on one thread
    try:
        write_scene(args.out, args.views, args.width, args.height, int(args.n), int(args.points), args.point_noise,
                    args.aerial, args.blocks, args.seed, args.device, args.batch, args.quality, args.workers)
    except UserError as exc:
        print(f"gstrain: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
