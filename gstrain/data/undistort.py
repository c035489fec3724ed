"""Undistortion to PINHOLE as a resampling on the device the image lives on.

pycolmap owns the camera models: where each undistorted pixel samples the distorted image comes
from pycolmap's own camera functions (the pinhole's cam_from_img, the distorted camera's
img_from_cam), evaluated once per camera at load time on a coarse grid (UndistortMap). Torch only
resamples: at use, the coarse map is upsampled bilinearly to full size and the image is sampled
bilinearly, so the per-image work is a few kernels on the GPU (or torch on the CPU) instead of
pycolmap.undistort_image's ~50-70 ms of a CPU core per 720x1280 photo. On a GPU with
dev.fused_remap, one kernel does both per pixel (data/csrc/remap.cu, as torch's kernels compute
them), so no full-resolution map is made or kept.

The result follows pycolmap.undistort_image (COLMAP's WarpImageBetweenCameras): the top-left pixel
centre is (0.5, 0.5); a pixel whose source point does not have all four bilinear neighbours inside
the distorted image (0 <= x < width - 1, likewise y, in pixel-index units) is black; values are
rounded half up to uint8. It differs from pycolmap by at most a level or two, where the coarse map's
interpolation or float32 moves a bilinear value across a rounding boundary.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pycolmap
import torch
import torch.nn.functional as F

from gstrain import extensions

# Spacing of the coarse map in undistorted pixels (at most; the grid spans the image exactly): 16 px,
# halved while bilinear interpolation between the nodes strays more than MAP_TOLERANCE px from
# pycolmap's own map at the cells' and edges' midpoints (where its error peaks). Beer's SIMPLE_RADIAL
# cameras at 720x1280 keep 16 px (0.007 px off); strong distortion at small sizes (a fisheye at
# 320x240) needs 4 px. A shift of 0.01 px moves a value by a level only where neighbours differ by 100.
MAP_STEP = 16
MIN_MAP_STEP = 2
MAP_TOLERANCE = 0.01
# A map whose checked points (nodes and midpoints) all keep this far inside the distorted image's
# bilinear range has no pixel to black out, and remap skips that test: ten times the tolerance.
# pycolmap.undistort_camera's default pinhole keeps 0.35 px or more inside on the tested cameras
# (beer's at factors 1, 2 and 8, and the four models of tests/test_undistort.py).
EDGE_MARGIN = 0.1
# A normalised coordinate far outside [-1, 1]: where pycolmap cannot project a node (no finite point).
_OUTSIDE = -8.0


@dataclass(frozen=True, eq=False)
class UndistortMap:
    """Where the undistorted image samples the distorted one, on a coarse grid.

    grid: [1, 2, rows, cols] float32, the source point (x, y) of each node in grid_sample's
    normalised units with align_corners=True (-1: the first pixel's centre, +1: the last's). Node
    (i, j) is undistorted pixel (j * (width - 1) / (cols - 1), i * (height - 1) / (rows - 1)), so
    F.interpolate(align_corners=True) to (height, width) gives every pixel's source point."""

    grid: torch.Tensor
    size: tuple[int, int]  # (width, height) of the undistorted image
    source: tuple[int, int]  # (width, height) of the distorted image it samples
    inside: bool = False  # every pixel's source point is EDGE_MARGIN inside: none is black

    @property
    def nbytes(self) -> int:
        return self.grid.numel() * self.grid.element_size()


def _nodes(length: int, step: int) -> np.ndarray:
    """Node positions 0 .. length - 1 (pixel indices), evenly spaced at most `step` apart."""
    count = max(2, math.ceil((length - 1) / step) + 1) if length > 1 else 1
    return np.linspace(0.0, length - 1, count)


