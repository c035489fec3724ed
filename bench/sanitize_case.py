"""A tiny forward + backward of every atomic mode, for compute-sanitizer (memcheck, racecheck).

Run by bench/gpu_tests.sh as
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 -m bench.sanitize_case
(no caching allocator, so an access past a tensor's end leaves its own allocation and is seen).
Sizes are not multiples of 16, two cameras, background and absgrad on (up to 32 channels), and
channel counts that take the direct (3), padded (5) and chunked (40) paths; then the culled
tile intersection (dev.ellipse_cull) on the same cameras, the training-step kernels, and a
step's kernels on a canvas (the device-sized projection, intersection, loss and statistics), and
the fused SH colours at every degree.
"""

from __future__ import annotations

import math
import sys

import torch


def main() -> int:
    from gsplat import fully_fused_projection, isect_offset_encode, isect_tiles

    from gstrain.choices import ATOMIC_MODES
    from gstrain.render.arc import ArcTuner
    from gstrain.render.cuda import rasterize_cuda

    gen = torch.Generator().manual_seed(0)
    n, width, height, n_cams = 96, 37, 29, 2
    z = 2.0 + 3.0 * torch.rand(n, generator=gen)
    means = torch.cat([(torch.rand(n, 2, generator=gen) - 0.5) * z[:, None], z[:, None]], 1).cuda()
    quats = torch.randn(n, 4, generator=gen).cuda()
    scales = torch.exp(-3.0 + torch.rand(n, 3, generator=gen)).cuda()
    viewmats = torch.eye(4).repeat(n_cams, 1, 1)
    viewmats[1, 0, 3] = 0.2
    f = 0.9 * width
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    radii, means2d, depths, conics, _ = fully_fused_projection(
        means, None, quats, scales, viewmats.cuda(), K.repeat(n_cams, 1, 1).cuda(), width, height
    )
    tw, th = math.ceil(width / 16), math.ceil(height / 16)
    _, isect_ids, flatten_ids = isect_tiles(means2d, radii, depths, 16, tw, th, n_images=n_cams)
    offsets = isect_offset_encode(isect_ids, n_cams, tw, th)
    opac = (0.05 + 0.9 * torch.rand(n_cams, n, generator=gen)).cuda()

    runs = [(mode, vector, 3) for mode in ATOMIC_MODES for vector in (False, True)]
    runs += [("distwar", True, 5), ("distwar", False, 40)]
    for mode, vector, ch in runs:
        m2 = means2d.detach().clone().requires_grad_(True)
        con = conics.detach().clone().requires_grad_(True)
        col = torch.rand(n_cams, n, ch, generator=gen).cuda().requires_grad_(True)
        op = opac.clone().requires_grad_(True)
        bg = torch.rand(n_cams, ch, generator=gen).cuda().requires_grad_(True)
        image, alpha = rasterize_cuda(
            m2, con, col, op, width, height, 16, offsets, flatten_ids, backgrounds=bg, absgrad=ch <= 32,
            atomic_mode=mode, atomic_threshold=4, tuner=ArcTuner(candidates=(2, 8), reps=1),
            vector_atomics=vector,
        )  # fmt: skip
        (image.sum() + alpha.square().sum()).backward()
        torch.cuda.synchronize()
        grads = [m2.grad, con.grad, col.grad, op.grad, bg.grad] + ([m2.absgrad] if ch <= 32 else [])
        if not all(torch.isfinite(g).all() for g in grads):
            print(f"sanitize case: non-finite gradient in mode={mode} vector={vector} ch={ch}")
            return 1
    print(f"sanitize case: {len(runs)} forward+backward runs done, {flatten_ids.numel()} intersections")
    if culled_intersection_case(means2d, radii, depths, conics, opac, offsets, flatten_ids, width, height):
        return 1
    return step_kernels_case(gen) or canvas_case(gen) or sh_colors_case(gen)


def sh_colors_case(gen: torch.Generator) -> int:
    """render/sh_colors.py: 301 Gaussians (not a multiple of the block), some invisible, every
    degree with shN holding 15 coefficients (more than degrees 0-2 read)."""
    from gstrain.render.sh_colors import sh_colors

    n = 301
    means = (torch.randn(n, 3, generator=gen) * 2.0).cuda().requires_grad_(True)
    sh0 = torch.randn(n, 1, 3, generator=gen).cuda().requires_grad_(True)
    shN = torch.randn(n, 15, 3, generator=gen).cuda().requires_grad_(True)
    radii = torch.randint(0, 3, (1, n, 2), generator=gen, dtype=torch.int32).cuda()
    viewmat = torch.eye(4).cuda()
    viewmat[2, 3] = 3.0
    for degree in range(4):
        sh_colors(means, sh0, shN, viewmat, radii, degree).square().sum().backward()
    torch.cuda.synchronize()
    if not all(torch.isfinite(g).all() for g in (means.grad, sh0.grad, shN.grad)):
        print("sanitize case: the SH colour kernels gave non-finite gradients")
        return 1
    print("sanitize case: SH colour kernels done, degrees 0-3")
    return 0


