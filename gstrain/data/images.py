"""Turn one posed image file into a View: decode, downscale, undistort to PINHOLE, read its mask.

Shared by every input format (data/colmap.py, data/transforms.py): a format says which file, which
pycolmap camera (any model pycolmap can undistort) and which world-to-camera pose; this module does
the pixels the same way for all of them. A view's header says what it needs (an ImageRecipe: size,
resize, undistortion map; cheap); the pixels are ImageRecipe.decoded (decode and resize, no GIL)
then ImageRecipe.undistorted (a remap in torch on the device the pixels are on: data/undistort.py).
A lazy scene (data.images_on = host | disk, and gpu on CUDA) keeps LazyViews: the image store
(data/image_store.py) decodes them and undistorts on the training device, so start-up reads headers
only. data.max_side caps the longer side after the factor, said in one note.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pycolmap
import torch

from gstrain.data.decode import ALPHA_MODES, GREY_MODES, decoded_array, probe_file
from gstrain.data.decode import DECODE_ERRORS as DECODE_ERRORS
from gstrain.data.masks import MaskReader
from gstrain.data.scene import View
from gstrain.data.undistort import UndistortMap, build_map, remap
from gstrain.errors import UserError

PINHOLE_MODELS = ("SIMPLE_PINHOLE", "PINHOLE")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp")



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
        max_side: int = 0, lazy: bool = False,
    ) -> None:
        self.max_side = max_side  # 0: no limit (data.max_side)
        self.lazy = lazy  # keep recipes (LazyView), decode later: data.images_on = host | disk
        self.masks = masks
        self.factor = factor
        self.prescaled = prescaled
        self.composite_over = None if composite_over is None else np.asarray(composite_over, np.float64)
        self.camera_label = camera_label
        self.options = pycolmap.UndistortCameraOptions()  # the pinhole's size and focal length
        # (model, size, params) of a rescaled distorted camera -> (pinhole, map): views that share
        # a camera (most captures) share one map, built once
        self.undistortions: dict[tuple, tuple[pycolmap.Camera, UndistortMap]] = {}
        self.undistortions_lock = threading.Lock()  # the loader's threads: one build per camera
        # name -> (file size, camera size) of images that did not match their camera
        self.size_mismatch: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.alpha: list[str] = []  # images with an alpha channel (a mask, or composited)
        self.grey: list[str] = []  # single-channel images spread to RGB
        # name -> (size after factor, size after max_side) of the images data.max_side shrank
        self.limited: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}

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
        if self.limited:
            name = min(self.limited)
            (w, h), (lw, lh) = self.limited[name]
            out.append(f"data.max_side={self.max_side}: {len(self.limited)} images downscaled so their "
                       f"longer side is at most {self.max_side} px (e.g. {name}: {w}x{h} -> {lw}x{lh})")
        return out

    def load(self, source: ViewSource) -> tuple[View, str | None]:
        """The view, and the distorted model name when it was undistorted (else None). A lazy
        loader reads the file's header only: its LazyView decodes when asked (the image store)."""
        file = source.file
        (w, h), mode = probe_file(file)
        if mode in ALPHA_MODES:
            self.alpha.append(source.name)
        if mode in GREY_MODES:
            self.grey.append(source.name)
        cam: pycolmap.Camera = copy.copy(source.camera)
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
        limited = fit_max_side(target, self.max_side)
        if limited != target:
            self.limited[source.name] = (target, limited)
            target = limited

        camera_size = (cam.width, cam.height)
        distorted = cam.model_name not in PINHOLE_MODELS
        undistort: UndistortMap | None = None
        if distorted:
            # Downscale first, then undistort with the rescaled camera: same result as the other order
            # within ~1/255 mean abs (checked on the beer scene), and factor^2 less undistortion work.
            cam.rescale(target[0], target[1])
            pin, undistort = self._undistortion(cam, file)
            K = pin.calibration_matrix()
            size = (int(pin.width), int(pin.height))
        else:
            K = cam.calibration_matrix().copy()
            # COLMAP puts the top-left pixel centre at (0.5, 0.5), so plain scaling keeps centres aligned.
            K[0, :] *= target[0] / cam.width
            K[1, :] *= target[1] / cam.height
            size = target
        recipe = ImageRecipe(file, target, size, undistort, self.composite_over)

        # masks: same resize and undistortion as the image (data/masks.py)
        mask = self.masks.load(source.mask_name or source.name, file, (w, h), camera_size, target, undistort)
        viewmat = np.eye(4)
        viewmat[:3, :] = source.cam_from_world
        K_t = torch.from_numpy(K.astype(np.float32))
        viewmat_t = torch.from_numpy(viewmat.astype(np.float32))
        view: View
        if self.lazy:
            view = LazyView(source.name, recipe, K_t, viewmat_t, mask)
        else:
            view = View(name=source.name, image=recipe.pixels(), K=K_t, viewmat=viewmat_t, mask=mask)
        return view, (source.camera.model_name if distorted else None)


    def _undistortion(self, cam: pycolmap.Camera, file: Path) -> tuple[pycolmap.Camera, UndistortMap]:
        """The pinhole pycolmap undistorts `cam` (rescaled to the decoded size) to, and the map."""
        key = (cam.model_name, cam.width, cam.height, tuple(float(p) for p in cam.params))
        with self.undistortions_lock:  # ~2 ms a camera, mostly under the GIL anyway
            found = self.undistortions.get(key)
            if found is None:
                try:
                    pin = pycolmap.undistort_camera(self.options, cam)
                    found = self.undistortions[key] = (pin, build_map(cam, pin))
                except Exception as exc:
                    raise UserError(f"cannot undistort {file} ({cam.model_name}): {exc}") from None
        return found


