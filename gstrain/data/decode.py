"""One image file's pixels, with PIL and numpy only (no torch): what every image store decodes, in
the training process (threads) or in a decode worker process (data/decode_worker.py), which must
start without importing torch and give the same bytes.

decode(file)                      -> (RGB PIL image, the file's own mode)
decoded_array(file, target, over) -> [h, w, 3] uint8 at `target` (area-averaged when resized)
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
from PIL import Image

from gstrain.errors import UserError

ALPHA_MODES = ("RGBA", "LA", "PA", "La", "RGBa")  # PIL modes that carry an alpha channel
GREY_MODES = ("L", "LA", "La", "1")
# What PIL raises on bad image files (SyntaxError and struct.error come from some PNG/TIFF parsers).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def file_mode(img: Image.Image) -> str:
    """The mode the loader reports for an opened file, known from its header: a palette with a
    transparent colour counts as "RGBA", 16-bit and float grey as "L"."""
    if img.mode == "P" and "transparency" in img.info:
        return "RGBA"
    if img.mode.startswith("I;16") or img.mode in ("I", "F"):
        return "L"
    return img.mode


def probe_file(file: Path) -> tuple[tuple[int, int], str]:
    """((width, height), mode) from the file's header, without decoding its pixels."""
    try:
        with Image.open(file) as img:
            return img.size, file_mode(img)
    except DECODE_ERRORS as exc:
        raise UserError(f"cannot decode image {file}: {_reason(exc, file)}") from None


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
        raise UserError(f"cannot decode image {file}: {_reason(exc, file)}") from None


def decoded_array(file: Path, target: tuple[int, int], composite_over: np.ndarray | None = None) -> np.ndarray:
    """[h, w, 3] uint8 (C order) of `file` at target = (w, h): decode(), then area averaging (BOX,
    the antialiased downscale) when the file is another size. PIL decodes and resizes without the GIL."""
    pil, _ = decode(file, composite_over)
    if pil.size != tuple(target):
        pil = pil.resize(tuple(target), Image.Resampling.BOX)
    return np.array(np.asarray(pil), dtype=np.uint8, order="C")


def _reason(exc: BaseException, file: Path) -> str:
    return str(exc).replace(f" '{file}'", "").strip() or type(exc).__name__


def _composite(rgba: np.ndarray, background: np.ndarray) -> Image.Image:
    """Straight (non-premultiplied) alpha over a flat colour, rounded to 8 bits."""
    alpha = rgba[:, :, 3:4].astype(np.float64) / 255.0
    rgb = rgba[:, :, :3].astype(np.float64) * alpha + (255.0 * background) * (1.0 - alpha)
    return Image.fromarray(np.clip(np.rint(rgb), 0, 255).astype(np.uint8))
