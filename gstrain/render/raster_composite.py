"""The reference rasterizer's compositing, forward and hand-written backward (_RasterizeFn), and the
same compositing written plainly for autograd (_composite_autograd, the cross-check).

Dense [cells, 64 pixels, 32 Gaussians] blocks, front to back, carrying each pixel's T; a cell
leaves once all its pixels stopped. Rules as docs/CONVENTIONS.md: the 1/255 skip, gsplat's 0.999
alpha cap and the exclusive 1e-4 stop rule.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gstrain.render.raster_plan import _pixel_centres, _Plan

ALPHA_MAX = 0.999  # gsplat's cap (the original 3DGS uses 0.99)
ALPHA_MIN = 1.0 / 255.0
T_MIN = 1e-4
# forward intermediates kept for the backward (beyond this, segments are recomputed)
SAVE_BYTES = 1 << 29


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
