// Tile intersection with the ellipse cull (render.ellipse_cull): a (Gaussian, tile) pair is made
// only when the Gaussian's alpha may reach 1/255 at a pixel centre of the tile, so culled pairs
// never reach the sort. The tile range is gsplat's isect_tiles rule (its bounding rectangle);
// the test is gstrain/render/cull.py:keep_mask and alpha_bound.py, evaluated here operation by
// operation in the same order with round-to-nearest intrinsics (no FMA contraction), so the kept
// pairs equal the PyTorch oracle's exactly. NaN anywhere keeps the pair, as there.
#include <cub/cub.cuh>

#include "isect.h"

namespace gstrain {
namespace {

constexpr int kIsectThreads = 256;

// torch.minimum / torch.maximum / clamp: a NaN operand gives NaN (fminf / fmaxf would drop it).
__device__ __forceinline__ float nan_min(float x, float y) { return (x != x || y != y) ? x + y : fminf(x, y); }
__device__ __forceinline__ float nan_max(float x, float y) { return (x != x || y != y) ? x + y : fmaxf(x, y); }

// A floor / ceil'd tile coordinate clamped to [0, n]; negative and NaN give 0 (gsplat casts to
// uint32, which saturates, then clamps).
__device__ __forceinline__ unsigned tile_bound(float t, unsigned n) {
    return t > 0.f ? (unsigned)fminf(t, (float)n) : 0u;
}

struct Rect {
    unsigned x0, x1, y0, y1; // tiles [x0, x1) x [y0, y1)
};

struct Ellipse {
    float mx, my, a, b, c, thr;
};

// alpha_bound.sigma_threshold for one Gaussian (same operations, same order).
__device__ float sigma_threshold(float a, float b, float c, float opacity) {
    const float root = __fsqrt_rn(nan_max(__fmul_rn(a, c), 0.f));
    const float ab = fabsf(b);
    const bool pd = a > 0.f && c > 0.f && root > ab && isfinite(a) && isfinite(b) && isfinite(c);
    const float kappa = __fdiv_rn(__fadd_rn(root, ab), pd ? __fsub_rn(root, ab) : 1.f);
    const float shrink = __fsub_rn(1.f, __fmul_rn(kappa, (float)4e-6));
    const float level = logf(__fmul_rn(opacity, 255.f));
    const float padded = __fadd_rn(level, __fmul_rn(__fadd_rn(fabsf(level), 1.f), (float)2e-3));
    float thr = __fdiv_rn(padded, nan_max(shrink, (float)1e-3));
    if (level == -INFINITY) thr = level;
    const bool keep_always = !pd || shrink < 0.5f;
    return keep_always ? INFINITY : thr;
}

// sigma = (a ux^2 + c uy^2) / 2 + b ux uy, rounded as alpha_bound.min_sigma_on_rect rounds it.
__device__ __forceinline__ float sigma_at(const Ellipse &e, float ux, float uy) {
    const float q = __fadd_rn(__fmul_rn(__fmul_rn(e.a, ux), ux), __fmul_rn(__fmul_rn(e.c, uy), uy));
    return __fadd_rn(__fmul_rn(q, 0.5f), __fmul_rn(__fmul_rn(e.b, ux), uy));
}

// A row of tiles: its pixel-centre rows relative to the mean ([ly, hy], clipped to the image),
// and the unclamped vertices of sigma's parabolas along its two horizontal edges (the same for
// every tile of the row: computed once).
struct TileRow {
    float ly, hy, vx_ly, vx_hy;
};

__device__ __forceinline__ TileRow tile_row(const IsectArgs &a, const Ellipse &e, unsigned ty) {
    const float ts = (float)a.tile_size;
    const float cy = __fmul_rn((float)ty, ts);
    TileRow row;
    row.ly = __fsub_rn(__fadd_rn(cy, 0.5f), e.my);
    row.hy = __fsub_rn(fminf(__fadd_rn(cy, ts - 0.5f), (float)a.height - 0.5f), e.my);
    row.vx_ly = __fdiv_rn(__fmul_rn(-e.b, row.ly), e.a);
    row.vx_hy = __fdiv_rn(__fmul_rn(-e.b, row.hy), e.a);
    return row;
}

// cull.keep_mask for tile tx of a row: alpha_bound.min_sigma_on_rect over the tile's pixel-centre
// rectangle [lx, hx] x [ly, hy] (clipped to the image) against the threshold.
__device__ __forceinline__ bool keeps_tile(const IsectArgs &a, const Ellipse &e, const TileRow &row, unsigned tx) {
    const float ts = (float)a.tile_size;
    const float cx = __fmul_rn((float)tx, ts);
    const float lx = __fsub_rn(__fadd_rn(cx, 0.5f), e.mx);
    const float hx = __fsub_rn(fminf(__fadd_rn(cx, ts - 0.5f), (float)a.width - 0.5f), e.mx);
    const float ly = row.ly, hy = row.hy;
    float sigma = 0.f; // the mean inside the rectangle
    if (!(lx <= 0.f && hx >= 0.f && ly <= 0.f && hy >= 0.f)) {
        // on each edge the other coordinate sits at the 1-D parabola's vertex, clamped to the edge
        const float y_lx = nan_min(nan_max(__fdiv_rn(__fmul_rn(-e.b, lx), e.c), ly), hy);
        const float y_hx = nan_min(nan_max(__fdiv_rn(__fmul_rn(-e.b, hx), e.c), ly), hy);
        const float x_ly = nan_min(nan_max(row.vx_ly, lx), hx);
        const float x_hy = nan_min(nan_max(row.vx_hy, lx), hx);
        sigma = nan_min(nan_min(sigma_at(e, lx, y_lx), sigma_at(e, hx, y_hx)),
                        nan_min(sigma_at(e, x_ly, ly), sigma_at(e, x_hy, hy)));
    }
    return !(sigma > e.thr);
}

// The bounding rectangle's tiles (gsplat's rule: floor / ceil of (mean -/+ radius) / tile) and
// the ellipse; false when a radius is <= 0 (no tiles).
__device__ bool load_gaussian(const IsectArgs &a, int64_t i, Rect &r, Ellipse &e) {
    const int rx = a.radii[2 * i], ry = a.radii[2 * i + 1];
    if (rx <= 0 || ry <= 0) return false;
    const float ts = (float)a.tile_size;
    e.mx = a.means2d[2 * i];
    e.my = a.means2d[2 * i + 1];
    const float tx = __fdiv_rn(e.mx, ts), ty = __fdiv_rn(e.my, ts);
    const float trx = __fdiv_rn((float)rx, ts), tr_y = __fdiv_rn((float)ry, ts);
    r.x0 = tile_bound(floorf(__fsub_rn(tx, trx)), (unsigned)a.bound_x);
    r.x1 = tile_bound(ceilf(__fadd_rn(tx, trx)), (unsigned)a.bound_x);
    r.y0 = tile_bound(floorf(__fsub_rn(ty, tr_y)), (unsigned)a.bound_y);
    r.y1 = tile_bound(ceilf(__fadd_rn(ty, tr_y)), (unsigned)a.bound_y);
    e.a = a.conics[3 * i];
    e.b = a.conics[3 * i + 1];
    e.c = a.conics[3 * i + 2];
    e.thr = sigma_threshold(e.a, e.b, e.c, a.opacities[i]);
    return true;
}

// The arguments as the kernels use them: with a valid size on the device, the image is that part
// of the canvas, so the cull clips to it and no pair reaches a tile outside it (the keys keep the
// canvas's tile grid).
__device__ __forceinline__ IsectArgs within_valid(IsectArgs a) {
    if (a.valid != nullptr) {
        a.width = a.valid[0];
        a.height = a.valid[1];
        a.bound_x = min(a.tiles_x, (a.width + a.tile_size - 1) / a.tile_size);
        a.bound_y = min(a.tiles_y, (a.height + a.tile_size - 1) / a.tile_size);
    }
    return a;
}

__device__ __forceinline__ int64_t rect_tiles(const Rect &r) {
    return (int64_t)(r.x1 - r.x0) * (int64_t)(r.y1 - r.y0);
}

// Rectangles with more tiles than this are walked by the whole warp, 32 tiles at a time: one
// thread walking a large Gaussian's thousands of tiles (each with the ellipse test) alone would
// hold its warp, and the kernel, for milliseconds.
constexpr int64_t kWarpTiles = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Tile k of a rectangle, row-major.
__device__ __forceinline__ void rect_tile(const Rect &r, int64_t k, unsigned &tx, unsigned &ty) {
    const int64_t w = (int64_t)(r.x1 - r.x0);
    ty = r.y0 + (unsigned)(k / w);
    tx = r.x0 + (unsigned)(k % w);
}

// Lane src's Gaussian, for the whole warp.
__device__ __forceinline__ void broadcast(const Rect &r, const Ellipse &e, int src, Rect &rr, Ellipse &ee) {
    rr.x0 = __shfl_sync(kFullMask, r.x0, src);
    rr.x1 = __shfl_sync(kFullMask, r.x1, src);
    rr.y0 = __shfl_sync(kFullMask, r.y0, src);
    rr.y1 = __shfl_sync(kFullMask, r.y1, src);
    ee.mx = __shfl_sync(kFullMask, e.mx, src);
    ee.my = __shfl_sync(kFullMask, e.my, src);
    ee.a = __shfl_sync(kFullMask, e.a, src);
    ee.b = __shfl_sync(kFullMask, e.b, src);
    ee.c = __shfl_sync(kFullMask, e.c, src);
    ee.thr = __shfl_sync(kFullMask, e.thr, src);
}

__global__ void __launch_bounds__(kIsectThreads)
    isect_count_kernel(const IsectArgs args, int *__restrict__ counts, unsigned long long *__restrict__ totals) {
    const IsectArgs a = within_valid(args);
    const int64_t n = (int64_t)a.n_cams * a.n_gauss;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(threadIdx.x & 31);
    unsigned long long all = 0, kept = 0;
    Rect r{};
    Ellipse e{};
    const bool live = i < n && load_gaussian(a, i, r, e);
    const int64_t tiles = live ? rect_tiles(r) : 0;
    all = (unsigned long long)tiles;
    // never provably below the cut-off: every tile stays, nothing to test
    const bool alone = live && (e.thr == INFINITY || tiles <= kWarpTiles);
    if (alone) {
        if (e.thr == INFINITY) {
            kept = all;
        } else {
            for (unsigned ty = r.y0; ty < r.y1; ++ty) {
                const TileRow row = tile_row(a, e, ty);
                for (unsigned tx = r.x0; tx < r.x1; ++tx) kept += keeps_tile(a, e, row, tx);
            }
        }
    }
    // the large rectangles, one after another, each walked by every lane (no lane has returned)
    for (unsigned big = __ballot_sync(kFullMask, live && !alone); big; big &= big - 1) {
        const int src = __ffs(big) - 1;
        Rect rr;
        Ellipse ee;
        broadcast(r, e, src, rr, ee);
        const int64_t nt = rect_tiles(rr);
        unsigned c = 0;
        for (int64_t k = lane; k < nt; k += 32) {
            unsigned tx, ty;
            rect_tile(rr, k, tx, ty);
            c += keeps_tile(a, ee, tile_row(a, ee, ty), tx);
        }
        for (int off = 16; off > 0; off >>= 1) c += __shfl_down_sync(kFullMask, c, off);
        c = __shfl_sync(kFullMask, c, 0);
        if (lane == src) kept = c;
    }
    if (i < n) counts[i] = (int)kept;
    // one atomic per warp and counter
    for (int off = 16; off > 0; off >>= 1) {
        all += __shfl_down_sync(kFullMask, all, off);
        kept += __shfl_down_sync(kFullMask, kept, off);
    }
    if (lane == 0 && (all | kept) != 0) {
        atomicAdd(totals, all);
        atomicAdd(totals + 1, kept);
    }
}

__global__ void __launch_bounds__(kIsectThreads) isect_fill_kernel(
    const IsectArgs args,
    const float *__restrict__ depths,
    const int64_t *__restrict__ cum,
    int tile_bits,
    int64_t capacity,
    int64_t *__restrict__ keys,
    int *__restrict__ ids
) {
    const IsectArgs a = within_valid(args);
    const int64_t n = (int64_t)a.n_cams * a.n_gauss;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = (int)(threadIdx.x & 31);
    int64_t cur = 0, end = 0;
    if (i < n) {
        cur = i == 0 ? 0 : cum[i - 1];
        end = cum[i];
    }
    Rect r{};
    Ellipse e{};
    const bool live = cur != end && load_gaussian(a, i, r, e);
    const int64_t tiles = live ? rect_tiles(r) : 0;
    const bool every = live && end - cur == tiles; // the count kept them all: no need to test
    // a capped buffer (the sync-free intersection) keeps the pairs that fit; past it the step is
    // flagged as overflowed and redone (isect_pad_kernel)
    end = end < capacity ? end : capacity;
    const bool alone = live && tiles <= kWarpTiles;
    if (alone) {
        const int64_t cam_key = (i / a.n_gauss) << (32 + tile_bits);
        const int64_t depth_key = (int64_t)__float_as_uint(depths[i]); // the bits, zero-extended
        for (unsigned ty = r.y0; ty < r.y1 && cur < end; ++ty) {
            const TileRow row = tile_row(a, e, ty);
            for (unsigned tx = r.x0; tx < r.x1 && cur < end; ++tx) { // cur < end: never past the count
                if (!every && !keeps_tile(a, e, row, tx)) continue;
                keys[cur] = cam_key | (((int64_t)ty * a.tiles_x + tx) << 32) | depth_key;
                ids[cur++] = (int)i;
            }
        }
    }
    // the large rectangles, each walked by every lane, 32 tiles a round; a round's kept tiles take
    // consecutive slots in lane order (any order within one Gaussian's slots sorts the same: its
    // keys differ by tile)
    for (unsigned big = __ballot_sync(kFullMask, live && !alone); big; big &= big - 1) {
        const int src = __ffs(big) - 1;
        Rect rr;
        Ellipse ee;
        broadcast(r, e, src, rr, ee);
        const int64_t gi = __shfl_sync(kFullMask, (long long)i, src);
        int64_t at = __shfl_sync(kFullMask, (long long)cur, src);
        const int64_t stop = __shfl_sync(kFullMask, (long long)end, src);
        const bool all_kept = __shfl_sync(kFullMask, (int)every, src) != 0;
        const int64_t cam_key = (gi / a.n_gauss) << (32 + tile_bits);
        const int64_t depth_key = (int64_t)__float_as_uint(depths[gi]);
        const int64_t nt = rect_tiles(rr);
        for (int64_t base = 0; base < nt; base += 32) { // uniform over the warp: the ballot is converged
            const int64_t k = base + lane;
            unsigned tx = 0, ty = 0;
            bool keep = false;
            if (k < nt) {
                rect_tile(rr, k, tx, ty);
                keep = all_kept || keeps_tile(a, ee, tile_row(a, ee, ty), tx);
            }
            const unsigned mask = __ballot_sync(kFullMask, keep);
            const int64_t slot = at + __popc(mask & ((1u << lane) - 1u));
            if (keep && slot < stop) {
                keys[slot] = cam_key | (((int64_t)ty * a.tiles_x + tx) << 32) | depth_key;
                ids[slot] = (int)gi;
            }
            at += __popc(mask);
        }
    }
}

// The capped intersection's tail: slots past the kept count get a key that sorts last; an
// overflowed step sets the sticky flag to its tag (the first overflowed step), a step that fits
// adds its pair counts to pair_sum[0..1] (the run's record, read by the host when it reports),
// and pair_sum[2] keeps the most pairs any view kept (the next capacity).
__global__ void __launch_bounds__(kIsectThreads) isect_pad_kernel(
    const unsigned long long *__restrict__ totals,
    int64_t capacity,
    int64_t pad_key,
    const float *__restrict__ tag,
    int *__restrict__ flag,
    long long *__restrict__ pair_sum,
    const int *__restrict__ slot,
    int64_t *__restrict__ keys,
    int *__restrict__ ids,
    int *__restrict__ n_isects
) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t kept = (int64_t)totals[1];
    if (j == 0) {
        if (slot != nullptr) pair_sum += 3 * (int64_t)slot[0];
        const bool over = kept > capacity;
        if (over && *flag == 0) *flag = (int)tag[0];
        if (*flag == 0) {
            pair_sum[0] += (long long)totals[0];
            pair_sum[1] += (long long)kept;
        }
        if (kept > pair_sum[2]) pair_sum[2] = kept;
        *n_isects = (int)(over ? capacity : kept);
    }
    if (j < capacity && j >= kept) {
        keys[j] = pad_key;
        ids[j] = 0;
    }
}

// isect_offset_encode with the pair count on the device: offsets[t] = first sorted pair of tile t
// (flat over cameras and tiles), the count for tiles after the last pair.
// A key's flat tile over [C, tiles]: its camera and tile fields (gsplat's isect_offset_encode).
__device__ __forceinline__ int64_t flat_tile(int64_t key, int tile_bits, int tiles_per_cam) {
    const int64_t cam = key >> (32 + tile_bits);
    const int64_t tile = (key >> 32) & ((int64_t(1) << tile_bits) - 1);
    return cam * tiles_per_cam + tile;
}

__global__ void __launch_bounds__(kIsectThreads) isect_offsets_kernel(
    const int64_t *__restrict__ keys, const int *__restrict__ n_isects, int tile_bits, int tiles_per_cam,
    int tiles_total, int *__restrict__ offsets
) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t count = *n_isects;
    if (j > count) return;
    const int64_t cur = j < count ? flat_tile(keys[j], tile_bits, tiles_per_cam) : tiles_total;
    const int64_t prev = j == 0 ? -1 : flat_tile(keys[j - 1], tile_bits, tiles_per_cam);
    for (int64_t t = prev + 1; t <= cur && t < tiles_total; ++t) offsets[t] = (int)j;
}

