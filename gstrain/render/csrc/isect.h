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
    int tiles_x;          // the tile grid (the keys' tile field)
    int tiles_y;
    int bound_x;          // tiles a rectangle is clipped to: tiles_x / tiles_y, or the valid size's
    int bound_y;
    const int *valid;     // nullptr, or [2] on the device: the image's width and height inside a larger
                          // canvas (a CUDA-graph step shared by every image size); replaces width,
                          // height and the bounds when the kernels run
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
// layout, tile_bits wide tile field) and ids = i. Slots at or past `capacity` are not written.
cudaError_t launch_isect_fill(
    const IsectArgs &a,
    const float *depths,  // [C*N]
    const int64_t *cum,   // [C*N]
    int tile_bits,
    int64_t capacity,
    int64_t *keys,        // [capacity]
    int *ids,             // [capacity]
    cudaStream_t stream
);

// The sync-free intersection's bookkeeping, all on the device (isect_pad_kernel).
struct IsectPad {
    const unsigned long long *totals; // isect_count's [before, kept]
    int64_t capacity;                 // slots in keys / ids
    int64_t pad_key;                  // sorts after every real key
    const float *tag;                 // this step's tag (> 0), written to flag on overflow
    int *flag;                        // sticky: 0, or the tag of the first overflowed step
    long long *pair_sum;              // [3]: [0..1] += totals while flag is 0; [2] = max kept
    const int *slot;                  // nullptr, or [1] on the device: use pair_sum + 3 * slot
    int *n_isects;                    // [1] out: pairs in the buffer (min(kept, capacity))
};

// Pads slots [kept, capacity) with pad_key / id 0 and does IsectPad's bookkeeping.
cudaError_t launch_isect_pad(const IsectPad &p, int64_t *keys, int *ids, cudaStream_t stream);

// offsets [C * tiles_per_cam] = first pair of each (camera, tile) in the sorted keys, the first
// *n_isects of which are real (gsplat's isect_offset_encode with the count on the device).
cudaError_t launch_isect_offsets(
    const int64_t *keys,
    const int *n_isects,
    int64_t capacity,
    int tile_bits,
    int tiles_per_cam,
    int tiles_total,
    int *offsets,
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
