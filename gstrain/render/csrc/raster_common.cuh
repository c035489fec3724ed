// Device helpers shared by the forward and backward kernels. Both passes must make the same
// skip decisions, so the alpha test lives in exactly one place.
#pragma once

#include <cuda_runtime.h>

#include "raster.h"

namespace gstrain {

// CONVENTIONS.md compositing constants. The alpha cap is gsplat's 0.999 (the original 3DGS
// kernel uses 0.99): with gsplat's rasterizer as the other backend, both must train the same model.
constexpr float kAlphaMax = 0.999f;
constexpr float kAlphaMin = 1.0f / 255.0f;
constexpr float kTransmittanceMin = 1e-4f;

// Tiles of 8x8 or 16x16 pixels, one thread each; the bound lets the compiler use the registers
// a 256-thread block can have.
constexpr int kMaxThreads = 256;

// One Gaussian as cached in shared memory: (x, y, opacity, -) and (a, b, c, -); float4 so a
// broadcast read is one 16-byte load.
struct SplatEval {
    float dx, dy; // mean - pixel centre
    float vis;    // exp(-sigma)
    float alpha;  // min(kAlphaMax, opacity * vis)
};

// False when the Gaussian is skipped at this pixel (sigma < 0 or alpha < 1/255).
__device__ __forceinline__ bool eval_splat(
    const float4 xyo, const float4 abc, const float px, const float py, SplatEval &e
) {
    e.dx = xyo.x - px;
    e.dy = xyo.y - py;
    const float sigma =
        0.5f * (abc.x * e.dx * e.dx + abc.z * e.dy * e.dy) + abc.y * e.dx * e.dy;
    e.vis = __expf(-sigma);
    e.alpha = fminf(kAlphaMax, xyo.z * e.vis);
    return sigma >= 0.f && e.alpha >= kAlphaMin;
}

// Position of the block's tile and of this thread's pixel.
struct TileCoord {
    int cam;
    int tile;        // flat over [C, tiles_y, tiles_x]
    int x, y;        // pixel
    bool inside;     // the tile's last row/column may hang over the image edge
    int pix;         // flat over [C, H, W] (clamped to 0 when outside)
    int range_start; // this tile's slice of flatten_ids
    int range_end;
};

__device__ __forceinline__ TileCoord tile_coord(const RasterArgs &a) {
    TileCoord c;
    c.cam = blockIdx.z;
    c.tile = (c.cam * a.tiles_y + blockIdx.y) * a.tiles_x + blockIdx.x;
    c.x = blockIdx.x * a.tile_size + threadIdx.x;
    c.y = blockIdx.y * a.tile_size + threadIdx.y;
    c.inside = c.x < a.width && c.y < a.height;
    c.pix = c.inside ? (c.cam * a.height + c.y) * a.width + c.x : 0;
    const int n_tiles = a.n_cams * a.tiles_y * a.tiles_x;
    c.range_start = a.tile_offsets[c.tile];
    c.range_end = c.tile + 1 < n_tiles ? a.tile_offsets[c.tile + 1]
                                       : (a.n_isects_dev != nullptr ? *a.n_isects_dev : a.n_isects);
    return c;
}

// Copies Gaussian g into the block's shared-memory slot `slot`.
template <int CH>
__device__ __forceinline__ void stage_splat(
    const RasterArgs &a, const int g, const int slot, float4 *s_xyo, float4 *s_abc, float *s_col
) {
    const float2 m = reinterpret_cast<const float2 *>(a.means2d)[g];
    s_xyo[slot] = make_float4(m.x, m.y, a.opacities[g], 0.f);
    const float *cn = a.conics + 3 * g;
    s_abc[slot] = make_float4(cn[0], cn[1], cn[2], 0.f);
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        s_col[slot * CH + k] = a.colors[g * CH + k];
    }
}

template <int CH>
constexpr size_t stage_bytes_per_slot(bool with_ids) {
    return 2 * sizeof(float4) + CH * sizeof(float) + (with_ids ? sizeof(int) : 0);
}

} // namespace gstrain
