"""Per-view masks: which pixels of a training or test image count.

A mask comes from masks/ beside images/ (same stem, any format PIL reads; masks_<factor>/ when
the images come from images_<factor>/ and it has the file), else from the image's own alpha
channel. White (>= 0.5) keeps a pixel, black ignores it; grey is thresholded at 0.5, so a mask
is binary: the masked loss and metrics need a count of kept pixels, and a soft edge of a few
pixels is not worth a second meaning. Masks follow the image through the downscale (area
averaging, then the threshold) and the undistortion (the image's own remap, data/undistort.py, of
the mask as a grey channel, then the threshold; pixels outside the distorted frame become "ignore"):
the same source points as the image's pixels, and no pycolmap call holding the GIL per view while
the scene loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gstrain.data.decode import ALPHA_MODES
from gstrain.data.scene import View
from gstrain.data.undistort import UndistortMap, remap
from gstrain.errors import UserError


class MaskReader:
    """Finds, reads, resizes and undistorts the mask of one image; safe to call from several threads."""

    def __init__(self, root: Path, image_dir: Path, alpha_masks: bool = True) -> None:
        self.alpha_masks = alpha_masks  # False where alpha was composited away (data/images.py)
        self.dirs = [d for d in _mask_dirs(root, image_dir) if d.is_dir()]
        self.index = [_index(d) for d in self.dirs]

    def find(self, name: str) -> Path | None:
        """masks/<name without its suffix>.* (or masks/<name>.*); the first mask folder that has one."""
        stem = str(Path(name).with_suffix(""))
        for index in self.index:
            for key in (stem, name):
                found = index.get(key)
                if found is not None:
                    return found
        return None

    def load(
        self,
        name: str,
        image_file: Path,
        raw_size: tuple[int, int],
        camera_size: tuple[int, int],
        target: tuple[int, int],
        undistort: UndistortMap | None,
    ) -> torch.Tensor | None:
        """[H, W] bool (True = keep) at the view's final resolution, or None when the image has no mask.

        raw_size: the image file's size; camera_size: its COLMAP camera's; target: the size the image
        was resized to; undistort: the image's undistortion map when it is undistorted.
        """
        file = self.find(name)
        if file is not None:
            weight = _read_mask_file(file, raw_size, camera_size, image_file)
        else:
            weight = _read_alpha(image_file) if self.alpha_masks else None
            if weight is None:
                return None
        if weight.shape[::-1] != target:
            weight = np.asarray(Image.fromarray(weight, mode="F").resize(target, Image.Resampling.BOX))
        if undistort is not None:
            grey = np.clip(weight * 255.0 + 0.5, 0, 255).astype(np.uint8)
            # resampled bilinearly as one more channel of the image, then the threshold (0.5 of 255)
            return remap(torch.from_numpy(grey[:, :, None]), undistort)[:, :, 0] >= 128
        return torch.from_numpy(np.ascontiguousarray(weight >= 0.5))


def _mask_dirs(root: Path, image_dir: Path) -> list[Path]:
    """masks_<N>/ first when the images come from images_<N>/, then masks/."""
    dirs = []
    if image_dir.name.startswith("images_"):
        dirs.append(root / f"masks_{image_dir.name.removeprefix('images_')}")
    dirs.append(root / "masks")
    return dirs


def _index(mask_dir: Path) -> dict[str, Path]:
    """Relative path without its suffix -> file; two files for one stem are a user error."""
    index: dict[str, Path] = {}
    for file in sorted(mask_dir.rglob("*")):
        if not file.is_file() or file.name.startswith("."):
            continue
        key = str(file.relative_to(mask_dir).with_suffix(""))
        if key in index:
            raise UserError(f"two masks for one image: {index[key]} and {file}")
        index[key] = file
    return index


def _read_mask_file(file: Path, raw_size: tuple[int, int], camera_size: tuple[int, int], image: Path) -> np.ndarray:
    """The mask as float32 [H, W] in [0, 1]; its size must be its image's or its camera's."""
    try:
        with Image.open(file) as img:
            img.load()
            size = img.size
            if img.mode in ("I", "F") or img.mode.startswith("I;16"):
                arr = np.asarray(img, dtype=np.float32)
                weight = arr / (65535.0 if img.mode != "F" else max(float(arr.max()), 1.0))
            else:
                weight = np.asarray(img.convert("L"), dtype=np.float32) / 255.0
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as exc:
        raise UserError(f"cannot decode mask {file}: {exc}") from None
    if size not in (raw_size, camera_size):
        raise UserError(
            f"mask {file} is {size[0]}x{size[1]} but its image {image} is {raw_size[0]}x{raw_size[1]}"
        )
    return np.ascontiguousarray(weight, dtype=np.float32)


def _read_alpha(image_file: Path) -> np.ndarray | None:
    """The image's alpha channel as float32 [H, W] in [0, 1], or None when it has none.

    Opening reads only the header, so images without alpha are not decoded a second time.
    """
    try:
        with Image.open(image_file) as img:
            if img.mode not in ALPHA_MODES and "transparency" not in img.info:
                return None
            alpha = img.convert("RGBA").getchannel("A")
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise UserError(f"cannot decode image {image_file}: {exc}") from None
    weight = np.asarray(alpha, dtype=np.float32) / 255.0
    return weight if (weight < 0.5).any() else None  # an opaque alpha channel masks nothing


def mask_note(views: list[View], reader: MaskReader) -> str | None:
    """One line for the user: how many views have masks and how many of their pixels are ignored."""
    masked = [v.mask for v in views if v.mask is not None]
    if not masked:
        if reader.dirs:  # a masks folder that matches nothing is almost surely misnamed files
            return (f"masks: {reader.dirs[-1]} holds no mask for any of the {len(views)} images "
                    "(a mask needs its image's file stem); training on every pixel")
        return None
    total = sum(int(m.numel()) for m in masked)
    ignored = total - sum(int(m.sum()) for m in masked)
    empty = sum(1 for m in masked if not m.any())
    return (
        f"masks: {len(masked)} of {len(views)} views have a mask; {ignored} of their {total} pixels "
        f"({100.0 * ignored / max(total, 1):.1f}%) are ignored"
        + (f"; {empty} of them ignore every pixel (those views teach nothing)" if empty else "")
    )