int blocks_for(int64_t n) { return (int)((n + kIsectThreads - 1) / kIsectThreads); }

} // namespace

cudaError_t launch_isect_count(const IsectArgs &a, int *counts, unsigned long long *totals, cudaStream_t stream) {
    const int64_t n = (int64_t)a.n_cams * a.n_gauss;
    if (n == 0) return cudaSuccess;
    isect_count_kernel<<<blocks_for(n), kIsectThreads, 0, stream>>>(a, counts, totals);
    return cudaGetLastError();
}

cudaError_t launch_isect_fill(
    const IsectArgs &a, const float *depths, const int64_t *cum, int tile_bits, int64_t capacity, int64_t *keys,
    int *ids, cudaStream_t stream
) {
    const int64_t n = (int64_t)a.n_cams * a.n_gauss;
    if (n == 0) return cudaSuccess;
    isect_fill_kernel<<<blocks_for(n), kIsectThreads, 0, stream>>>(a, depths, cum, tile_bits, capacity, keys, ids);
    return cudaGetLastError();
}

cudaError_t launch_isect_pad(const IsectPad &p, int64_t *keys, int *ids, cudaStream_t stream) {
    isect_pad_kernel<<<blocks_for(p.capacity), kIsectThreads, 0, stream>>>(
        p.totals, p.capacity, p.pad_key, p.tag, p.flag, p.pair_sum, p.slot, keys, ids, p.n_isects
    );
    return cudaGetLastError();
}

cudaError_t launch_isect_offsets(
    const int64_t *keys, const int *n_isects, int64_t capacity, int tile_bits, int tiles_per_cam, int tiles_total,
    int *offsets, cudaStream_t stream
) {
    isect_offsets_kernel<<<blocks_for(capacity + 1), kIsectThreads, 0, stream>>>(
        keys, n_isects, tile_bits, tiles_per_cam, tiles_total, offsets
    );
    return cudaGetLastError();
}

cudaError_t isect_sort_pairs(
    void *temp, size_t &temp_bytes, const int64_t *keys_in, int64_t *keys_out, const int *ids_in, int *ids_out,
    int n, int end_bit, cudaStream_t stream
) {
    // the keys are non-negative: sorting them as unsigned is the same order, with no sign twiddle
    using Key = unsigned long long;
    return cub::DeviceRadixSort::SortPairs(
        temp, temp_bytes, reinterpret_cast<const Key *>(keys_in), reinterpret_cast<Key *>(keys_out), ids_in, ids_out,
        n, 0, end_bit, stream
    );
}

} // namespace gstrain
