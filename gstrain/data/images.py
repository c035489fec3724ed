"""Turn one posed image file into a View: decode, downscale, undistort to PINHOLE, read its mask.

Shared by every input format (data/colmap.py, data/transforms.py): a format says which file, which
pycolmap camera (any model pycolmap can undistort) and which world-to-camera pose; this module does
the pixels the same way for all of them.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pycolmap
import torch
from PIL import Image

from gstrain.data.masks import ALPHA_MODES, MaskReader
from gstrain.data.scene import View
from gstrain.errors import UserError

PINHOLE_MODELS = ("SIMPLE_PINHOLE", "PINHOLE")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp")

_GREY_MODES = ("L", "LA", "La", "1")
# What PIL raises on bad image files (SyntaxError and struct.error come from some PNG/TIFF parsers).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


@dataclass(frozen=True)
class ViewSource:
    """What a format knows about one view before its pixels are read."""

    name: str  # the view's name (unique within the scene)
    file: Path  # the image file
    camera: pycolmap.Camera  # at the image file's full size; any model pycolmap undistorts
    cam_from_world: np.ndarray  # [3, 4] float64, COLMAP convention (x right, y down, z forward)
    mask_name: str | None = None  # the name masks/ is searched by; None: `name`


class ViewLoader:
    """Decodes, downscales and undistorts one image; safe to call from several threads.

    prescaled: the files are already 1/factor of their cameras (images_<factor>/).
    composite_over: RGB in 0..1 to composite transparent pixels over (the alpha channel then is no
    mask); None keeps the alpha channel as the view's mask where masks/ has no file (data/masks.py).
    """

    def __init__(
        self, factor: int, prescaled: bool, masks: MaskReader,
        composite_over: Sequence[float] | None = None, camera_label: str = "COLMAP camera",
    ) -> None:
        self.masks = masks
        self.factor = factor
        self.prescaled = prescaled
        self.composite_over = None if composite_over is None else np.asarray(composite_over, np.float64)
        self.camera_label = camera_label
        self.options = pycolmap.UndistortCameraOptions()
        # name -> (file size, camera size) of images that did not match their camera
        self.size_mismatch: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.alpha: list[str] = []  # images with an alpha channel (a mask, or composited)
        self.grey: list[str] = []  # single-channel images spread to RGB

    def notes(self) -> list[str]:
        """One line per thing done to the images that the user did not ask for."""
        out = []
        if self.alpha and self.composite_over is None:
            out.append(f"{len(self.alpha)} images have an alpha channel (e.g. {min(self.alpha)}); "
                       "where masks/ has no file for them, alpha is their mask (alpha < 0.5 is left out)")
        elif self.alpha:
            rgb = ", ".join(f"{c:g}" for c in self.composite_over)
            out.append(f"{len(self.alpha)} images have an alpha channel (e.g. {min(self.alpha)}); "
                       f"composited over data.background ({rgb}), as NeRF/Blender scenes are scored")
        if self.grey:
            out.append(f"{len(self.grey)} images are grayscale (e.g. {min(self.grey)}); "
                       "their grey is used for all three colour channels")
        if self.size_mismatch:
            name = min(self.size_mismatch)
            (w, h), (cw, ch) = self.size_mismatch[name]
            if self.prescaled:
                what = f"intrinsics scaled to the images (not exactly 1/{self.factor} of the camera)"
            else:
                what = "resized to the camera's size before training (intrinsics kept)"
            out.append(f"{len(self.size_mismatch)} images differ in size from their {self.camera_label} "
                       f"(e.g. {name}: {w}x{h}, camera {cw}x{ch}); {what}")
        return out

    def load(self, source: ViewSource) -> tuple[View, str | None]:
        """The view, and the distorted model name when it was undistorted (else None)."""
        file = source.file
        pil, mode = decode(file, self.composite_over)
        if mode in ALPHA_MODES:
            self.alpha.append(source.name)
        if mode in _GREY_MODES:
            self.grey.append(source.name)
        cam: pycolmap.Camera = copy.copy(source.camera)
        w, h = pil.size
        # Images and cameras must agree on aspect ratio; more than ~2 px off means the wrong files.
        sx, sy = w / cam.width, h / cam.height
        if abs(sx - sy) * max(cam.width, cam.height) > 2.0:
            raise UserError(
                f"image {file} is {w}x{h} but its {self.camera_label} is {cam.width}x{cam.height} "
                "(aspect ratios differ)"
            )
        if self.prescaled:
            target = (w, h)  # images_<factor>/ is used as it is; the camera follows its actual size
            if max(abs(w - cam.width / self.factor), abs(h - cam.height / self.factor)) > 1.0:
                self.size_mismatch[source.name] = ((w, h), (cam.width, cam.height))
        else:
            if (w, h) != (cam.width, cam.height):
                self.size_mismatch[source.name] = ((w, h), (cam.width, cam.height))
            target = (max(1, round(cam.width / self.factor)), max(1, round(cam.height / self.factor)))
        if (w, h) != target:
            # Area averaging (BOX) is the antialiased downscale; K follows the actual size ratio.
            pil = pil.resize(target, Image.Resampling.BOX)
        pixels = np.asarray(pil)

        camera_size = (cam.width, cam.height)
        distorted = cam.model_name not in PINHOLE_MODELS
        if distorted:
            # Downscale first, then undistort with the rescaled camera: same result as the other order
            # within ~1/255 mean abs (checked on the beer scene), and factor^2 less undistortion work.
            cam.rescale(target[0], target[1])
            try:
                out, pin = pycolmap.undistort_image(self.options, pycolmap.Bitmap.from_array(pixels), cam)
            except Exception as exc:
                raise UserError(f"cannot undistort {file} ({cam.model_name}): {exc}") from None
            pixels = np.ascontiguousarray(out.to_array()).reshape(pin.height, pin.width, -1)
            K = pin.calibration_matrix()
        else:
            K = cam.calibration_matrix().copy()
            # COLMAP puts the top-left pixel centre at (0.5, 0.5), so plain scaling keeps centres aligned.
            K[0, :] *= target[0] / cam.width
            K[1, :] *= target[1] / cam.height

        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if pixels.shape[2] == 1:
            pixels = np.repeat(pixels, 3, axis=2)

        # masks: same resize and undistortion as the image (data/masks.py)
        mask = self.masks.load(source.mask_name or source.name, file, (w, h), camera_size, target,
                               cam if distorted else None)
        viewmat = np.eye(4)
        viewmat[:3, :] = source.cam_from_world
        view = View(
            name=source.name,
            image=torch.from_numpy(np.array(pixels[:, :, :3], dtype=np.uint8, order="C")),
            K=torch.from_numpy(K.astype(np.float32)),
            viewmat=torch.from_numpy(viewmat.astype(np.float32)),
            mask=mask,
        )
        return view, (source.camera.model_name if distorted else None)


def decode(file: Path, composite_over: np.ndarray | None = None) -> tuple[Image.Image, str]:
    """(RGB PIL image, the file's own mode: alpha dropped or composited, grey expanded), or
    UserError if the file cannot be decoded. A palette image with a transparent colour counts as
    "RGBA"."""
    try:
        with Image.open(file) as img:
            img.load()
            mode = "RGBA" if img.mode == "P" and "transparency" in img.info else img.mode
            if img.mode.startswith("I;16") or img.mode in ("I", "F"):
                # 16-bit/float grey: PIL's convert("RGB") clips these, so scale to 8 bits ourselves.
                arr = np.asarray(img, dtype=np.float64)
                peak = 65535.0 if img.mode != "F" else max(float(arr.max()), 1.0)
                grey = np.clip(arr / peak * 255.0 + 0.5, 0, 255).astype(np.uint8)
                return Image.fromarray(grey).convert("RGB"), "L"
            if composite_over is not None and mode in ALPHA_MODES:
                return _composite(np.asarray(img.convert("RGBA")), composite_over), mode
            return img.convert("RGB"), mode
    except DECODE_ERRORS as exc:
        reason = str(exc).replace(f" '{file}'", "").strip() or type(exc).__name__
        raise UserError(f"cannot decode image {file}: {reason}") from None


def _composite(rgba: np.ndarray, background: np.ndarray) -> Image.Image:
    """Straight (non-premultiplied) alpha over a flat colour, rounded to 8 bits."""
    alpha = rgba[:, :, 3:4].astype(np.float64) / 255.0
    rgb = rgba[:, :, :3].astype(np.float64) * alpha + (255.0 * background) * (1.0 - alpha)
    return Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8))