def fit_max_side(size: tuple[int, int], max_side: int) -> tuple[int, int]:
    """`size` (width, height) scaled down so its longer side is at most max_side (0: no limit),
    keeping the aspect ratio as closely as whole pixels allow."""
    w, h = size
    if max_side <= 0 or max(w, h) <= max_side:
        return size
    scale = max_side / max(w, h)
    return max(1, min(max_side, round(w * scale))), max(1, min(max_side, round(h * scale)))


@dataclass(frozen=True)
class ImageRecipe:
    """How to make one view's pixels: decode `file` (compositing alpha over `composite_over` when
    set), resize to `target` (area averaging), then undistort through `undistort` (None for pinhole
    cameras). `size` is the result's (width, height), known without decoding."""

    file: Path
    target: tuple[int, int]
    size: tuple[int, int]
    undistort: UndistortMap | None = field(default=None, compare=False)
    composite_over: np.ndarray | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        """The view's uint8 RGB bytes (undistorted)."""
        return self.size[0] * self.size[1] * 3

    @property
    def decoded_nbytes(self) -> int:
        """uint8 RGB bytes of decoded(): before undistortion, at `target`."""
        return self.target[0] * self.target[1] * 3

    def decoded(self) -> torch.Tensor:
        """[h, w, 3] uint8 on the CPU at `target`, not undistorted yet. Safe to call from several
        threads; PIL decodes and resizes without the GIL."""
        # resized by area averaging when the file is another size; K follows the actual size ratio
        return torch.from_numpy(decoded_array(self.file, self.target, self.composite_over))

    def undistorted(self, pixels: torch.Tensor) -> torch.Tensor:
        """decoded()'s pixels as the view's [H, W, 3] uint8 image, on their own device (the same
        kernels on every device, so a store that copies first gives what one that copies after does
        on the CPU, and every store on one device gives the same bytes)."""
        return pixels if self.undistort is None else remap(pixels, self.undistort)

    def pixels(self) -> torch.Tensor:
        """[H, W, 3] uint8 on the CPU. Safe to call from several threads."""
        return self.undistorted(self.decoded())


class LazyView(View):
    """A view that keeps its recipe instead of its pixels: `image` decodes on every access (not
    kept), width and height come from the recipe. Training reads it through an image store."""

    def __init__(self, name: str, recipe: ImageRecipe, K: torch.Tensor, viewmat: torch.Tensor,
                 mask: torch.Tensor | None = None) -> None:
        self.recipe = recipe
        super().__init__(name=name, image=None, K=K, viewmat=viewmat, mask=mask)  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def image(self) -> torch.Tensor:
        return self.recipe.pixels()

    @image.setter
    def image(self, value: torch.Tensor | None) -> None:
        if value is not None:  # View.__init__ sets None; anything else would be silently dropped
            raise AttributeError("a LazyView's pixels come from its recipe")

    def with_pose(self, viewmat: torch.Tensor) -> LazyView:
        """Still lazy: the recipe moves with it, nothing is decoded."""
        return LazyView(self.name, self.recipe, self.K, viewmat, self.mask)

    @property
    def width(self) -> int:
        return self.recipe.size[0]

    @property
    def height(self) -> int:
        return self.recipe.size[1]

    def __repr__(self) -> str:  # the dataclass repr would decode the image
        return f"LazyView(name={self.name!r}, file={str(self.recipe.file)!r}, size={self.recipe.size})"


def view_shape(view: View) -> tuple[int, int, int]:
    """(H, W, 3) of a view's image, without decoding a lazy one."""
    return view.height, view.width, 3


def decoded_shape(view: View) -> tuple[int, int, int]:
    """(h, w, 3) of what decoded_pixels gives: a lazy view's decode before undistortion."""
    if isinstance(view, LazyView):
        return view.recipe.target[1], view.recipe.target[0], 3
    return view_shape(view)


def decoded_pixels(view: View) -> torch.Tensor:
    """What an image store keeps or copies for a view ([h, w, 3] uint8, CPU): a lazy view's decode,
    not undistorted yet (view_map undistorts it on the training device); any other view's image."""
    return view.recipe.decoded() if isinstance(view, LazyView) else view.image


def view_map(view: View) -> UndistortMap | None:
    """The map that turns decoded_pixels into the view's image; None: they are its image."""
    return view.recipe.undistort if isinstance(view, LazyView) else None