def _source_points(distorted: pycolmap.Camera, pinhole: pycolmap.Camera, xs: np.ndarray,
                   ys: np.ndarray) -> np.ndarray:
    """[len(ys), len(xs), 2] where undistorted pixels (xs x ys, pixel indices) sample the distorted
    image, in pixel-index units (NaN where pycolmap projects no point), through pycolmap's models."""
    gx, gy = np.meshgrid(xs, ys)
    pixels = np.stack([gx.ravel() + 0.5, gy.ravel() + 0.5], axis=1)  # COLMAP: pixel centres at +0.5
    rays = pinhole.cam_from_img(pixels)
    points = distorted.img_from_cam(np.concatenate([rays, np.ones((len(rays), 1))], axis=1)) - 0.5
    return points.reshape(len(ys), len(xs), 2)


def _midpoints(nodes: np.ndarray) -> np.ndarray:
    """The nodes and the midpoints between them, in order."""
    out = np.empty(2 * len(nodes) - 1)
    out[0::2] = nodes
    out[1::2] = (nodes[:-1] + nodes[1:]) / 2
    return out


def build_map(distorted: pycolmap.Camera, pinhole: pycolmap.Camera, step: int = MAP_STEP,
              tolerance: float = MAP_TOLERANCE) -> UndistortMap:
    """The coarse map from `pinhole` (pycolmap.undistort_camera's result) to `distorted`, both at
    the sizes the images have when remapped: nodes `step` px apart, closer where interpolating
    them would stray more than `tolerance` px from pycolmap (0: keep `step`)."""
    width, height = int(pinhole.width), int(pinhole.height)
    src_w, src_h = int(distorted.width), int(distorted.height)
    while True:
        xs, ys = _nodes(width, step), _nodes(height, step)
        points = _source_points(distorted, pinhole, xs, ys)
        exact = _source_points(distorted, pinhole, _midpoints(xs), _midpoints(ys))  # holds the nodes too
        across = (points[:, :-1] + points[:, 1:]) / 2  # bilinear interpolation at the midpoints
        down = (points[:-1] + points[1:]) / 2
        centre = (down[:, :-1] + down[:, 1:]) / 2
        stray = np.concatenate([np.abs(across - exact[0::2, 1::2]).ravel(), np.abs(down - exact[1::2, 0::2]).ravel(),
                                np.abs(centre - exact[1::2, 1::2]).ravel()])
        if tolerance <= 0 or step <= MIN_MAP_STEP or stray.size == 0 or not np.isfinite(stray).all():
            break  # nodes pycolmap cannot project are black all the same
        if stray.max() <= tolerance:
            break
        step = max(MIN_MAP_STEP, step // 2)
    low, high = EDGE_MARGIN, np.array([src_w - 1.0, src_h - 1.0]) - EDGE_MARGIN
    inside = bool(np.isfinite(exact).all() and (exact >= low).all() and (exact <= high).all())
    grid = np.full(points.shape, _OUTSIDE)
    if src_w > 1 and src_h > 1:  # a one-pixel side has no bilinear pair: every pixel is black in COLMAP
        scale = np.array([2.0 / (src_w - 1), 2.0 / (src_h - 1)])
        finite = np.isfinite(points).all(axis=2)
        grid[finite] = points[finite] * scale - 1.0
    coarse = torch.from_numpy(np.ascontiguousarray(grid.astype(np.float32).transpose(2, 0, 1))[None])
    return UndistortMap(coarse, (width, height), (src_w, src_h), inside)


DENSE_MAP_BYTES = 64 * 2**20  # full-resolution maps an image store keeps: three 1080p cameras' (9 B a pixel)
DenseMap = tuple[torch.Tensor, torch.Tensor | None]  # every pixel's source point, and which are inside (None: all)


def dense_map(undistort: UndistortMap, device: torch.device) -> DenseMap:
    """The map at full resolution on `device`: each pixel's source point [1, H, W, 2] (bilinear
    between the coarse nodes), and where not every pixel is inside, [1, 1, H, W] whether all four
    of its source neighbours are (COLMAP blacks out the rest). What remap computes, kept by image
    stores so that a streamed image is only resampled (9 bytes a pixel)."""
    width, height = undistort.size
    coarse = undistort.grid.to(device, non_blocking=True)
    grid = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=True).permute(0, 2, 3, 1)
    if undistort.inside:
        return grid, None
    return grid, ((grid >= -1.0) & (grid < 1.0)).all(dim=3, keepdim=True).permute(0, 3, 1, 2)


