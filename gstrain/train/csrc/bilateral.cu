// The bilateral grid's slice-and-apply, forward and backward, with F.grid_sample's semantics
// (trilinear, align_corners=True, border padding) as gstrain/train/bilateral_grid.py uses it.
//
// One thread per pixel, blocks of kTileX x kTileY pixels (a warp is one row of 32 pixels). The
// backward recomputes the blend instead of reading a stored [H, W, 12]. The grid's gradient is
// the hard part: every pixel adds into 8 cells x 12 entries of a grid of a few thousand floats,
// so global atomics from every pixel pile onto the same few addresses. A block's pixels touch
// only a few (x, y) cells (a 32 x 8 tile of a 1250-pixel-wide view spans under one cell of 16),
// so the block sums into a shared-memory copy of those cells (every luminance level), then adds
// each touched entry to the grid once. A warp whose pixels all fall in the same cell sums with
// shuffles first (the common case: smooth regions), so shared atomics are left to the rest. A
// block whose cells do not fit the shared tile (tiny images against large grids) adds straight
// to global memory: slower, the same sums.
//
// The backward's variants (BilateralBwdVariant) differ only in that summing. Luminance varies
// from pixel to pixel, so a warp's lanes seldom all share one cell, and the per-pixel shared
// atomics then pile up on the few addresses of the warp's cells. The run variants sum every run
// of neighbouring lanes with the same cell by segmented shuffles first, one atomic a run.
#include "bilateral.h"

#include <cstdint>

