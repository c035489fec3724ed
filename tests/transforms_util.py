"""Write a COLMAP scene's cameras as transforms.json scenes (NeRF/Blender and nerfstudio forms).

The conversion follows the formats' published conventions, not gstrain's loader: camera-to-world in
OpenGL camera axes (y up, z back); nerfstudio's COLMAP import also swaps the world's y and z and
negates the new z, recording that as applied_transform, and writes its points through the same
change as an ASCII PLY.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pycolmap

# what nerfstudio's colmap_to_json records: world rows (x, z, -y)
APPLIED = np.array([[1.0, 0, 0, 0], [0, 0, 1, 0], [0, -1, 0, 0]])


def colmap_frames(scene: Path) -> tuple[pycolmap.Camera, list[tuple[str, np.ndarray]], np.ndarray, np.ndarray]:
    """(camera, [(image name, OpenGL camera-to-world 4x4)] sorted by name, points, colours)."""
    rec = pycolmap.Reconstruction(str(scene / "sparse" / "0"))
    images = sorted(rec.images.values(), key=lambda im: im.name)
    frames = []
    for im in images:
        w2c = np.eye(4)
        w2c[:3] = im.cam_from_world().matrix()
        c2w = np.linalg.inv(w2c)
        c2w[:3, 1:3] *= -1
        frames.append((im.name, c2w))
    ids = sorted(rec.point3D_ids())
    xyz = np.array([rec.points3D[i].xyz for i in ids])
    rgb = np.array([rec.points3D[i].color for i in ids], dtype=np.uint8)
    camera = copy.copy(rec.cameras[images[0].camera_id])  # a copy that outlives rec
    return camera, frames, xyz, rgb


def write_ascii_ply(path: Path, xyz: np.ndarray, rgb: np.ndarray) -> None:
    lines = ["ply", "format ascii 1.0", f"element vertex {len(xyz)}", "property float x", "property float y",
             "property float z", "property uint8 red", "property uint8 green", "property uint8 blue", "end_header"]
    lines += [f"{x:.8f} {y:.8f} {z:.8f} {r} {g} {b}" for (x, y, z), (r, g, b) in zip(xyz, rgb, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def write_blender(scene: Path, out: Path, test_every: int = 8, ply: bool = False) -> Path:
    """transforms_{train,val,test}.json with camera_angle_x and extension-less file paths."""
    camera, frames, xyz, rgb = colmap_frames(scene)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(scene / "images", out / "images", dirs_exist_ok=True)
    fx = camera.params[0]
    angle = 2 * math.atan(camera.width / (2 * fx))
    splits: dict[str, list] = {"train": [], "test": [], "val": []}
    for i, (name, c2w) in enumerate(frames):
        entry = {"file_path": f"./images/{Path(name).stem}", "rotation": 0.0, "transform_matrix": c2w.tolist()}
        splits["test" if i % test_every == 0 else "train"].append(entry)
    splits["val"] = splits["test"][:2]
    for split, entries in splits.items():
        meta = {"camera_angle_x": angle, "frames": entries}
        if ply:
            meta["ply_file_path"] = "points.ply"
        (out / f"transforms_{split}.json").write_text(json.dumps(meta, indent=1))
    if ply:
        write_ascii_ply(out / "points.ply", xyz, rgb)
    return out


def write_nerfstudio(scene: Path, out: Path, intrinsics: dict | None = None, per_frame: bool = False) -> Path:
    """One transforms.json as nerfstudio's COLMAP import writes it (applied_transform, sparse_pc.ply)."""
    camera, frames, xyz, rgb = colmap_frames(scene)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(scene / "images", out / "images", dirs_exist_ok=True)
    fx, fy, cx, cy = camera.params[:4]
    cam = intrinsics or {"camera_model": "PINHOLE", "fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy,
                         "w": camera.width, "h": camera.height}
    change = np.vstack([APPLIED, [0, 0, 0, 1]])
    entries = []
    for name, c2w in frames:
        entry = {"file_path": f"images/{name}", "transform_matrix": (change @ c2w).tolist()}
        if per_frame:
            entry.update(cam)
        entries.append(entry)
    meta = {} if per_frame else dict(cam)
    meta.update({"frames": entries[::-1], "applied_transform": APPLIED.tolist(), "ply_file_path": "sparse_pc.ply"})
    (out / "transforms.json").write_text(json.dumps(meta, indent=1))
    write_ascii_ply(out / "sparse_pc.ply", xyz @ APPLIED[:, :3].T + APPLIED[:, 3], rgb)
    return out