class DenseMaps:
    """The last few cameras' full-resolution undistortion maps (dense_map), so a streamed image
    costs one resampling, not the map's interpolation too. Bounded in bytes: a capture whose every
    photo has its own camera keeps only the last few (and interpolates as before)."""

    def __init__(self, max_bytes: int = DENSE_MAP_BYTES) -> None:
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.maps: OrderedDict[tuple[int, torch.device], DenseMap] = OrderedDict()
        self.nbytes = 0

    def get(self, undistort: UndistortMap, device: torch.device) -> DenseMap:
        with self.lock:
            return self._get(undistort, device)

    def _get(self, undistort: UndistortMap, device: torch.device) -> DenseMap:
        key = (id(undistort), device)
        found = self.maps.get(key)
        if found is not None:
            self.maps.move_to_end(key)
            return found
        dense = dense_map(undistort, device)
        size = sum(t.numel() * t.element_size() for t in dense if t is not None)
        while self.maps and self.nbytes + size > self.max_bytes:
            _key, old = self.maps.popitem(last=False)
            self.nbytes -= sum(t.numel() * t.element_size() for t in old if t is not None)
        if size <= self.max_bytes:
            self.maps[key] = dense
            self.nbytes += size
        return dense


def remap(image: torch.Tensor, undistort: UndistortMap, dense: DenseMap | None = None,
          fused: bool = False) -> torch.Tensor:  # fmt: skip
    """[H, W, C] uint8 undistorted, on `image`'s device, from the distorted [h, w, C] uint8 `image`
    (h, w: undistort.source); dense: dense_map(undistort, image.device) when the caller keeps it.
    The same kernels on every device; deterministic. fused (dev.fused_remap; CUDA only): one kernel
    reads the coarse map and the image (data/csrc/remap.cu), no dense map, the same values up to
    float rounding (a level, rarely)."""
    if (image.shape[1], image.shape[0]) != undistort.source:
        raise ValueError(f"image is {image.shape[1]}x{image.shape[0]}, the map samples "
                         f"{undistort.source[0]}x{undistort.source[1]}")
    width, height = undistort.size
    if fused and image.is_cuda:
        coarse = undistort.grid.to(image.device, non_blocking=True)
        return extensions.remap().remap_uint8(image.contiguous(), coarse, width, height, not undistort.inside)
    grid, inside = dense if dense is not None else dense_map(undistort, image.device)
    # + 0.5 (the bilinear weights sum to 1), then truncation to uint8: rounded half up, as COLMAP does
    source = image.permute(2, 0, 1).unsqueeze(0) + 0.5  # float32
    sampled = F.grid_sample(source, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    if inside is not None:
        # COLMAP blacks out a pixel unless all four neighbours are inside; grid_sample's zero
        # padding would blend the edge pixels with zeros instead
        sampled = sampled.mul_(inside)
    out = torch.empty((height, width, image.shape[2]), dtype=torch.uint8, device=image.device)
    return out.copy_(sampled[0].permute(1, 2, 0))


def pin_maps(maps: list[UndistortMap | None]) -> list[UndistortMap | None]:
    """The maps with their grids in one block of pinned host memory, so that remap's copy to a
    CUDA device is asynchronous (a copy from pageable memory may wait for the stream). Views that
    share a map (one camera) share its pinned copy."""
    distinct = list({id(m): m for m in maps if m is not None}.values())
    if not distinct:
        return maps
    block = torch.cat([m.grid.reshape(-1) for m in distinct]).pin_memory()
    pinned: dict[int, UndistortMap] = {}
    offset = 0
    for m in distinct:
        count = m.grid.numel()
        pinned[id(m)] = UndistortMap(block[offset : offset + count].view(m.grid.shape), m.size, m.source, m.inside)
        offset += count
    return [None if m is None else pinned[id(m)] for m in maps]
