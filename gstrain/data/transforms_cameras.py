"""Cameras and poses of a transforms.json frame (NeRF/Blender or nerfstudio form).

Intrinsics: nerfstudio's fl_x, fl_y, cx, cy, w, h (+ camera_model and its distortion), or
NeRF/Blender's camera_angle_x (horizontal field of view; the principal point at the image centre).
Frame-level keys override the file's top-level ones. Both forms keep COLMAP's pixel convention
(the image centre is (w/2, h/2)), so the values go into a pycolmap camera as they are.

Poses: transform_matrix is camera-to-world in OpenGL's camera axes (x right, y up, z backward);
gstrain wants world-to-camera in COLMAP's (x right, y down, z forward).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import pycolmap

from gstrain.errors import UserError

# camera_model values gstrain reads; distorted ones are undistorted to PINHOLE through pycolmap
CAMERA_MODELS = ("PINHOLE", "SIMPLE_PINHOLE", "OPENCV", "OPENCV_FISHEYE")
INTRINSIC_KEYS = (
    "camera_model", "fl_x", "fl_y", "cx", "cy", "w", "h", "k1", "k2", "k3", "k4", "p1", "p2",
    "camera_angle_x", "camera_angle_y",
)
_OPENGL_TO_COLMAP = np.diag([1.0, -1.0, -1.0])


def frame_camera(
    meta: dict[str, Any], frame: dict[str, Any], image_size: Callable[[], tuple[int, int]], where: str
) -> pycolmap.Camera:
    """The frame's camera at its full size: a pycolmap camera (PINHOLE, FULL_OPENCV, OPENCV, OPENCV_FISHEYE).

    image_size: gives the image file's (w, h), read only where the JSON gives no w, h.
    """
    fields = {k: frame[k] if k in frame else meta[k] for k in INTRINSIC_KEYS if k in frame or k in meta}
    if "w" in fields and "h" in fields:
        w, h = _integer(fields, "w", where), _integer(fields, "h", where)
    else:
        w, h = image_size()
    if "fl_x" in fields:
        fx = _positive(fields, "fl_x", where)
        if "fl_y" not in fields:
            raise UserError(f"{where}: 'fl_y' is missing (nerfstudio intrinsics need fl_x and fl_y)")
        fy = _positive(fields, "fl_y", where)
    elif "camera_angle_x" in fields:
        fx = 0.5 * w / math.tan(0.5 * _angle(fields, "camera_angle_x", where))
        fy = 0.5 * h / math.tan(0.5 * _angle(fields, "camera_angle_y", where)) if "camera_angle_y" in fields else fx
    else:
        raise UserError(
            f"{where}: no focal length: needs 'camera_angle_x' (NeRF/Blender) or 'fl_x' and 'fl_y' (nerfstudio)"
        )
    cx = _number(fields, "cx", where) if "cx" in fields else w / 2.0
    cy = _number(fields, "cy", where) if "cy" in fields else h / 2.0
    dist = {k: _number(fields, k, where) if k in fields else 0.0 for k in ("k1", "k2", "k3", "k4", "p1", "p2")}
    model = fields.get("camera_model")
    if model is None:  # instant-ngp style files give distortion without naming a model
        model = "OPENCV" if any(dist.values()) else "PINHOLE"
    if model not in CAMERA_MODELS:
        raise UserError(f"{where}: unknown camera_model {model!r} (gstrain reads {', '.join(CAMERA_MODELS)})")
    if model == "OPENCV" and dist["k4"]:
        raise UserError(f"{where}: 'k4' of an OPENCV camera is not supported (only k1, k2, k3, p1, p2)")
    if (model == "OPENCV" and not any(dist.values())) or model in ("PINHOLE", "SIMPLE_PINHOLE"):
        name, params = "PINHOLE", [fx, fy, cx, cy]
    elif model == "OPENCV" and dist["k3"]:
        # COLMAP's OPENCV has no k3; FULL_OPENCV with k4..k6 = 0 is the same polynomial
        name = "FULL_OPENCV"
        params = [fx, fy, cx, cy, dist["k1"], dist["k2"], dist["p1"], dist["p2"], dist["k3"], 0.0, 0.0, 0.0]
    elif model == "OPENCV":
        name, params = "OPENCV", [fx, fy, cx, cy, dist["k1"], dist["k2"], dist["p1"], dist["p2"]]
    else:
        name, params = "OPENCV_FISHEYE", [fx, fy, cx, cy, dist["k1"], dist["k2"], dist["k3"], dist["k4"]]
    camera = pycolmap.Camera(model=name, width=w, height=h, params=params)
    if not camera.verify_params():
        raise UserError(f"{where}: invalid {model} intrinsics {params}")
    return camera


def check_undistortable(camera: pycolmap.Camera, where: str) -> None:
    """Fail before decoding anything when pycolmap cannot turn the camera into a pinhole one."""
    if camera.model_name == "PINHOLE":
        return
    try:
        pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera)
    except Exception as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise UserError(f"{where}: cannot undistort its {camera.model_name} camera to PINHOLE: {reason}") from None


def world_change(meta: dict[str, Any], where: str) -> np.ndarray | None:
    """The inverse of nerfstudio's `applied_transform` ([4, 4]), or None when the file has none.

    nerfstudio's COLMAP import rotates the world (poses and ply alike) and records the rotation as
    applied_transform; undoing it puts the scene back in the frame of the model it came from.
    """
    if "applied_transform" not in meta:
        return None
    change = _matrix(meta["applied_transform"], "applied_transform", where)
    if abs(np.linalg.det(change[:3, :3])) < 1e-9:
        raise UserError(f"{where}: 'applied_transform' is singular")
    return np.linalg.inv(change)


def frame_cam_from_world(frame: dict[str, Any], undo: np.ndarray | None, where: str) -> np.ndarray:
    """[3, 4] float64 world-to-camera in COLMAP's camera axes."""
    if "transform_matrix" not in frame:
        raise UserError(f"{where}: 'transform_matrix' is missing")
    c2w = _matrix(frame["transform_matrix"], "transform_matrix", where)
    if undo is not None:
        c2w = undo @ c2w
    rot = c2w[:3, :3] @ _OPENGL_TO_COLMAP
    if np.abs(rot.T @ rot - np.eye(3)).max() > 1e-3 or np.linalg.det(rot) < 0:
        raise UserError(f"{where}: 'transform_matrix' is not a rigid camera pose (its rotation is not orthonormal)")
    out = np.empty((3, 4))
    out[:, :3] = rot.T
    out[:, 3] = -rot.T @ c2w[:3, 3]
    return out


