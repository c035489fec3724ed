// Host-visible interface of gstrain's tile rasterizer (3DGS, non-packed, C cameras).
// Kept free of torch headers so the .cu files compile fast and can be checked with plain nvcc.
#pragma once

#include <cuda_runtime.h>

namespace gstrain {

// Channel counts with compiled kernels; other counts are padded (or split into chunks of 32)
// by the host code.
#define GSTRAIN_FOR_EACH_CHANNELS(X) X(1) X(2) X(3) X(4) X(8) X(16) X(32)
constexpr int kMaxChunkChannels = 32;

struct RasterArgs {
    int n_cams;       // C
    int n_gauss;      // N (per camera; inputs are [C, N, ...] flattened to [C*N, ...])
    int n_isects;     // length of flatten_ids
    int width;
    int height;
    int tile_size;
    int tiles_x;
    int tiles_y;
    const float *means2d;     // [C*N, 2]
    const float *conics;      // [C*N, 3]  (a, b, c) = (inv00, inv01, inv11)
    const float *colors;      // [C*N, CH]
    const float *opacities;   // [C*N]
    const float *backgrounds; // [C, CH] or nullptr
    const int *tile_offsets;  // [C, tiles_y, tiles_x]
    const int *flatten_ids;   // [n_isects], values in [0, C*N)
    const int *n_isects_dev;  // nullptr, or [1]: the real pair count (<= n_isects) on the device
};

// Where the backward's atomics land. Scalar layout: the final tensors. Vector layout: `geo`
// [C*N, 8] = (conic a, b, c, opacity, mean x, y, |mean x|, |mean y|) so that sm_90 float4 atomics
// hit 16-byte aligned addresses; colours in `colors` with row stride `cstride` (3 -> 4).
struct GradPtrs {
    float *colors;
    int cstride;
    float *means2d;
    float *conics;
    float *opacities;
    float *absgrad; // nullptr when absgrad is off (scalar layout)
    float *geo;     // vector layout only
};

// Threshold meaning "never warp-reduce" (each lane adds): the `atomic` mode.
constexpr int kThresholdNever = 33;

template <int CH>
cudaError_t launch_raster_fwd(
    const RasterArgs &a,
    float *image,     // [C, H, W, CH]
    float *alpha,     // [C, H, W] or nullptr
    float *t_final,   // [C, H, W] or nullptr
    int *last_ids,    // [C, H, W] or nullptr
    cudaStream_t stream
);

template <int CH, bool VEC>
cudaError_t launch_raster_bwd(
    const RasterArgs &a,
    const float *t_final,  // [C, H, W]
    const int *last_ids,   // [C, H, W]
    const float *v_image,  // [C, H, W, CH]
    const float *v_alpha,  // [C, H, W] or nullptr
    const GradPtrs &grads,
    bool absgrad,
    int threshold,         // reduce across the warp when at least this many lanes contribute
    bool scatter,          // reduce by reduce-scatter (one slot per lane) where the slots fit 16
    cudaStream_t stream
);

} // namespace gstrain
