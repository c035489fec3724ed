// Host-visible interface of the culled tile intersection (render.ellipse_cull on CUDA).
// Free of torch headers, like raster.h: isect.cu compiles with plain nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace gstrain {

struct IsectArgs {
    int n_cams;   // C
    int n_gauss;  // N (inputs are [C, N, ...] flattened to [C*N, ...])
    int width;
    int height;
    int tile_size;
    int tiles_x;
    int tiles_y;
    const float *means2d;   // [C*N, 2]
    const int *radii;       // [C*N, 2] (<= 0 on either axis: no tiles)
    const float *conics;    // [C*N, 3]
    const float *opacities; // [C*N]
};

// Per (camera, Gaussian): counts[i] = tiles of its bounding rectangle that pass the ellipse
// test; totals[0] += all tiles of the rectangles (isect_tiles' count), totals[1] += the kept
// ones. `totals` must be zeroed by the caller.
cudaError_t launch_isect_count(const IsectArgs &a, int *counts, unsigned long long *totals, cudaStream_t stream);

// Writes the kept pairs of Gaussian i at [cum[i-1], cum[i]) (cum: inclusive prefix sum of
// counts), in row-major tile order: keys = camera | tile | depth bits (gsplat's isect_ids
// layout, tile_bits wide tile field) and ids = i.
cudaError_t launch_isect_fill(
    const IsectArgs &a,
    const float *depths,  // [C*N]
    const int64_t *cum,   // [C*N]
    int tile_bits,
    int64_t *keys,        // [M]
    int *ids,             // [M]
    cudaStream_t stream
);

// Stable radix sort of (keys, ids) on key bits [0, end_bit). cub's two-call protocol: with
// temp == nullptr only sets temp_bytes.
cudaError_t isect_sort_pairs(
    void *temp,
    size_t &temp_bytes,
    const int64_t *keys_in,
    int64_t *keys_out,
    const int *ids_in,
    int *ids_out,
    int n,
    int end_bit,
    cudaStream_t stream
);

} // namespace gstrain