def _matrix(value: Any, key: str, where: str) -> np.ndarray:
    """A 4x4 (or 3x4, completed with 0 0 0 1) finite matrix."""
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.shape not in ((4, 4), (3, 4)):
        shape = "x".join(map(str, arr.shape)) if arr is not None else "ragged"
        raise UserError(f"{where}: '{key}' must be a 4x4 matrix, got shape {shape}")
    if not np.isfinite(arr).all():
        raise UserError(f"{where}: '{key}' has non-finite values")
    out = np.eye(4)
    out[: arr.shape[0]] = arr
    return out


def _number(fields: dict[str, Any], key: str, where: str) -> float:
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise UserError(f"{where}: '{key}' must be a finite number, got {value!r}")
    return float(value)


def _positive(fields: dict[str, Any], key: str, where: str) -> float:
    value = _number(fields, key, where)
    if value <= 0:
        raise UserError(f"{where}: '{key}' must be > 0, got {value!r}")
    return value


def _angle(fields: dict[str, Any], key: str, where: str) -> float:
    value = _number(fields, key, where)
    if not 0 < value < math.pi:
        raise UserError(f"{where}: '{key}' must be a field of view in radians, in (0, pi), got {value!r}")
    return value


def _integer(fields: dict[str, Any], key: str, where: str) -> int:
    value = _number(fields, key, where)
    if value != int(value) or value < 1:
        raise UserError(f"{where}: '{key}' must be a whole number of pixels >= 1, got {fields[key]!r}")
    return int(value)
