"""Pure-PyTorch reference renderer: the CPU training path and the ground truth for our kernels.

Everything follows docs/CONVENTIONS.md exactly (projection as gsplat's fully_fused_projection,
per-tile compositing with the 1/255 skip, gsplat's 0.999 alpha cap and the exclusive 1e-4 stop rule).

Rasterization cost follows the overlaps, not pixels x Gaussians:
- (tile, Gaussian) pairs by CONVENTIONS' tile rule, sorted by (tile, depth), stably;
- each tile's list is split over its 8x8 pixel cells, dropping Gaussians whose alpha is provably
  < 1/255 on the whole cell (they would be skipped anyway: no pixel changes);
- cells of similar list lengths are evaluated together as dense [cells, 64 pixels, 32 Gaussians]
  blocks, front to back, carrying each pixel's T; a cell leaves once all its pixels stopped.
The backward is written by hand (_RasterizeFn). The same compositing written plainly and
differentiated by autograd is kept as `_rasterize(..., use_autograd=True)`; the tests check the
two against each other, against a per-pixel loop and against finite differences.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gstrain.render.common import phase, strategy_info
from gstrain.render.sh import num_sh_bases, sh_to_color

__all__ = ["Projection", "project_gaussians", "rasterize", "render_reference", "sh_to_color"]

ALPHA_MAX = 0.999  # gsplat's cap (the original 3DGS uses 0.99)
ALPHA_MIN = 1.0 / 255.0
T_MIN = 1e-4
RADIUS_SIGMAS = 3.33
# elements of one dense [cells, pixels, K] block; small enough to stay in cache on a CPU
CHUNK_ELEMS = 1 << 18
# side of the pixel cells the (tile, Gaussian) lists are refined to (a divisor of the tile size)
CELL = 8
# Gaussians composited per step; a cell leaves once all its pixels stopped
SEGMENT = 32
# forward intermediates kept for the backward (beyond this, segments are recomputed)
SAVE_BYTES = 1 << 29


@dataclass
class Projection:
    means2d: Tensor  # [N,2] pixel coords
    conics: Tensor  # [N,3] (a,b,c) of the inverse 2D covariance
    depths: Tensor  # [N]
    radii: Tensor  # [N,2] int32, 0 = culled


def _quat_to_rotmat(quats: Tensor) -> Tensor:
    """[N,4] (w,x,y,z), any length -> [N,3,3] rotation."""
    q = quats / quats.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    w, x, y, z = q.unbind(-1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]  # fmt: skip
    return torch.stack(rows, dim=-1).reshape(q.shape[:-1] + (3, 3))


def project_gaussians(
    means: Tensor,
    quats: Tensor,
    scales: Tensor,
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    eps2d: float = 0.3,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
) -> Projection:
    """EWA projection of 3D Gaussians through a pinhole camera (gsplat's fully_fused_projection).

    means [N,3], quats [N,4] (w,x,y,z, unnormalised), scales [N,3] LINEAR, viewmat [4,4]
    world-to-camera, K [3,3]. Culled Gaussians get radii 0; their other outputs stay finite so
    that they receive zero (not NaN) gradients.
    """
    viewmat = viewmat.to(means)
    K = K.to(means)
    rot = _quat_to_rotmat(quats)
    r_cam, t_cam = viewmat[:3, :3], viewmat[:3, 3]
    means_c = means @ r_cam.T + t_cam
    m = r_cam @ (rot * scales[:, None, :])  # camera-space R S
    cov_c = m @ m.transpose(-1, -2)

    depths = means_c[:, 2]
    in_depth = (depths > near_plane) & (depths < far_plane)
    # a stand-in depth for culled Gaussians: no division by ~0, hence no inf/NaN in backward
    z = torch.where(in_depth, depths, torch.ones_like(depths))
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    u = means_c[:, 0] / z
    v = means_c[:, 1] / z

    # gsplat clamps the Jacobian's x/z, y/z to the view frustum widened by 0.3 tan(half fov)
    tan_x = 0.5 * width / fx
    tan_y = 0.5 * height / fy
    uc = torch.clamp(u, min=-(cx / fx + 0.3 * tan_x), max=(width - cx) / fx + 0.3 * tan_x)
    vc = torch.clamp(v, min=-(cy / fy + 0.3 * tan_y), max=(height - cy) / fy + 0.3 * tan_y)
    zero = torch.zeros_like(z)
    jac = torch.stack([fx / z, zero, -fx * uc / z, zero, fy / z, -fy * vc / z], -1).reshape(-1, 2, 3)
    cov2d = jac @ cov_c @ jac.transpose(-1, -2)

    c00 = cov2d[:, 0, 0] + eps2d
    c11 = cov2d[:, 1, 1] + eps2d
    c01 = 0.5 * (cov2d[:, 0, 1] + cov2d[:, 1, 0])
    det = c00 * c11 - c01 * c01
    det_ok = det > 0
    det_safe = torch.where(det_ok, det, torch.ones_like(det))
    conics = torch.stack([c11 / det_safe, -c01 / det_safe, c00 / det_safe], dim=-1)
    means2d = torch.stack([fx * u + cx, fy * v + cy], dim=-1)

    with torch.no_grad():
        rx = torch.ceil(RADIUS_SIGMAS * c00.clamp_min(0).sqrt())
        ry = torch.ceil(RADIUS_SIGMAS * c11.clamp_min(0).sqrt())
        mx, my = means2d[:, 0], means2d[:, 1]
        inside = (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        keep = in_depth & det_ok & inside
        radii = torch.where(keep[:, None], torch.stack([rx, ry], -1), 0).to(torch.int32)
    return Projection(means2d=means2d, conics=conics, depths=depths, radii=radii)


# ---------------------------------------------------------------------------------------------
# Rasterization
# ---------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Which Gaussians each pixel cell composites, front to back, grouped into dense chunks.

    A cell is a cell x cell block of pixels inside one 16x16 tile. Its list is the tile's list
    (CONVENTIONS' tile rule, depth order) minus Gaussians whose alpha is provably < 1/255 on
    every pixel of the cell: those are skipped by the compositing rule anyway, so dropping them
    changes nothing but the cost.
    """

    n: int  # number of Gaussians; index n is the zero padding entry
    cell: int  # cell side in pixels
    cells_x: int
    cells_y: int
    # (cell ids [Tc], Gaussian ids [Tc,K] front to back padded with n, list lengths [Tc])
    chunks: list[tuple[Tensor, Tensor, Tensor]]


@torch.no_grad()
def _alpha_extent(conics: Tensor, opacities: Tensor) -> Tensor:
    """Half-extents [N,2] of a box holding every offset where opacity * exp(-sigma) >= 1/255.

    sigma = d^T Q d / 2 <= log(255 o) is an ellipse with half-extents sqrt(2 log(255 o) Q^-1_ii).
    Padded (relative and absolute) so float rounding can never cut off a pixel; inf when the
    conic is not positive definite (sigma unbounded below: no box).
    """
    a, b, c = conics.unbind(-1)
    det = a * c - b * b
    pd = (a > 0) & (c > 0) & (det > 0)
    det = torch.where(pd, det, torch.ones_like(det))
    s_max = torch.log((opacities * 255.0).clamp_min(1e-30)).clamp_min(0.0)
    ext = torch.stack([(2 * s_max * c / det).sqrt(), (2 * s_max * a / det).sqrt()], -1) * 1.001 + 1e-3
    ok = pd[:, None] & torch.isfinite(ext)
    return torch.where(ok, ext, torch.full_like(ext, float("inf")))


@torch.no_grad()
def _plan_cells(
    means2d: Tensor,
    conics: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    tile_size: int,
    cell: int,
    chunk_elems: int,
    segment: int,
) -> _Plan:
    n = means2d.shape[0]
    dev = means2d.device
    tiles_x = (width + tile_size - 1) // tile_size
    tiles_y = (height + tile_size - 1) // tile_size
    r = tile_size // cell  # cells per tile side
    plan = _Plan(n=n, cell=cell, cells_x=tiles_x * r, cells_y=tiles_y * r, chunks=[])
    if n == 0 or tiles_x * tiles_y == 0:
        return plan

    m = means2d.detach()
    rad = radii.to(m.dtype)
    valid = (radii > 0).all(-1) & torch.isfinite(m).all(-1) & torch.isfinite(depths)
    valid &= torch.isfinite(conics).all(-1) & torch.isfinite(opacities)
    m = torch.where(valid[:, None], m, torch.zeros_like(m))
    hi = torch.tensor([tiles_x, tiles_y], device=dev, dtype=m.dtype)
    # CONVENTIONS: floor((mean - r)/16) <= t < ceil((mean + r)/16), clamped to the grid
    tmin = torch.minimum(torch.floor((m - rad) / tile_size).clamp_min(0), hi).long()
    tmax = torch.minimum(torch.ceil((m + rad) / tile_size).clamp_min(0), hi).long()
    span = (tmax - tmin).clamp_min(0)
    counts = span[:, 0] * span[:, 1] * valid

    # Gaussians front to back; stable, so equal depths keep index order (as a stable radix sort)
    order = torch.argsort(depths.detach(), stable=True)
    order = order[counts.index_select(0, order) > 0]
    cnt = counts.index_select(0, order)
    total = int(cnt.sum())
    if total == 0:
        return plan
    # one row per (tile, Gaussian) pair, Gaussian by Gaussian in depth order
    gid = torch.repeat_interleave(order, cnt)
    local = torch.arange(total, device=dev) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    sx = span[:, 0].index_select(0, gid)
    tx = tmin[:, 0].index_select(0, gid) + local % sx
    ty = tmin[:, 1].index_select(0, gid) + local // sx

    if r > 1:
        # split each (tile, Gaussian) pair into the tile's cells the Gaussian can reach
        ext = _alpha_extent(conics.detach(), opacities.detach())
        mg, eg = m.index_select(0, gid), ext.index_select(0, gid)
        lo, hi_ = mg - eg, mg + eg  # box of the pixel centres it can reach
        off = torch.arange(r, device=dev)
        first = torch.stack([tx, ty], -1)[:, None, :] * tile_size + (off * cell)[:, None] + 0.5  # [pairs,r,2]
        hit = (hi_[:, None, :] >= first) & (lo[:, None, :] <= first + (cell - 1))  # per axis
        p, iy, ix = torch.nonzero(hit[:, :, None, 1] & hit[:, None, :, 0], as_tuple=True)
        key = (ty.index_select(0, p) * r + iy) * plan.cells_x + tx.index_select(0, p) * r + ix
        gid = gid.index_select(0, p)
    else:
        key = ty * plan.cells_x + tx
    # a stable sort by cell keeps the depth order within each cell
    key, perm = torch.sort(key.int(), stable=True)
    key = key.long()
    gid = gid.index_select(0, perm)
    total = key.numel()
    if total == 0:
        return plan

    n_cells = plan.cells_x * plan.cells_y
    cell_counts = torch.bincount(key, minlength=n_cells)
    cell_start = torch.cumsum(cell_counts, 0) - cell_counts
    busy = torch.nonzero(cell_counts).squeeze(1)
    # chunk cells of similar list lengths together, so padding to the chunk's longest stays small;
    # one segment of a chunk is at most chunk_elems (pixels x Gaussians)
    busy = busy[torch.argsort(cell_counts[busy], stable=True)]
    busy_counts = cell_counts[busy].tolist()
    pix = cell * cell
    i = 0
    while i < len(busy_counts):
        j = i + 1
        while j < len(busy_counts) and (j + 1 - i) * pix * min(segment, busy_counts[j]) <= chunk_elems:
            j += 1
        k = busy_counts[j - 1]
        cells = busy[i:j]
        ar = torch.arange(k, device=dev)
        pos = (cell_start[cells, None] + ar).clamp_max(total - 1)
        ids = torch.where(ar < cell_counts[cells, None], gid.index_select(0, pos.view(-1)).view(pos.shape), n)
        plan.chunks.append((cells, ids, cell_counts[cells]))
        i = j
    return plan


def _pixel_centres(cells: Tensor, plan: _Plan, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    off = torch.arange(plan.cell, device=cells.device, dtype=dtype) + 0.5
    px = (cells % plan.cells_x).to(dtype)[:, None] * plan.cell + off
    py = (cells // plan.cells_x).to(dtype)[:, None] * plan.cell + off
    return px, py  # [Tc, cell] each


@functools.cache
def _below(x: float, dtype: torch.dtype) -> float:
    """The largest value of dtype below x: `v > _below(x)` is `v >= x` for torch.threshold."""
    t = torch.tensor(x, dtype=dtype)
    return torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype)).item()


def _chunk_autograd(
    mean: Tensor, conic: Tensor, opac: Tensor, col: Tensor, px: Tensor, py: Tensor
) -> tuple[Tensor, Tensor]:
    """CONVENTIONS' compositing for one chunk, written plainly; autograd does the backward.

    mean [Tc,K,2], conic [Tc,K,3], opac [Tc,K], col [Tc,K,C] (front to back), px/py [Tc,S]
    pixel centres -> rgb [Tc,P,C] and final transmittance [Tc,P], P = S*S.
    """
    tc, k = opac.shape
    dx = mean[:, None, :, 0] - px[:, :, None]  # [Tc,x,K]
    dy = mean[:, None, :, 1] - py[:, :, None]  # [Tc,y,K]
    a, b, c = conic[:, None, :, 0], conic[:, None, :, 1], conic[:, None, :, 2]
    sx, sy = 0.5 * a * dx * dx, 0.5 * c * dy * dy
    sigma = torch.addcmul(sx[:, None] + sy[:, :, None], (b * dx)[:, None], dy[:, :, None])  # [Tc,y,x,K]
    alpha = (opac[:, None, None, :] * torch.exp(-sigma)).clamp_max(ALPHA_MAX)
    keep = (sigma >= 0) & (alpha >= ALPHA_MIN)
    alpha = torch.where(keep, alpha, torch.zeros_like(alpha)).reshape(tc, -1, k)
    t_incl = torch.cumprod(1 - alpha, dim=-1)
    comp = t_incl >= T_MIN  # the stop rule is a prefix mask: composited iff T after it >= 1e-4
    t_excl = torch.cat([torch.ones_like(t_incl[..., :1]), t_incl[..., :-1]], dim=-1)
    w = torch.where(comp, alpha * t_excl, torch.zeros_like(alpha))
    t_final = torch.cat([torch.ones_like(t_incl[..., :1]), t_incl], -1).gather(-1, comp.sum(-1, keepdim=True))
    return w @ col, t_final.squeeze(-1)


_POOL: list[Tensor] = []  # flat buffers reused for the intermediates kept from forward to backward
_POOL_LOCK = threading.Lock()


def _take_arena(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat CPU buffer of SAVE_BYTES. Reused across calls: fresh memory costs a page fault per
    4 KiB, more than the arithmetic done on it; pages never touched cost nothing."""
    numel = SAVE_BYTES // torch.empty((), dtype=dtype).element_size()
    with _POOL_LOCK:
        for i, t in enumerate(_POOL):
            if t.dtype == dtype and t.device == device and t.numel() == numel:
                return _POOL.pop(i)
    return torch.empty(numel, dtype=dtype, device=device)


def _give_arena(t: Tensor) -> None:
    with _POOL_LOCK:
        _POOL.append(t)
        del _POOL[:-2]  # one per dtype in use is what training needs


def _segment_numel(tc: int, p: int, b: int) -> int:
    """Elements of the intermediates _segment_fast keeps: raw, w [Tc,P,B], 1-alpha, T [Tc,P,B+1]."""
    return 2 * tc * p * b + 2 * tc * p * (b + 1)


def _segment_fast(
    mean: Tensor,
    conic: Tensor,
    opac: Tensor,
    col: Tensor,
    px: Tensor,
    py: Tensor,
    t_in: Tensor,
    bufs: Tensor | None = None,
) -> dict[str, Any]:
    """Composite the next B Gaussians of Tc cells, tuned for CPU (no autograd; see _RasterizeFn).

    mean [Tc,B,2], conic [Tc,B,3], opac [Tc,B], col [Tc,B,C], px/py [Tc,S] pixel centres,
    t_in [Tc,P] the running transmittance before them (0 where the pixel has stopped).
    Masks become thresholds and in-place ops (torch.where and bool->float casts are several times
    slower than arithmetic on CPU); every decision (sigma >= 0, alpha >= 1/255, the alpha cap,
    T >= 1e-4) is made on the same values as in _chunk_autograd. bufs: optional storage
    (_segment_numel elements) for the intermediates the backward reuses.
    """
    tc, b = opac.shape
    s = px.shape[1]
    p = s * s
    dt = opac.dtype
    if bufs is None:
        bufs = torch.empty(_segment_numel(tc, p, b), dtype=dt, device=opac.device)
    raw, w = bufs[: tc * p * b].view(tc, p, b), bufs[tc * p * b : 2 * tc * p * b].view(tc, p, b)
    # T_in prepended, so cumprod multiplies in the same order as a per-pixel loop
    om_ext = bufs[2 * tc * p * b : 2 * tc * p * b + tc * p * (b + 1)].view(tc, p, b + 1)
    t_ext = bufs[2 * tc * p * b + tc * p * (b + 1) : 2 * tc * p * b + 2 * tc * p * (b + 1)].view(tc, p, b + 1)
    dx = mean[:, None, :, 0] - px[:, :, None]  # [Tc,x,B]
    dy = mean[:, None, :, 1] - py[:, :, None]  # [Tc,y,B]
    a, bb, c = conic[:, None, :, 0], conic[:, None, :, 1], conic[:, None, :, 2]
    sx, sy = 0.5 * a * dx * dx, 0.5 * c * dy * dy
    sig = torch.add(sx[:, None], sy[:, :, None], out=raw.view(tc, s, s, b))
    sig.addcmul_((bb * dx)[:, None], dy[:, :, None])  # [Tc,y,x,B]
    # sigma < 0 -> +inf: exp gives 0, so the 1/255 test below skips it as the rule says
    F.threshold_(sig, _below(0.0, dt), math.inf)
    sig.neg_().exp_().mul_(opac[:, None, None, :])  # now raw = o exp(-sigma)
    # opacity <= ALPHA_MAX everywhere here: the cap cannot bite (exp(-sigma) <= 1), skip it
    capped = bool(opac.max() > ALPHA_MAX)
    alpha = torch.clamp_max(raw, ALPHA_MAX, out=w) if capped else w.copy_(raw)
    F.threshold_(alpha, _below(ALPHA_MIN, dt), 0.0)
    om_ext[..., 0] = t_in
    om = torch.sub(torch.ones((), dtype=dt), alpha, out=om_ext[..., 1:])
    torch.cumprod(om_ext, dim=-1, out=t_ext)
    t_incl = t_ext[..., 1:]  # T after each Gaussian
    # the last running T: the smallest one >= 1e-4 (inf where this segment composites nothing)
    t_last = F.threshold(t_incl, _below(T_MIN, dt), math.inf).amin(-1)
    # t_incl while the pixel is still running, 0 from the stopping Gaussian on
    t_run = F.threshold_(t_incl, _below(T_MIN, dt), 0.0)
    # alpha * T_before = alpha / (1 - alpha) * T_after: no shifted copy of T needed
    alpha.div_(om).mul_(t_run)  # alpha lives in w: now the compositing weights
    return {"rgb": w @ col, "t_last": t_last, "t_out": t_run[..., -1], "dx": dx, "dy": dy, "raw": raw,
            "om": om, "t_run": t_run, "w": w, "capped": capped}  # fmt: skip


class _RasterizeFn(torch.autograd.Function):
    """Forward: per chunk of cells, Gaussians in segments of SEGMENT front to back, carrying each
    pixel's T; cells leave once all their pixels stopped or their lists ran out, so the work
    follows what is composited. Backward: segments back to front, carrying the light that
    reaches each pixel from behind; it reuses the forward's intermediates while they fit in
    SAVE_BYTES and recomputes the rest from the saved T (so memory stays bounded).

    Inputs are packed into one [N+1, 6+C] table (means2d, conics, opacity, colours; row N is the
    zero padding entry) so that each segment needs one gather and one scatter.
    """

    @staticmethod
    def forward(ctx, means2d, conics, colors, opacities, plan, absgrad_owner, segment, keep):  # type: ignore[override]
        table = torch.cat([means2d, conics, opacities[:, None], colors], 1)
        table = torch.cat([table, table.new_zeros(1, table.shape[1])], 0)
        n_cells = plan.cells_x * plan.cells_y
        pix = plan.cell**2
        rgb_all = means2d.new_zeros(n_cells, pix, colors.shape[1])
        t_all = means2d.new_ones(n_cells, pix)
        # intermediates kept for the backward: up to SAVE_BYTES, carved from a reused CPU arena
        budget = SAVE_BYTES // table.element_size() if keep else 0
        on_cpu = table.device.type == "cpu"
        arena = _take_arena(table.dtype, table.device) if budget and on_cpu else None
        used = 0
        steps: list[tuple[int, Tensor, int, Tensor, dict[str, Any] | None]] = []
        for ci, (cells, ids, counts) in enumerate(plan.chunks):
            px, py = _pixel_centres(cells, plan, means2d.dtype)
            rgb = means2d.new_zeros(len(cells), pix, colors.shape[1])
            t_run = means2d.new_ones(len(cells), pix)
            t_fin = means2d.new_ones(len(cells), pix)
            act = torch.arange(len(cells), device=ids.device)
            for k0 in range(0, ids.shape[1], segment):
                t_in = t_run.index_select(0, act)
                # cells leave once every pixel stopped or their lists ran out
                alive = (counts.index_select(0, act) > k0) & (t_in > 0).any(-1)
                if not bool(alive.all()):
                    act, t_in = act[alive], t_in[alive]
                if act.numel() == 0:
                    break
                seg = ids[:, k0 : k0 + segment].index_select(0, act)
                g = table.index_select(0, seg.view(-1)).view(*seg.shape, -1)
                size = _segment_numel(len(act), pix, seg.shape[1])
                bufs = None
                if used + size <= budget:
                    bufs = arena[used : used + size] if arena is not None else table.new_empty(size)
                    used += size
                pxa, pya = px.index_select(0, act), py.index_select(0, act)
                f = _segment_fast(g[..., 0:2], g[..., 2:5], g[..., 5], g[..., 6:], pxa, pya, t_in, bufs)
                rgb.index_add_(0, act, f["rgb"])
                t_run.index_copy_(0, act, f["t_out"])
                t_fin.index_copy_(0, act, torch.minimum(t_fin.index_select(0, act), f["t_last"]))
                steps.append((ci, act, k0, t_in, f if bufs is not None else None))
            rgb_all.index_copy_(0, cells, rgb)
            t_all.index_copy_(0, cells, t_fin)
        ctx.save_for_backward(table, t_all)
        ctx.plan, ctx.steps, ctx.segment = plan, steps, segment
        ctx.arena, ctx.steps_fresh = arena, True
        ctx.absgrad_owner = absgrad_owner
        return rgb_all, t_all

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_rgb_all, g_t_all):  # type: ignore[override]
        table, t_all = ctx.saved_tensors
        plan: _Plan = ctx.plan
        n, s = plan.n, plan.cell
        owner = ctx.absgrad_owner
        # gradient table: means2d 0:2, conics 2:5, opacity 5, colours 6:6+C, absgrad after that
        grads = table.new_zeros(table.shape[0], table.shape[1] + (2 if owner is not None else 0))
        n_col = table.shape[1] - 6
        tiny = torch.finfo(table.dtype).tiny
        # a second backward (retain_graph) recomputes: the arena went back to the pool
        reuse = ctx.steps_fresh
        ctx.steps_fresh = False
        chunk_state: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        for ci, act, k0, t_in, f in reversed(ctx.steps):
            cells, ids, _ = plan.chunks[ci]
            if ci not in chunk_state:
                g_rgb_c = g_rgb_all.index_select(0, cells)  # [Tc,P,C]
                # light reaching each pixel from behind the current segment: starts as T_final g_T
                behind = t_all.index_select(0, cells) * g_t_all.index_select(0, cells)
                chunk_state[ci] = (g_rgb_c, behind, *_pixel_centres(cells, plan, table.dtype))
            g_rgb_c, behind, px, py = chunk_state[ci]
            seg = ids[:, k0 : k0 + ctx.segment].index_select(0, act)
            tc, k = seg.shape
            g = table.index_select(0, seg.reshape(-1)).view(tc, k, -1)
            conic, opac, col = g[..., 2:5], g[..., 5], g[..., 6:]
            if f is None or not reuse:
                pxa, pya = px.index_select(0, act), py.index_select(0, act)
                f = _segment_fast(g[..., 0:2], conic, opac, col, pxa, pya, t_in)
            g_rgb = g_rgb_c.index_select(0, act)
            w, raw = f["w"], f["raw"]
            out = grads.new_empty(tc, k, grads.shape[1])
            out[..., 6 : 6 + n_col] = w.transpose(1, 2) @ g_rgb

            # d/d alpha_k of sum_j w_j sc_j + T_final g_T, with w_j = alpha_j T_j and T_j (j > k),
            # T_final holding (1 - alpha_k):  T_k sc_k - (sum_{j>k} w_j sc_j + T_final g_T) / (1 - alpha_k)
            sc = g_rgb @ col.transpose(1, 2)  # [Tc,P,B] colour . dL/drgb
            ws = w * sc
            ws_tot = ws.sum(-1)
            rest = torch.sub((behind.index_select(0, act) + ws_tot)[..., None], ws.cumsum_(-1))
            behind.index_add_(0, act, ws_tot)
            h = rest.addcmul_(f["t_run"], sc, value=-1).div_(f["om"])  # = -dL/dalpha
            # gradient reaches raw = o exp(-sigma) only where alpha was composited (w > 0; this
            # covers the 1/255 skip and the stop rule) and not capped at ALPHA_MAX
            live = torch.sign(w)
            if f["capped"]:
                live.mul_(torch.sub(raw, ALPHA_MAX).relu_().sign_().neg_().add_(1.0))
            g_sig = h.mul_(live).mul_(raw).view(tc, s, s, k)  # dL/dsigma, [Tc,y,x,B]

            dx, dy = f["dx"], f["dy"]  # [Tc,x,B], [Tc,y,B]
            a, b, c = conic[..., 0], conic[..., 1], conic[..., 2]
            r_x = g_sig.sum(1)  # over rows    -> [Tc,x,B]
            r_y = g_sig.sum(2)  # over columns -> [Tc,y,B]
            q_x = (g_sig * dy[:, :, None]).sum(1)  # over rows, weighted by dy -> [Tc,x,B]
            dx_r = (dx * r_x).sum(1)
            # sigma = a dx^2 / 2 + b dx dy + c dy^2 / 2 and dL/draw = -dL/dsigma / raw
            out[..., 0] = a * dx_r + b * q_x.sum(1)
            out[..., 1] = c * (dy * r_y).sum(1) + b * dx_r
            out[..., 2] = 0.5 * (dx * dx * r_x).sum(1)
            out[..., 3] = (dx * q_x).sum(1)
            out[..., 4] = 0.5 * (dy * dy * r_y).sum(1)
            out[..., 5] = -r_x.sum(1) / opac.clamp_min(tiny)  # raw / o = exp(-sigma)
            if owner is not None:
                # gsplat's absgrad: per pixel |dL/dmean2d|, summed over pixels, per component
                a1, b1, c1 = a[:, None], b[:, None], c[:, None]
                ax = (g_sig * ((a1 * dx)[:, None] + (b1 * dy)[:, :, None])).abs_().sum((1, 2))
                ay = (g_sig * ((c1 * dy)[:, :, None] + (b1 * dx)[:, None])).abs_().sum((1, 2))
                out[..., -2], out[..., -1] = ax, ay
            grads.index_add_(0, seg.reshape(-1), out.view(tc * k, -1))
        if ctx.arena is not None:
            _give_arena(ctx.arena)
            ctx.arena = None

        if owner is not None:
            owner.absgrad = grads[:n, -2:].reshape(owner.shape).contiguous()
        return grads[:n, 0:2], grads[:n, 2:5], grads[:n, 6 : 6 + n_col], grads[:n, 5], None, None, None, None


def _composite_autograd(
    means2d: Tensor, conics: Tensor, colors: Tensor, opacities: Tensor, plan: _Plan
) -> tuple[Tensor, Tensor]:
    """The same compositing with autograd doing the backward (slower; a cross-check)."""
    n_cells = plan.cells_x * plan.cells_y
    ext = [torch.cat([t, t.new_zeros((1,) + t.shape[1:])], 0) for t in (means2d, conics, opacities, colors)]
    rgb_all = means2d.new_zeros(n_cells, plan.cell**2, colors.shape[1])
    t_all = means2d.new_ones(n_cells, plan.cell**2)
    for cells, ids, _ in plan.chunks:
        px, py = _pixel_centres(cells, plan, means2d.dtype)
        rgb, t_final = _chunk_autograd(*(e[ids] for e in ext), px, py)
        rgb_all = rgb_all.index_copy(0, cells, rgb)
        t_all = t_all.index_copy(0, cells, t_final)
    return rgb_all, t_all


def _rasterize(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    tile_size: int = 16,
    absgrad_owner: Tensor | None = None,
    use_autograd: bool = False,
    cell: int = CELL,
    chunk_elems: int = CHUNK_ELEMS,
    segment: int = SEGMENT,
) -> tuple[Tensor, Tensor]:
    n = means2d.shape[0]
    if colors.dim() != 2 or colors.shape[0] != n or colors.shape[1] < 1:
        raise ValueError(f"colors must be [N,C] with N={n}, got {list(colors.shape)}")
    for name, t, shape in [
        ("means2d", means2d, (n, 2)),
        ("conics", conics, (n, 3)),
        ("opacities", opacities, (n,)),
        ("radii", radii, (n, 2)),
        ("depths", depths, (n,)),
    ]:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    dtype = means2d.dtype
    conics, colors, opacities = conics.to(dtype), colors.to(dtype), opacities.to(dtype)
    if tile_size % cell:
        cell = tile_size

    plan = _plan_cells(means2d, conics, opacities, radii, depths, width, height, tile_size, cell, chunk_elems, segment)
    if use_autograd:
        if absgrad_owner is not None:
            raise ValueError("absgrad needs the default (hand-written) backward")
        rgb, t_final = _composite_autograd(means2d, conics, colors, opacities, plan)
    else:
        # keep intermediates only when a backward can follow (not under no_grad, e.g. evaluation)
        keep = torch.is_grad_enabled() and any(t.requires_grad for t in (means2d, conics, colors, opacities))
        rgb, t_final = _RasterizeFn.apply(means2d, conics, colors, opacities, plan, absgrad_owner, segment, keep)

    # cells [cy * cx, s * s] -> image rows/cols, cropped to the requested size
    s, nc, gx, gy = cell, colors.shape[1], plan.cells_x, plan.cells_y
    rgb = rgb.reshape(gy, gx, s, s, nc).permute(0, 2, 1, 3, 4).reshape(gy * s, gx * s, nc)[:height, :width]
    t_final = t_final.reshape(gy, gx, s, s).permute(0, 2, 1, 3).reshape(gy * s, gx * s, 1)[:height, :width]
    if background is not None:
        rgb = rgb + t_final * background.to(dtype)
    return rgb, 1 - t_final


def rasterize(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    tile_size: int = 16,
    absgrad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Alpha-composite projected Gaussians front to back (CONVENTIONS.md, per 16x16 tile).

    means2d [N,2], conics [N,3], colors [N,C], opacities [N] in (0,1), radii [N,2] (0 = culled),
    depths [N], background [C] or None (zeros). Returns image [H,W,C] and alpha [H,W,1].
    absgrad=True: after backward, means2d.absgrad [N,2] holds sum over pixels of the per-pixel
    |dL/dmeans2d| (gsplat's definition).
    """
    return _rasterize(
        means2d, conics, colors, opacities, radii, depths, width, height, background, tile_size,
        absgrad_owner=means2d if absgrad else None,
    )  # fmt: skip


def camera_centre(viewmat: Tensor) -> Tensor:
    """World position of the camera of a world-to-camera matrix [4,4]."""
    return -viewmat[:3, :3].T @ viewmat[:3, 3]


def render_reference(
    params: Mapping[str, Tensor],
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    sh_degree: int,
    background: Tensor | None = None,
    absgrad: bool = False,
    timer: Any = None,
) -> tuple[Tensor, Tensor, dict]:
    """Render one view of the Gaussians in params (CONVENTIONS.md names and activations).

    Returns image [H,W,3], alpha [H,W,1] and the info dict gsplat's strategies read:
    means2d [1,N,2] (the tensor that feeds rasterization: retain_grad() on it works, and
    .absgrad is set after backward when absgrad=True), radii [1,N,2] int32, depths [1,N],
    conics [1,N,3], width, height, n_cameras=1, gaussian_ids=None (not packed).
    timer: an optional gstrain.train.timing.PhaseTimer; it gets the projection / raster_fwd /
    raster_bwd split, as on the CUDA path.
    """
    means = params["means"]
    viewmat = viewmat.to(means)
    K = K.to(means)
    with phase(timer, "projection"):
        nb = num_sh_bases(sh_degree)
        sh = params["sh0"]
        if nb > 1:
            sh = torch.cat([sh, params["shN"][:, : nb - 1]], dim=1)
        proj = project_gaussians(means, params["quats"], torch.exp(params["scales"]), viewmat, K, width, height)
        colors = sh_to_color(sh, means - camera_centre(viewmat), sh_degree)
        opacities = torch.sigmoid(params["opacities"])
        means2d = proj.means2d[None]
    with phase(timer, "raster_fwd"):
        span = timer.backward_span("raster_bwd") if timer is not None else None
        conics = span.input(proj.conics) if span is not None else proj.conics
        image, alpha = _rasterize(
            means2d[0], conics, colors, opacities, proj.radii, proj.depths, width, height, background,
            absgrad_owner=means2d if absgrad else None,
        )  # fmt: skip
        if span is not None:
            image = span.output(image)
    info = strategy_info(means2d, proj.radii[None], proj.depths[None], proj.conics[None], width, height)
    return image, alpha, info
