"""Times the initial model's neighbour search (gstrain/knn.py) on a scene's SfM points: on the
CPU with a thread per core (up to 16) and on the GPU, with the two results compared.
    python -m bench.knn_time /tmp/city"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from gstrain.data.inputs import load_scene
from gstrain.knn import knn_sq_dists


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    args = ap.parse_args()
    scene = load_scene(args.scene, lazy=True, log=lambda m: None)
    pts = torch.as_tensor(scene.points, dtype=torch.float32)
    workers = max(1, min(16, len(os.sched_getaffinity(0))))
    began = time.perf_counter()
    on_cpu = knn_sq_dists(pts, 3, workers=workers)
    cpu_s = time.perf_counter() - began
    print(f"{len(pts)} points: CPU, {workers} threads: {cpu_s:.2f} s")
    if torch.cuda.is_available():
        knn_sq_dists(pts[:10_000].cuda(), 3)  # the first kernels' loading is not the search's
        torch.cuda.synchronize()
        began = time.perf_counter()
        on_gpu = knn_sq_dists(pts.cuda(), 3)
        torch.cuda.synchronize()
        gpu_s = time.perf_counter() - began
        same = torch.allclose(on_gpu.cpu().double(), on_cpu.double(), rtol=1e-4, atol=1e-8)
        print(f"GPU: {gpu_s:.2f} s ({cpu_s / gpu_s:.2f}x the CPU's speed); the same distances: {same}")


if __name__ == "__main__":
    main()