def culled_intersection_case(means2d, radii, depths, conics, opac, offsets, flatten_ids, width, height) -> int:
    """The culled intersection kernels (dev.ellipse_cull) on the same two cameras."""
    from gstrain import extensions
    from gstrain.render.cull import cull_pairs
    from gstrain.render.isect import culled_intersection

    ours = culled_intersection(extensions.raster(), means2d, radii, depths, conics, opac, width, height, 16)
    oracle = cull_pairs(means2d, conics, opac, offsets, flatten_ids, width, height, 16)
    torch.cuda.synchronize()
    same = torch.equal(ours.flatten_ids, oracle.flatten_ids) and torch.equal(ours.isect_offsets, oracle.isect_offsets)
    if not same:
        print("sanitize case: the culled intersection differs from isect_tiles + cull_pairs")
        return 1
    print(f"sanitize case: culled intersection done, {ours.pairs_before} -> {ours.pairs_after} pairs")
    return 0


def step_kernels_case(gen: torch.Generator) -> int:
    """The training-step kernels: multi-tensor Adam (dense, sparse, more tensors than one launch
    takes) and the densification statistics, on sizes that end mid-block."""
    from bench.builds import build_all
    from gstrain.train.fused_adam import FusedAdam

    n = 1037
    shapes = [(n, 3), (n, 3), (n, 4), (n,), (n, 1, 3), (n, 15, 3), (n, 2), (n, 5), (n, 1)]  # 9 > 8 per launch
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in shapes]
    optimizers = {f"p{i}": torch.optim.Adam([p], lr=1e-3) for i, p in enumerate(params)}
    visible = (torch.rand(n, generator=gen) > 0.5).cuda()
    adam = FusedAdam()
    for mask in (None, visible):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).cuda()
        adam.step(optimizers, mask)
    grad = torch.randn(n, 2, generator=gen).cuda()
    radii = torch.randint(0, 3, (n, 2), generator=gen, dtype=torch.int32).cuda()
    grad2d, count = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    build_all(["step_ops"])["step_ops"].grad2d_stats(grad, radii, 160.0, 90.0, grad2d, count, None, None)
    torch.cuda.synchronize()
    if not all(torch.isfinite(p).all() for p in params) or not torch.isfinite(grad2d).all():
        print("sanitize case: non-finite values from the step kernels")
        return 1
    print("sanitize case: step kernels done")
    return 0


def canvas_case(gen: torch.Generator) -> int:
    """train/graph_step.py's canvas: a 37x29 view inside a 53x45 canvas, the size on the device."""
    from bench.builds import build_all
    from gstrain import extensions
    from gstrain.render.isect import PairBudget, capped_intersection
    from gstrain.render.sized_projection import project_sized
    from gstrain.train.fused_ssim import fused_photometric_loss

    n, (cw, ch), (vw, vh) = 301, (53, 45), (37, 29)
    z = 2.0 + 3.0 * torch.rand(n, generator=gen)
    means = torch.cat([(torch.rand(n, 2, generator=gen) - 0.5) * 2.0 * z[:, None], z[:, None]], 1).cuda()
    quats = torch.randn(n, 4, generator=gen).cuda().requires_grad_(True)
    scales = torch.exp(-3.0 + torch.rand(n, 3, generator=gen)).cuda().requires_grad_(True)
    means.requires_grad_(True)
    K = torch.tensor([[0.9 * vw, 0.0, vw / 2], [0.0, 0.9 * vw, vh / 2], [0.0, 0.0, 1.0]]).cuda()
    valid = torch.tensor([vw, vh], dtype=torch.int32).cuda()
    radii, m2d, depths, conics = project_sized(means, quats, scales, torch.eye(4).cuda(), K, valid)
    opac = (0.05 + 0.9 * torch.rand(1, n, generator=gen)).cuda()
    stats = torch.zeros(4, 3, dtype=torch.int64, device="cuda")
    budget = PairBudget(1 << 12, torch.ones(1, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
                        stats, slot=torch.tensor([2], dtype=torch.int32).cuda())  # fmt: skip
    capped_intersection(extensions.raster(), m2d.detach(), radii, depths, conics.detach(), opac, cw, ch, 16, budget,
                        valid)  # fmt: skip
    img = torch.rand(ch, cw, 3, generator=gen).cuda().requires_grad_(True)
    loss, _ = fused_photometric_loss(img, torch.rand(ch, cw, 3, generator=gen).cuda(), 0.2, valid=valid)
    loss.backward()
    (m2d.sum() + conics.sum() + depths.sum()).backward()
    grad2d, count = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    build_all(["step_ops"])["step_ops"].grad2d_stats(torch.randn(n, 2, generator=gen).cuda(), radii[0], 0.5, 0.5,
                                                      grad2d, count, None, valid)  # fmt: skip
    torch.cuda.synchronize()
    grads = (means.grad, quats.grad, scales.grad, img.grad, grad2d)
    if not all(torch.isfinite(g).all() for g in grads) or int(stats[2, 1]) == 0:
        print("sanitize case: the canvas kernels gave non-finite values or no pairs")
        return 1
    print(f"sanitize case: canvas kernels done, {int(stats[2, 1])} pairs in the view")
    return 0


if __name__ == "__main__":
    sys.exit(main())
