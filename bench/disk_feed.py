"""Steps a second of a stand-in training loop fed by each image store: how much data.images_on=disk
costs a host-bound step, with decode processes and with decode threads, against resident images.

    python -m bench.disk_feed SCENE_DIR [--device cuda] [--step-ms 1.5] [--steps 600] [--workers N]

Each step runs `--step-ms` of plain Python (the host time of a graph-replayed training step, which
holds the GIL all the while) and then draws its image as the trainer does (the step's view, then
a prefetch of the sampler's next ones). A decode thread must win the GIL from that loop several
times an image; a decode process never needs it. Prints ms a step for each store and its ratio to
resident images.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gstrain.choices import DECODE_IN
from gstrain.data.colmap import load_scene
from gstrain.data.image_store import DISK_WORKERS, DiskStore, ResidentStore, TrainImages
from gstrain.train.context import TrainViews
from gstrain.train.run_state import ViewSampler


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            pass


def ms_per_step(store, n: int, step_s: float, steps: int, warmup: int) -> float:
    sampler = ViewSampler(n, seed=0)
    views = TrainViews(store.images if isinstance(store, ResidentStore) else TrainImages(store), [], [])
    start = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        _busy(step_s)
        for idx in views.draw(sampler):
            views.images[idx]
    if store.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--step-ms", type=float, default=1.5)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--workers", type=int, default=DISK_WORKERS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    eager = load_scene(args.scene, test_every=0)
    lazy = load_scene(args.scene, test_every=0, lazy=True)
    n = len(eager.train)
    h, w, _ = eager.train[0].image.shape
    print(f"{args.scene}: {n} views of {w}x{h}, {args.step_ms} ms of Python a step, {args.steps} steps, "
          f"{args.workers} decode workers, device {device}", flush=True)
    resident = ms_per_step(ResidentStore(eager.train, device), n, args.step_ms / 1e3, args.steps, args.warmup)
    print(f"resident: {resident:.3f} ms a step", flush=True)
    for decode_in in DECODE_IN:
        store = DiskStore(lazy.train, device, workers=args.workers, decode_in=decode_in)
        ms = ms_per_step(store, n, args.step_ms / 1e3, args.steps, args.warmup)
        note = store.note()
        store.close()
        print(f"disk, decode_in={decode_in}: {ms:.3f} ms a step, {ms / resident:.3f}x resident; {note or 'no waits'}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
