"""Per-photo cost of undistortion on a COLMAP scene: decode (PIL), pycolmap.undistort_image, and
gstrain's remap (data/undistort.py: the map built once per camera, then torch per image) on the CPU
on one thread, and on CUDA when there is a GPU (the copy of the decoded photo included). --threads N
adds the photos per second of N threads (each torch op on one thread) for decode + pycolmap, decode +
remap on the CPU, and decode alone (what images_on=disk's workers do when the remap runs on the GPU).

    python bench/undistort_cost.py ../shared/data/beer --images 24 [--factor 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pycolmap
import torch
from PIL import Image

from gstrain.data.undistort import build_map, pin_maps, remap


def _ms(samples: list[float]) -> str:
    return f"{1e3 * statistics.median(samples):.2f} ms (median of {len(samples)})"


def _decode(file: Path, factor: int) -> np.ndarray:
    with Image.open(file) as f:
        pil = f.convert("RGB")
        if factor > 1:
            pil = pil.resize((round(f.size[0] / factor), round(f.size[1] / factor)), Image.Resampling.BOX)
    return np.asarray(pil)


def _throughput(images: list, work: Callable, threads: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        began = time.perf_counter()
        list(pool.map(work, images))
        return len(images) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scene", type=Path)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--factor", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rec = pycolmap.Reconstruction(str(args.scene / "sparse" / "0"))
    images = sorted(rec.images.values(), key=lambda im: im.name)[: args.images]
    options = pycolmap.UndistortCameraOptions()
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    times: dict[str, list[float]] = {k: [] for k in ("decode", "pycolmap", "map", "remap_cpu", "remap_cuda")}
    worst = 0
    maps, cameras = {}, {}
    for im in images:
        began = time.perf_counter()
        pixels = _decode(args.scene / "images" / im.name, args.factor)
        times["decode"].append(time.perf_counter() - began)
        camera = im.camera
        camera.rescale(pixels.shape[1], pixels.shape[0])
        began = time.perf_counter()
        out, pin = pycolmap.undistort_image(options, pycolmap.Bitmap.from_array(pixels), camera)
        reference = np.asarray(out.to_array()).reshape(pin.height, pin.width, 3)
        times["pycolmap"].append(time.perf_counter() - began)
        began = time.perf_counter()
        undistort = maps[im.name] = build_map(camera, pycolmap.undistort_camera(options, camera))
        cameras[im.name] = camera
        times["map"].append(time.perf_counter() - began)
        tensor = torch.from_numpy(pixels.copy())
        began = time.perf_counter()
        ours = remap(tensor, undistort)
        times["remap_cpu"].append(time.perf_counter() - began)
        worst = max(worst, int((ours.int() - torch.from_numpy(reference).int()).abs().max()))
        if cuda is not None:
            pinned_map, pinned = pin_maps([undistort])[0], tensor.pin_memory()
            assert pinned_map is not None
            for _ in range(3):  # warm: kernels and the allocator's blocks
                remap(pinned.to(cuda, non_blocking=True), pinned_map)
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(20):
                remap(pinned.to(cuda, non_blocking=True), pinned_map)
            torch.cuda.synchronize()
            times["remap_cuda"].append((time.perf_counter() - began) / 20)
    print(f"{len(images)} photos of {args.scene} at factor {args.factor} ({pixels.shape[1]}x{pixels.shape[0]}), "
          "one CPU thread")
    print(f"  decode (+ BOX resize):        {_ms(times['decode'])}")
    print(f"  pycolmap.undistort_image:     {_ms(times['pycolmap'])}")
    print(f"  build_map (once per camera):  {_ms(times['map'])}")
    print(f"  remap, torch on the CPU:      {_ms(times['remap_cpu'])}")
    if times["remap_cuda"]:
        print(f"  remap on CUDA (copy + remap): {_ms(times['remap_cuda'])}")
    print(f"  largest difference from pycolmap: {worst} levels")
    if args.threads > 0:
        def old(im) -> None:
            pixels = _decode(args.scene / "images" / im.name, args.factor)
            pycolmap.undistort_image(options, pycolmap.Bitmap.from_array(pixels), cameras[im.name])

        def new(im) -> None:
            remap(torch.from_numpy(_decode(args.scene / "images" / im.name, args.factor).copy()), maps[im.name])

        def plain(im) -> None:
            _decode(args.scene / "images" / im.name, args.factor)

        for label, work in (("decode + pycolmap", old), ("decode + remap (CPU)", new), ("decode only", plain)):
            print(f"  {args.threads} threads, {label}: {_throughput(images, work, args.threads):.1f} photos/s")


if __name__ == "__main__":
    main()
