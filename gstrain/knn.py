"""Exact k-nearest-neighbour distances of a point cloud, for the initial Gaussians' scales (3DGS
sizes each by the RMS distance to its 3 nearest neighbours). No spatial-index dependency: Morton
blocks bound each query's search box (knn_sq_dists)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

# 3DGS clamps the squared neighbour distance here so duplicate points still get a finite log-scale.
MIN_DIST2 = 1e-7
# Scale used when a cloud has a single point: there is no neighbour to measure against.
LONE_POINT_DIST = 1.0

_KNN_BLOCK = 512  # queries per block, consecutive along a Morton curve
_KNN_BUDGET = 1 << 22  # max elements of one distance matrix (32 MiB of float64)
MORTON_BITS = 21  # per axis: 63-bit codes fit int64


def knn_rms_distance(points: Tensor, k: int = 3, workers: int = 1) -> Tensor:
    """RMS distance of each point to its k nearest other points, clamped away from zero. [N]."""
    n = points.shape[0]
    kk = min(k, n - 1)
    if kk <= 0:
        return torch.full((n,), LONE_POINT_DIST, dtype=points.dtype, device=points.device)
    d2 = knn_sq_dists(points, kk, workers)
    return d2.mean(dim=1).clamp_min(MIN_DIST2).sqrt()


def knn_sq_dists(points: Tensor, k: int, workers: int = 1) -> Tensor:
    """Exact squared distances to the k nearest other points, ascending, [N, k]; needs N > k.

    Exact, CPU-friendly and memory-bounded without a spatial-index dependency: points are
    sorted along a Morton curve and cut into blocks of neighbouring queries. A block's own
    points bound each query's k-th neighbour distance from above (r); only points inside the
    union box of [q - r_q, q + r_q] can be nearer, so those are the only candidates for
    chunked torch.cdist + topk. Candidates come from a slab of per-axis sorted coordinates
    (binary search) instead of a scan of all N. Distance matrices never exceed _KNN_BUDGET
    elements. A few seconds for 200k points on one CPU core. `workers` threads take interleaved
    blocks (each block's rows are its own: the result does not depend on the count).
    """
    n = points.shape[0]
    if not 0 < k < n:
        raise ValueError(f"need 0 < k < N, got k={k}, N={n}")
    if points.is_cuda:  # the same search on the device, one stream (a block costs launches and a few syncs)
        return _knn_sq_dists(points.detach().float(), k)
    # Many small ops: intra-op threads only add sync overhead here (5-10x slower when the cores
    # are shared), so run single-threaded and restore the caller's setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _knn_sq_dists(points.detach().to("cpu", torch.float32), k, workers).to(points.device)
    finally:
        torch.set_num_threads(threads)


def _knn_sq_dists(pts: Tensor, k: int, workers: int = 1, block: int = _KNN_BLOCK, budget: int = _KNN_BUDGET) -> Tensor:
    n = pts.shape[0]
    order = torch.argsort(morton_codes(pts))
    sorted_pts = pts[order]
    axis_vals, axis_order = pts.T.contiguous().sort(dim=1)
    out = torch.empty(n, k, device=pts.device)
    starts = list(range(0, n, block))
    workers = max(1, min(int(workers), len(starts)))

    def blocks(first: int) -> None:
        for start in starts[first::workers]:
            _knn_block(pts, sorted_pts, order, axis_vals, axis_order, out, start, k, block, budget)

    if workers == 1:
        blocks(0)
    else:  # torch's kernels release the GIL: the blocks' searches overlap
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gstrain-knn") as pool:
            for done in [pool.submit(blocks, w) for w in range(workers)]:
                done.result()
    return out


def _knn_block(pts: Tensor, sorted_pts: Tensor, order: Tensor, axis_vals: Tensor, axis_order: Tensor,
               out: Tensor, start: int, k: int, block: int, budget: int) -> None:  # fmt: skip
    """The k nearest of the Morton block of queries from `start` on, into their rows of `out`."""
    q_idx = order[start:start + block]
    q = sorted_pts[start:start + block]
    # Upper bound of each query's k-th distance from within the block (inf when too few).
    if q.shape[0] > k:
        # Direct differences (not cdist's matmul) so the bound is not below the true value.
        own = torch.cdist(q, q, compute_mode="donot_use_mm_for_euclid_dist")
        own.fill_diagonal_(float("inf"))
        r = own.topk(k, dim=1, largest=False).values[:, -1:] * (1.0 + 1e-5)
    else:
        r = torch.full((q.shape[0], 1), float("inf"), device=q.device)
    # Split a group in halves (still Morton-adjacent) while its box holds many candidates:
    # a few sparse outliers in a block must not make it search the whole dense core.
    stack = [(q_idx, q, r)]
    while stack:
        gi, gq, gr = stack.pop()
        lo = (gq - gr).min(dim=0).values
        hi = (gq + gr).max(dim=0).values
        c_idx = _box_candidates(pts, axis_vals, axis_order, lo, hi)
        m = gq.shape[0]
        if m > 16 and c_idx.shape[0] > 32 * m:
            h = m // 2
            stack += [(gi[:h], gq[:h], gr[:h]), (gi[h:], gq[h:], gr[h:])]
            continue
        out[gi] = _knn_against(pts, gi, c_idx, k, budget)


def _box_candidates(pts: Tensor, axis_vals: Tensor, axis_order: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Indices of points inside [lo, hi], scanning only the thinnest per-axis slab."""
    starts = torch.searchsorted(axis_vals, lo[:, None], side="left")[:, 0]
    ends = torch.searchsorted(axis_vals, hi[:, None], side="right")[:, 0]
    axis = int((ends - starts).argmin())
    slab = axis_order[axis, int(starts[axis]):int(ends[axis])]
    sp = pts[slab]
    return slab[((sp >= lo) & (sp <= hi)).all(dim=1)]


def _knn_against(pts: Tensor, q_idx: Tensor, c_idx: Tensor, k: int, budget: int) -> Tensor:
    """Squared distances from pts[q_idx] to their k nearest in pts[c_idx], excluding self."""
    q = pts[q_idx]
    c = pts[c_idx]
    # cdist's fast matmul path has an error of about eps * |x|^2: centre both sets and use
    # float64, or a block that mixes a dense core with far outliers picks wrong neighbours.
    centre = q.mean(dim=0)
    qc = (q - centre).double()
    cc = (c - centre).double()
    rows = max(1, budget // max(1, c.shape[0]))
    result = []
    for s in range(0, q.shape[0], rows):
        d = torch.cdist(qc[s:s + rows], cc)
        d.masked_fill_(c_idx[None, :] == q_idx[s:s + rows, None], float("inf"))
        nn_idx = d.topk(k, dim=1, largest=False).indices
        # Recompute the chosen distances directly so they do not carry matmul rounding.
        diff = c[nn_idx] - q[s:s + rows, None, :]
        result.append(diff.square().sum(dim=-1).sort(dim=1).values)
    return torch.cat(result)


def _spread3(x: Tensor) -> Tensor:
    """Put two zero bits between each of the low 21 bits of x (int64)."""
    x = x & 0x1FFFFF
    x = (x | (x << 32)) & 0x1F00000000FFFF
    x = (x | (x << 16)) & 0x1F0000FF0000FF
    x = (x | (x << 8)) & 0x100F00F00F00F00F
    x = (x | (x << 4)) & 0x10C30C30C30C30C3
    x = (x | (x << 2)) & 0x1249249249249249
    return x


def morton_codes(means: Tensor) -> Tensor:
    """[N] int64 Z-order codes of the means, quantised to 2^21 cells per axis over their bounding
    cube (a cube, not a box: the curve's cells stay cubes, so Morton ranges stay compact)."""
    pts = means.detach().double()
    lo = pts.min(0).values
    extent = (pts.max(0).values - lo).max().clamp_min(1e-12)
    top = float((1 << MORTON_BITS) - 1)
    q = ((pts - lo) / extent * top).clamp(0, top).long()
    return _spread3(q[:, 0]) | (_spread3(q[:, 1]) << 1) | (_spread3(q[:, 2]) << 2)
