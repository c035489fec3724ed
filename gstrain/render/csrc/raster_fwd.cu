// Forward: one block per 16x16 tile, one thread per pixel, Gaussians composited front to back.
// Saves the final transmittance and the last contributor's index for the backward.
#include "raster_common.cuh"

namespace gstrain {

template <int CH>
__global__ void __launch_bounds__(kMaxThreads) raster_fwd_kernel(
    const RasterArgs a,
    float *__restrict__ image,
    float *__restrict__ alpha_out,
    float *__restrict__ t_out,
    int *__restrict__ last_out
) {
    const TileCoord tc = tile_coord(a);
    const int bs = a.tile_size * a.tile_size;
    const int tr = threadIdx.y * a.tile_size + threadIdx.x;

    extern __shared__ float4 smem_fwd[];
    float4 *s_xyo = smem_fwd;
    float4 *s_abc = smem_fwd + bs;
    float *s_col = reinterpret_cast<float *>(smem_fwd + 2 * bs);

    const float px = (float)tc.x + 0.5f;
    const float py = (float)tc.y + 0.5f;
    float T = 1.f;
    int last = tc.range_start - 1; // "none" sits below the tile's range
    float acc[CH];
#pragma unroll
    for (int k = 0; k < CH; ++k) acc[k] = 0.f;
    bool done = !tc.inside;

    for (int b0 = tc.range_start; b0 < tc.range_end; b0 += bs) {
        // also the barrier that protects the previous batch's shared memory
        if (__syncthreads_count(done) == bs) break;
        const int idx = b0 + tr;
        if (idx < tc.range_end) {
            stage_splat<CH>(a, a.flatten_ids[idx], tr, s_xyo, s_abc, s_col);
        }
        __syncthreads();
        const int n = min(bs, tc.range_end - b0);
        for (int t = 0; t < n && !done; ++t) {
            SplatEval e;
            if (!eval_splat(s_xyo[t], s_abc[t], px, py, e)) continue;
            const float next_T = T * (1.f - e.alpha);
            if (next_T < kTransmittanceMin) { // this Gaussian is not composited
                done = true;
                break;
            }
            const float w = e.alpha * T;
#pragma unroll
            for (int k = 0; k < CH; ++k) acc[k] += s_col[t * CH + k] * w;
            T = next_T;
            last = b0 + t;
        }
    }

    if (!tc.inside) return;
    const float *bg = a.backgrounds ? a.backgrounds + tc.cam * CH : nullptr;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        image[(size_t)tc.pix * CH + k] = bg ? acc[k] + T * bg[k] : acc[k];
    }
    if (alpha_out) alpha_out[tc.pix] = 1.f - T;
    if (t_out) t_out[tc.pix] = T;
    if (last_out) last_out[tc.pix] = last;
}

template <int CH>
cudaError_t launch_raster_fwd(
    const RasterArgs &a, float *image, float *alpha, float *t_final, int *last_ids, cudaStream_t stream
) {
    if (a.width <= 0 || a.height <= 0 || a.n_cams <= 0) return cudaSuccess;
    const int bs = a.tile_size * a.tile_size;
    const size_t shmem = bs * stage_bytes_per_slot<CH>(false);
    if (shmem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(
            raster_fwd_kernel<CH>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shmem
        );
        if (err != cudaSuccess) return err;
    }
    const dim3 grid(a.tiles_x, a.tiles_y, a.n_cams);
    const dim3 block(a.tile_size, a.tile_size, 1);
    raster_fwd_kernel<CH><<<grid, block, shmem, stream>>>(a, image, alpha, t_final, last_ids);
    return cudaGetLastError();
}

#define GSTRAIN_INSTANTIATE_FWD(CH)                                                                \
    template cudaError_t launch_raster_fwd<CH>(                                                    \
        const RasterArgs &, float *, float *, float *, int *, cudaStream_t                         \
    );
GSTRAIN_FOR_EACH_CHANNELS(GSTRAIN_INSTANTIATE_FWD)
#undef GSTRAIN_INSTANTIATE_FWD

} // namespace gstrain
