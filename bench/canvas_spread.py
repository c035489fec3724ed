"""How far two runs of the same training steps part, on the canvas path and off it.

    python -m bench.canvas_spread [--steps 30]

Writes the demo scene (16 views, 64x64) and runs pairs of eager trainers from one seed, thirty
steps without refinement, in lockstep: the plain path; the canvas path (the view padded into a
canvas, its size on the device: bench/graph_cases.eager_steps_on_the_canvas) at one size;
the same with the loss's valid size dropped; the same with gsplat's projection in place of ours
(render/sized_projection.py); and graph against eager steps on the demo cropped to four sizes.
Prints each pair's largest parameter difference relative to the parameter's largest value. Two
runs of one path part only by the rounding of the raster backward's float atomics, so a path
whose pair parts far more amplifies that noise somewhere. (It found one: until 8fa88a2 our
projection's backward left rounding noise where an isotropic Gaussian's quaternion gradient is
exactly zero, and Adam turned it into learning-rate-sized turns; bench/NOTES.md.) A
development study, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest
import torch

from bench.graph_cases import eager_steps_on_the_canvas, graph_trainer, mixed_sizes
from gstrain.data.colmap import load_scene
from gstrain.data.demo import write_demo_scene
from gstrain.train.trainer import seed_everything


def _gsplat_projection(means, quats, scales, viewmat, K, size):
    from gsplat import fully_fused_projection

    width, height = (int(v) for v in size.tolist())
    radii, means2d, depths, conics, _ = fully_fused_projection(
        means, None, quats, scales, viewmat[None], K[None], width, height, eps2d=0.3, near_plane=0.01, packed=False
    )
    return radii, means2d, depths, conics


def _pair(scene, folder: Path, graphs: tuple[bool, bool], steps: int) -> dict[str, str]:
    runs = []
    for i, on in enumerate(graphs):
        seed_everything(0)
        runs.append(graph_trainer(scene, folder, str(i), on, refine_start=1000))  # no refinement
    for step in range(steps):
        for run in runs:
            torch.cuda.manual_seed(1000 + step)
            run.step = step
            run.train_step(step)
    for run in runs:
        if run.graphs is not None:
            run.graphs.settle()
    a, b = runs
    out = {}
    for k, p in b.params.items():
        q = a.params[k].detach()
        out[k] = f"{float((q - p.detach()).abs().max() / p.detach().abs().max().clamp_min(1e-12)):.1e}"
    return out


def main() -> None:
    import gstrain.render.cuda as render_cuda
    import gstrain.train.fused_ssim as fused_ssim

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="canvas_spread-"))
    write_demo_scene(root / "scene", n_views=16, width=64, height=64, seed=0)
    one_size = load_scene(root / "scene")
    loss = fused_ssim.fused_photometric_loss
    variants = {  # name: (scene, canvas, loss without valid, gsplat's projection, graphs in the first run)
        "plain": (one_size, False, False, False, False),
        "canvas": (one_size, True, False, False, False),
        "canvas, loss without valid": (one_size, True, True, False, False),
        "canvas, gsplat's projection": (one_size, True, False, True, False),
        "four sizes, canvas, graph vs eager": (mixed_sizes(one_size), True, False, False, True),
        "four sizes, canvas, eager vs eager": (mixed_sizes(one_size), True, False, False, False),
    }
    for i, (name, (scene, canvas, no_valid, theirs, graphs)) in enumerate(variants.items()):
        patch = pytest.MonkeyPatch()
        if canvas:
            eager_steps_on_the_canvas(patch, (64, 64))
        if no_valid:
            patch.setattr(fused_ssim, "fused_photometric_loss", lambda img, gt, lam, valid=None: loss(img, gt, lam))
        if theirs:
            patch.setattr(render_cuda, "project_sized", _gsplat_projection)
        try:
            print(f"{name}: {_pair(scene, root / str(i), (graphs, False), args.steps)}", flush=True)
        finally:
            patch.undo()


if __name__ == "__main__":
    main()