namespace gstrain {
namespace {

constexpr int kTileX = 32; // one warp per row: the shuffle fast path assumes blockDim.x == 32
constexpr int kTileY = 8;
constexpr int kThreads = kTileX * kTileY;
constexpr int kCoeffs = 12;
constexpr int kCorners = 8;
constexpr unsigned kFullMask = 0xffffffffu;
// The shared tile holds every luminance level of at most this many (x, y) cells ...
constexpr int kTileCells = 16;
// ... within the shared memory a block may take without opting in (48 KiB)
constexpr int kSharedBytes = 48 * 1024;

// Positions are computed with the rounding of bilateral_grid.slice_grid's tensor ops followed by
// grid_sample's unnormalisation, one correctly rounded operation at a time (the _rn intrinsics keep
// the compiler from fusing them): the same float as the grid_sample path, so a pixel sits on the
// same side of a cell boundary and of the border in both (where the guide's gradient jumps).
__device__ __forceinline__ float unnormalise(const float coord, const int cells) {
    return __fmul_rn(__fdiv_rn(__fadd_rn(coord, 1.0f), 2.0f), (float)(cells - 1));
}

// The position of pixel p on an axis of `cells` cells, `step` = 2 / (the view's pixels on that
// axis): the pixel centre's coordinate in [-1, 1] unnormalised as grid_sample(align_corners=True)
// does, clamped to [0, cells - 1] (border padding: past the view's edge is the last cell).
__device__ __forceinline__ float axis_pos(const int p, const float step, const int cells) {
    const float coord = __fsub_rn(__fmul_rn(__fadd_rn((float)p, 0.5f), step), 1.0f);
    return fminf(fmaxf(unnormalise(coord, cells), 0.0f), (float)(cells - 1));
}

// The lower cell of a clamped position: at the last cell the upper neighbour is the same cell with
// weight 0 (grid_sample skips the out-of-range one; its weight is 0 there too).
__device__ __forceinline__ int lower_cell(const float pos, const int cells) {
    return min(max((int)floorf(pos), 0), cells - 1);
}

// One pixel's place in the grid: the lower cells, the upper ones, the upper ones' weights, and
// whether its luminance coordinate is strictly inside (grid_sample's coordinate gradient is 0 at or
// beyond the border; luminance <= 0 or >= 1 lands there too, so clamp's own rule adds nothing).
struct Place {
    int x0, y0, z0, x1, y1, z1;
    float fx, fy, fz;
    bool guide_inside;
};

struct ViewScale { // 2 / the view's width, 2 / its height
    float step_x;
    float step_y;
};

__device__ __forceinline__ ViewScale view_scale(const BilateralDims &d) {
    int w = d.width, h = d.height;
    if (d.valid != nullptr) { // read on the device: a captured step serves views of every size
        w = max(d.valid[0], 1);
        h = max(d.valid[1], 1);
    }
    return {__fdiv_rn(2.0f, (float)w), __fdiv_rn(2.0f, (float)h)};
}

__device__ __forceinline__ Place place_of(const BilateralDims &d, const ViewScale s, const int px, const int py,
                                          const float r, const float g, const float b) {
    Place p;
    const float x = axis_pos(px, s.step_x, d.cells_x);
    const float y = axis_pos(py, s.step_y, d.cells_y);
    const float luma = __fadd_rn(__fadd_rn(__fmul_rn(r, d.luma_r), __fmul_rn(g, d.luma_g)), __fmul_rn(b, d.luma_b));
    // the guide clamp(luma) * 2 - 1, unnormalised and clamped; fmaxf/fminf drop a NaN to 0
    const float guide = __fsub_rn(__fmul_rn(fminf(fmaxf(luma, 0.0f), 1.0f), 2.0f), 1.0f);
    const float z = fminf(fmaxf(unnormalise(guide, d.levels), 0.0f), (float)(d.levels - 1));
    p.x0 = lower_cell(x, d.cells_x);
    p.y0 = lower_cell(y, d.cells_y);
    p.z0 = lower_cell(z, d.levels);
    p.x1 = min(p.x0 + 1, d.cells_x - 1);
    p.y1 = min(p.y0 + 1, d.cells_y - 1);
    p.z1 = min(p.z0 + 1, d.levels - 1);
    p.fx = x - (float)p.x0;
    p.fy = y - (float)p.y0;
    p.fz = z - (float)p.z0;
    p.guide_inside = z > 0.0f && z < (float)(d.levels - 1);
    return p;
}

// Corner c (bit 0: x, bit 1: y, bit 2: z upper) of a place: its offset in one entry's [L, Y, X]
// block and its trilinear weight.
__device__ __forceinline__ void corners_of(const BilateralDims &d, const Place &p, int offset[kCorners],
                                           float weight[kCorners]) {
#pragma unroll
    for (int c = 0; c < kCorners; ++c) {
        const int x = (c & 1) ? p.x1 : p.x0;
        const int y = (c & 2) ? p.y1 : p.y0;
        const int z = (c & 4) ? p.z1 : p.z0;
        offset[c] = (z * d.cells_y + y) * d.cells_x + x;
        weight[c] = ((c & 1) ? p.fx : 1.0f - p.fx) * ((c & 2) ? p.fy : 1.0f - p.fy) * ((c & 4) ? p.fz : 1.0f - p.fz);
    }
}

__global__ void bilateral_fwd_kernel(const BilateralDims d, const float *__restrict__ image,
                                     const float *__restrict__ grid, float *__restrict__ out) {
    const int px = blockIdx.x * kTileX + threadIdx.x;
    const int py = blockIdx.y * kTileY + threadIdx.y;
    if (px >= d.width || py >= d.height) return;
    const int64_t pixel = (int64_t)py * d.width + px;
    const float rgb[3] = {image[3 * pixel], image[3 * pixel + 1], image[3 * pixel + 2]};
    const Place p = place_of(d, view_scale(d), px, py, rgb[0], rgb[1], rgb[2]);
    int offset[kCorners];
    float weight[kCorners];
    corners_of(d, p, offset, weight);
    const int64_t entry = (int64_t)d.levels * d.cells_y * d.cells_x;
    float result[3];
#pragma unroll
    for (int r = 0; r < 3; ++r) {
        float acc = 0.0f;
#pragma unroll
        for (int col = 0; col < 4; ++col) {
            const float *plane = grid + (4 * r + col) * entry;
            float coeff = 0.0f;
#pragma unroll
            for (int c = 0; c < kCorners; ++c) coeff = fmaf(weight[c], __ldg(plane + offset[c]), coeff);
            acc = col < 3 ? fmaf(coeff, rgb[col], acc) : acc + coeff;
        }
        result[r] = acc;
    }
    out[3 * pixel] = result[0];
    out[3 * pixel + 1] = result[1];
    out[3 * pixel + 2] = result[2];
}

// The (x, y) cells the block's pixels can touch: positions grow with the pixel index, so the first
// and last pixel of the tile bound them on each axis.
struct BlockCells {
    int x_lo, y_lo, nx, ny;
};

__device__ __forceinline__ BlockCells block_cells(const BilateralDims &d, const ViewScale s) {
    const int px0 = blockIdx.x * kTileX, px1 = min(px0 + kTileX, d.width) - 1;
    const int py0 = blockIdx.y * kTileY, py1 = min(py0 + kTileY, d.height) - 1;
    BlockCells b;
    b.x_lo = lower_cell(axis_pos(px0, s.step_x, d.cells_x), d.cells_x);
    b.y_lo = lower_cell(axis_pos(py0, s.step_y, d.cells_y), d.cells_y);
    const int x_hi = min(lower_cell(axis_pos(px1, s.step_x, d.cells_x), d.cells_x) + 1, d.cells_x - 1);
    const int y_hi = min(lower_cell(axis_pos(py1, s.step_y, d.cells_y), d.cells_y) + 1, d.cells_y - 1);
    b.nx = x_hi - b.x_lo + 1;
    b.ny = y_hi - b.y_lo + 1;
    return b;
}

// Shared tile layout: [12, levels, ny, nx] over the block's cells.
__device__ __forceinline__ int tile_index(const BilateralDims &d, const BlockCells &b, const int k, const int z,
                                          const int y, const int x) {
    return ((k * d.levels + z) * b.ny + (y - b.y_lo)) * b.nx + (x - b.x_lo);
}

// A warp's run of neighbouring lanes that share one key (the pixel's lower cell, so all 8 corners):
// the run's last lane, whether this lane starts its run, and the warp's longest run (how many
// shuffle steps a sum over every run needs).
struct WarpRun {
    int end;
    bool head;
    int longest;
};

__device__ __forceinline__ WarpRun warp_run_of(const int key) {
    const int lane = threadIdx.x;
    const int next = __shfl_down_sync(kFullMask, key, 1);
    const int prev = __shfl_up_sync(kFullMask, key, 1);
    const unsigned tails = __ballot_sync(kFullMask, lane == kTileX - 1 || next != key);
    WarpRun r;
    r.end = __ffs(tails & (kFullMask << lane)) - 1;
    r.head = lane == 0 || prev != key;
    int longest = r.end - lane + 1;
#pragma unroll
    for (int step = 16; step > 0; step >>= 1) longest = max(longest, __shfl_xor_sync(kFullMask, longest, step));
    r.longest = longest;
    return r;
}

// The sum of v over this lane's run from this lane to the run's end (the head lane: the whole run):
// a segmented suffix sum, log2(longest run) shuffles; every lane of the warp must call it.
__device__ __forceinline__ float run_sum(float v, const WarpRun &r) {
#pragma unroll
    for (int step = 1; step < kTileX; step <<= 1) {
        if (step >= r.longest) break; // warp-uniform
        const float other = __shfl_down_sync(kFullMask, v, step);
        if ((int)threadIdx.x + step <= r.end) v += other;
    }
    return v;
}

// Backward variants (BilateralBwdVariant in bilateral.h): how a block sums its pixels' grid
// gradient before the single add per touched entry.
template <int kVariant>
__device__ __forceinline__ void bilateral_bwd_block(const BilateralDims &d, const int tile_cells,
                                                    const float *__restrict__ image, const float *__restrict__ grid,
                                                    const float *__restrict__ grad_out, float *__restrict__ grad_image,
                                                    float *__restrict__ grad_grid) {
    extern __shared__ float tile[]; // [12, levels, ny, nx] when the block's cells fit (use_tile)
    const ViewScale s = view_scale(d);
    const BlockCells cells = block_cells(d, s);
    // the same for every thread of the block: the __syncthreads below are reached by all or none
    const bool use_tile = cells.nx * cells.ny <= tile_cells;
    const int tile_size = kCoeffs * d.levels * cells.nx * cells.ny;
    const int tid = threadIdx.y * kTileX + threadIdx.x;
    if (use_tile) {
        for (int i = tid; i < tile_size; i += kThreads) tile[i] = 0.0f;
        __syncthreads();
    }

    const int px = blockIdx.x * kTileX + threadIdx.x;
    const int py = blockIdx.y * kTileY + threadIdx.y;
    const bool inside = px < d.width && py < d.height;
    const int64_t entry = (int64_t)d.levels * d.cells_y * d.cells_x;
    // d loss / d entry k of the pixel's blended transform (0 for a thread past the image)
    float dcoeff[kCoeffs];
    int offset[kCorners];
    float weight[kCorners];
    Place p{};
    if (inside) {
        const int64_t pixel = (int64_t)py * d.width + px;
        const float rgb[3] = {image[3 * pixel], image[3 * pixel + 1], image[3 * pixel + 2]};
        const float dout[3] = {grad_out[3 * pixel], grad_out[3 * pixel + 1], grad_out[3 * pixel + 2]};
        p = place_of(d, s, px, py, rgb[0], rgb[1], rgb[2]);
        corners_of(d, p, offset, weight);
        float drgb[3] = {0.0f, 0.0f, 0.0f};
        float dz = 0.0f; // d loss / d the luminance coordinate
#pragma unroll
        for (int r = 0; r < 3; ++r) {
#pragma unroll
            for (int col = 0; col < 4; ++col) {
                const int k = 4 * r + col;
                const float *plane = grid + k * entry;
                float coeff = 0.0f, slope = 0.0f; // the blend and its derivative along z
#pragma unroll
                for (int c = 0; c < kCorners; ++c) {
                    const float v = __ldg(plane + offset[c]);
                    coeff = fmaf(weight[c], v, coeff);
                    // d weight / d z: +(xy weight) for the upper level, -(xy weight) for the lower
                    const float wxy = ((c & 1) ? p.fx : 1.0f - p.fx) * ((c & 2) ? p.fy : 1.0f - p.fy);
                    slope = fmaf((c & 4) ? wxy : -wxy, v, slope);
                }
                const float dk = col < 3 ? dout[r] * rgb[col] : dout[r];
                dcoeff[k] = dk;
                dz = fmaf(dk, slope, dz);
                if (col < 3) drgb[col] = fmaf(dout[r], coeff, drgb[col]);
            }
        }
        if (p.guide_inside) { // z = (clamp(luma) * 2 - 1 + 1) / 2 * (L - 1): d z / d luma = L - 1
            const float dluma = dz * (float)(d.levels - 1);
            drgb[0] = fmaf(dluma, d.luma_r, drgb[0]);
            drgb[1] = fmaf(dluma, d.luma_g, drgb[1]);
            drgb[2] = fmaf(dluma, d.luma_b, drgb[2]);
        }
        grad_image[3 * pixel] = drgb[0];
        grad_image[3 * pixel + 1] = drgb[1];
        grad_image[3 * pixel + 2] = drgb[2];
    } else {
#pragma unroll
        for (int k = 0; k < kCoeffs; ++k) dcoeff[k] = 0.0f;
#pragma unroll
        for (int c = 0; c < kCorners; ++c) {
            offset[c] = 0;
            weight[c] = 0.0f;
        }
    }

    if (kVariant != kBilateralBwdShared) {
        // Lanes in a run of equal lower cells (smooth luminance: most of a row) sum with shuffles;
        // only the run's head adds, so an address takes one add per run instead of one per pixel
        // (shared float atomics on one address serialise across the warp's lanes).
        const WarpRun run = warp_run_of(inside ? offset[0] : -1 - (int)threadIdx.x); // outside: own run
        const bool adds = run.head && inside;
        const int stride = use_tile ? d.levels * cells.ny * cells.nx : (int)entry; // entry k to k + 1
        float *target = use_tile ? tile : grad_grid;
        int base[kCorners];
#pragma unroll
        for (int c = 0; c < kCorners; ++c) {
            const int x = (c & 1) ? p.x1 : p.x0, y = (c & 2) ? p.y1 : p.y0, z = (c & 4) ? p.z1 : p.z0;
            base[c] = !adds ? 0 : use_tile ? tile_index(d, cells, 0, z, y, x) : offset[c];
        }
        if (kVariant == kBilateralBwdWarpRuns) {
#pragma unroll
            for (int k = 0; k < kCoeffs; ++k) {
#pragma unroll
                for (int c = 0; c < kCorners; ++c) {
                    const float v = run_sum(weight[c] * dcoeff[k], run);
                    if (adds) atomicAdd(target + base[c] + k * stride, v);
                }
            }
        } else { // kBilateralBwdRowRuns: a warp is one row, so the y weight is common to its lanes
            const float wy[2] = {1.0f - p.fy, p.fy};
#pragma unroll
            for (int k = 0; k < kCoeffs; ++k) {
#pragma unroll
                for (int c = 0; c < kCorners; ++c) {
                    if (c & 2) continue; // the y-upper corner shares the sum with its y-lower one
                    const float wxz = ((c & 1) ? p.fx : 1.0f - p.fx) * ((c & 4) ? p.fz : 1.0f - p.fz);
                    const float v = run_sum(wxz * dcoeff[k], run);
                    if (adds) {
                        atomicAdd(target + base[c] + k * stride, v * wy[0]);
                        atomicAdd(target + base[c | 2] + k * stride, v * wy[1]);
                    }
                }
            }
        }
        if (!use_tile) return; // block-uniform: no thread of this block waits at a barrier
    } else if (!use_tile) { // cells too many for the tile: straight to the grid
        if (inside) {
#pragma unroll
            for (int k = 0; k < kCoeffs; ++k) {
#pragma unroll
                for (int c = 0; c < kCorners; ++c) atomicAdd(grad_grid + k * entry + offset[c], weight[c] * dcoeff[k]);
            }
        }
        return; // block-uniform: no thread of this block waits at a barrier
    }

    // A warp (one row of 32 pixels) whose pixels share one lower cell sums with shuffles.
    const unsigned lanes_in = __ballot_sync(kFullMask, inside);
    if (kVariant == kBilateralBwdShared && lanes_in != 0) {
        const int leader = __ffs(lanes_in) - 1;
        const int key = inside ? offset[0] : -1; // the lower corner's offset names all 8 corners
        const int leader_key = __shfl_sync(kFullMask, key, leader);
        if (__all_sync(kFullMask, !inside || key == leader_key)) {
            // corner c of every inside lane is the leader's corner c; lanes outside add zeros
            int lead_offset[kCorners];
#pragma unroll
            for (int c = 0; c < kCorners; ++c) lead_offset[c] = __shfl_sync(kFullMask, offset[c], leader);
#pragma unroll
            for (int k = 0; k < kCoeffs; ++k) {
#pragma unroll
                for (int c = 0; c < kCorners; ++c) {
                    float v = weight[c] * dcoeff[k];
#pragma unroll
                    for (int step = 16; step > 0; step >>= 1) v += __shfl_down_sync(kFullMask, v, step);
                    if (threadIdx.x == 0) {
                        const int o = lead_offset[c];
                        const int x = o % d.cells_x, y = (o / d.cells_x) % d.cells_y, z = o / (d.cells_x * d.cells_y);
                        atomicAdd(tile + tile_index(d, cells, k, z, y, x), v);
                    }
                }
            }
        } else if (inside) {
#pragma unroll
            for (int c = 0; c < kCorners; ++c) {
                const int x = (c & 1) ? p.x1 : p.x0, y = (c & 2) ? p.y1 : p.y0, z = (c & 4) ? p.z1 : p.z0;
                const int base = tile_index(d, cells, 0, z, y, x);
                const int stride = d.levels * cells.ny * cells.nx; // one entry k to the next
#pragma unroll
                for (int k = 0; k < kCoeffs; ++k) atomicAdd(tile + base + k * stride, weight[c] * dcoeff[k]);
            }
        }
    }
    __syncthreads();
    // one global add per touched entry (an entry no pixel reached holds an exact 0 and is skipped)
    const int plane = cells.nx * cells.ny;
    for (int i = tid; i < tile_size; i += kThreads) {
        const float v = tile[i];
        if (v == 0.0f) continue;
        const int lx = i % cells.nx, ly = (i / cells.nx) % cells.ny;
        const int kz = i / plane; // k * levels + z
        const int z = kz % d.levels, k = kz / d.levels;
        atomicAdd(grad_grid + k * entry + ((int64_t)z * d.cells_y + cells.y_lo + ly) * d.cells_x + cells.x_lo + lx,
                  v);
    }
}

__global__ void bilateral_bwd_kernel(const BilateralDims d, const int tile_cells, const float *__restrict__ image,
                                     const float *__restrict__ grid, const float *__restrict__ grad_out,
                                     float *__restrict__ grad_image, float *__restrict__ grad_grid) {
    bilateral_bwd_block<kBilateralBwdShared>(d, tile_cells, image, grid, grad_out, grad_image, grad_grid);
}

// The run variants fit 80 registers without spilling (sm_90, ptxas -v): 3 blocks an SM instead of
// the 2 that 96 registers allow.
template <int kVariant>
__global__ void __launch_bounds__(kThreads, 3)
    bilateral_bwd_runs_kernel(const BilateralDims d, const int tile_cells, const float *__restrict__ image,
                              const float *__restrict__ grid, const float *__restrict__ grad_out,
                              float *__restrict__ grad_image, float *__restrict__ grad_grid) {
    bilateral_bwd_block<kVariant>(d, tile_cells, image, grid, grad_out, grad_image, grad_grid);
}

dim3 blocks_of(const BilateralDims &d) {
    return dim3((unsigned)((d.width + kTileX - 1) / kTileX), (unsigned)((d.height + kTileY - 1) / kTileY));
}

} // namespace

cudaError_t launch_bilateral_fwd(const BilateralDims &d, const float *image, const float *grid, float *out,
                                 cudaStream_t stream) {
    if (d.width <= 0 || d.height <= 0) return cudaSuccess;
    bilateral_fwd_kernel<<<blocks_of(d), dim3(kTileX, kTileY), 0, stream>>>(d, image, grid, out);
    return cudaGetLastError();
}

cudaError_t launch_bilateral_bwd(const BilateralDims &d, const float *image, const float *grid, const float *grad_out,
                                 float *grad_image, float *grad_grid, const int variant, cudaStream_t stream) {
    if (d.width <= 0 || d.height <= 0) return cudaSuccess;
    if (variant < 0 || variant >= kBilateralBwdVariants) return cudaErrorInvalidValue;
    // as many (x, y) cells (every level each) as kTileCells and the shared budget allow; 0: none,
    // every block adds to the grid directly
    const int per_cell = kCoeffs * d.levels * (int)sizeof(float);
    int tile_cells = kSharedBytes / per_cell;
    if (tile_cells > kTileCells) tile_cells = kTileCells;
    const size_t shared = tile_cells > 0 ? (size_t)tile_cells * per_cell : 0;
    const dim3 blocks = blocks_of(d), threads(kTileX, kTileY);
    if (variant == kBilateralBwdWarpRuns) {
        bilateral_bwd_runs_kernel<kBilateralBwdWarpRuns><<<blocks, threads, shared, stream>>>(
            d, tile_cells, image, grid, grad_out, grad_image, grad_grid
        );
    } else if (variant == kBilateralBwdRowRuns) {
        bilateral_bwd_runs_kernel<kBilateralBwdRowRuns><<<blocks, threads, shared, stream>>>(
            d, tile_cells, image, grid, grad_out, grad_image, grad_grid
        );
    } else {
        bilateral_bwd_kernel<<<blocks, threads, shared, stream>>>(
            d, tile_cells, image, grid, grad_out, grad_image, grad_grid
        );
    }
    return cudaGetLastError();
}

} // namespace gstrain
