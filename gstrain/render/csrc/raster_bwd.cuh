// Backward: each pixel walks its tile's Gaussians back to front, undoing the compositing.
// All lanes of a warp see the same Gaussian at the same time, so their gradient adds collide;
// `threshold` picks per (warp, Gaussian) how they reach memory:
//   lanes contributing >= threshold: butterfly-reduce in registers, lane 0 adds once (SM side);
//   otherwise: each contributing lane adds its own values (L2 side).
// atomic = kThresholdNever, warp = 1, distwar = T, arc = T from the run-time tuner.
#pragma once

#include "raster_common.cuh"

namespace gstrain {

constexpr unsigned kFullMask = 0xffffffffu;

// Per-lane gradient slots: [0, CH) colour, then conic a, b, c, opacity, mean x, y, |x|, |y|.
// The order puts the last 8 in the vector layout's two float4s.
template <int CH> struct Slots {
    static constexpr int kConic = CH;
    static constexpr int kOpacity = CH + 3;
    static constexpr int kMean = CH + 4;
    static constexpr int kAbs = CH + 6;
    static constexpr int kCount = CH + 8;
};

template <int CH>
__device__ __forceinline__ void warp_sum(float (&v)[Slots<CH>::kCount], const bool absgrad) {
#pragma unroll
    for (int i = 0; i < Slots<CH>::kCount; ++i) {
        if (i >= Slots<CH>::kAbs && !absgrad) continue; // warp-uniform
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v[i] += __shfl_xor_sync(kFullMask, v[i], off);
    }
}

// Reduce-scatter of the slots (padded to 16) over the warp: at each butterfly level a lane keeps
// half of its slots and sends the other half to its partner, so after four levels plus one add,
// even lane L holds the warp's sum of slot L / 2. 16 shuffles in all, where warp_sum spends 5
// per slot (45 at 3 channels); the slots then go out as one atomic instruction across lanes.
template <int CH>
__device__ __forceinline__ float warp_sum_scatter(const float (&v)[Slots<CH>::kCount], const int lane) {
    constexpr int n = Slots<CH>::kCount;
    static_assert(n <= 16, "the scatter reduction holds at most 16 slots");
    float r[8];
    const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4, b1 = lane & 2;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float lo = i < n ? v[i] : 0.f;
        const float hi = i + 8 < n ? v[i + 8] : 0.f;
        r[i] = (b4 ? hi : lo) + __shfl_xor_sync(kFullMask, b4 ? lo : hi, 16);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = (b3 ? r[i + 4] : r[i]) + __shfl_xor_sync(kFullMask, b3 ? r[i] : r[i + 4], 8);
#pragma unroll
    for (int i = 0; i < 2; ++i) r[i] = (b2 ? r[i + 2] : r[i]) + __shfl_xor_sync(kFullMask, b2 ? r[i] : r[i + 2], 4);
    r[0] = (b1 ? r[1] : r[0]) + __shfl_xor_sync(kFullMask, b1 ? r[0] : r[1], 2);
    return r[0] + __shfl_xor_sync(kFullMask, r[0], 1);
}

// One slot's warp sum into its place in either layout (the scatter reduction's flush).
template <int CH, bool VEC>
__device__ __forceinline__ void flush_slot(const GradPtrs &o, const int g, const int slot, const float value) {
    using S = Slots<CH>;
    float *dst;
    if (slot < CH) {
        dst = o.colors + (size_t)g * o.cstride + slot;
    } else if constexpr (VEC) {
        dst = o.geo + (size_t)g * 8 + (slot - CH); // geo's order is the slots' order
    } else if (slot < S::kOpacity) {
        dst = o.conics + 3 * (size_t)g + (slot - S::kConic);
    } else if (slot == S::kOpacity) {
        dst = o.opacities + g;
    } else if (slot < S::kAbs) {
        dst = o.means2d + 2 * (size_t)g + (slot - S::kMean);
    } else {
        dst = o.absgrad + 2 * (size_t)g + (slot - S::kAbs);
    }
    atomicAdd(dst, value);
}

// Scalar layout: one atomicAdd per float into the final tensors.
template <int CH>
__device__ __forceinline__ void flush_scalar(
    const GradPtrs &o, const int g, const float (&v)[Slots<CH>::kCount], const bool absgrad
) {
    using S = Slots<CH>;
    float *col = o.colors + (size_t)g * o.cstride;
#pragma unroll
    for (int k = 0; k < CH; ++k) atomicAdd(col + k, v[k]);
    atomicAdd(o.conics + 3 * g, v[S::kConic]);
    atomicAdd(o.conics + 3 * g + 1, v[S::kConic + 1]);
    atomicAdd(o.conics + 3 * g + 2, v[S::kConic + 2]);
    atomicAdd(o.opacities + g, v[S::kOpacity]);
    atomicAdd(o.means2d + 2 * g, v[S::kMean]);
    atomicAdd(o.means2d + 2 * g + 1, v[S::kMean + 1]);
    if (absgrad) {
        atomicAdd(o.absgrad + 2 * g, v[S::kAbs]);
        atomicAdd(o.absgrad + 2 * g + 1, v[S::kAbs + 1]);
    }
}

// Vector layout: sm_90 float2/float4 atomics, one instruction per 16 bytes instead of per float.
template <int CH>
__device__ __forceinline__ void flush_vector(
    const GradPtrs &o, const int g, const float (&v)[Slots<CH>::kCount], const bool absgrad
) {
    using S = Slots<CH>;
    float *col = o.colors + (size_t)g * o.cstride;
    float *geo = o.geo + (size_t)g * 8;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CH % 4 == 0) {
#pragma unroll
        for (int q = 0; q < CH / 4; ++q) {
            atomicAdd(
                reinterpret_cast<float4 *>(col) + q,
                make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3])
            );
        }
    } else if constexpr (CH == 3) {
        atomicAdd(reinterpret_cast<float4 *>(col), make_float4(v[0], v[1], v[2], 0.f));
    } else if constexpr (CH == 2) {
        atomicAdd(reinterpret_cast<float2 *>(col), make_float2(v[0], v[1]));
    } else {
        atomicAdd(col, v[0]);
    }
    float4 *geo4 = reinterpret_cast<float4 *>(geo);
    atomicAdd(geo4, make_float4(v[S::kConic], v[S::kConic + 1], v[S::kConic + 2], v[S::kOpacity]));
    if (absgrad) {
        atomicAdd(geo4 + 1, make_float4(v[S::kMean], v[S::kMean + 1], v[S::kAbs], v[S::kAbs + 1]));
    } else {
        atomicAdd(reinterpret_cast<float2 *>(geo4 + 1), make_float2(v[S::kMean], v[S::kMean + 1]));
    }
#else
    // no vector atomics before sm_90: same layout, scalar instructions
#pragma unroll
    for (int k = 0; k < CH; ++k) atomicAdd(col + k, v[k]);
#pragma unroll
    for (int i = 0; i < (absgrad ? 8 : 6); ++i) atomicAdd(geo + i, v[S::kConic + i]);
#endif
}

template <int CH, bool VEC>
__device__ __forceinline__ void flush_grads(
    const GradPtrs &o, const int g, const float (&v)[Slots<CH>::kCount], const bool absgrad
) {
    if constexpr (VEC) {
        flush_vector<CH>(o, g, v, absgrad);
    } else {
        flush_scalar<CH>(o, g, v, absgrad);
    }
}

__device__ __forceinline__ int warp_max(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return __reduce_max_sync(kFullMask, v);
#else
    for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, off));
    return v;
#endif
}

template <int CH, bool VEC>
__global__ void __launch_bounds__(kMaxThreads) raster_bwd_kernel(
    const RasterArgs a,
    const float *__restrict__ t_final,
    const int *__restrict__ last_ids,
    const float *__restrict__ v_image,
    const float *__restrict__ v_alpha,
    const GradPtrs o,
    const bool absgrad,
    const int threshold,
    const bool scatter
) {
    using S = Slots<CH>;
    [[maybe_unused]] const int n_slots = absgrad ? S::kCount : S::kAbs;
    const TileCoord tc = tile_coord(a);
    const int bs = a.tile_size * a.tile_size;
    const int tr = threadIdx.y * a.tile_size + threadIdx.x;
    const int lane = tr & 31;

    // Skip the tail of the tile's list that no pixel of this block (warp) reached.
    const int last = tc.inside ? last_ids[tc.pix] : tc.range_start - 1;
    const int warp_last = warp_max(last);
    __shared__ int s_block_last;
    if (tr == 0) s_block_last = tc.range_start - 1;
    __syncthreads();
    if (lane == 0) atomicMax(&s_block_last, warp_last);
    __syncthreads();
    const int range_end = min(tc.range_end, s_block_last + 1);
    if (range_end <= tc.range_start) return; // uniform over the block

    extern __shared__ float4 smem_bwd[];
    float4 *s_xyo = smem_bwd;
    float4 *s_abc = smem_bwd + bs;
    float *s_col = reinterpret_cast<float *>(smem_bwd + 2 * bs);
    int *s_id = reinterpret_cast<int *>(s_col + bs * CH);

    const float px = (float)tc.x + 0.5f;
    const float py = (float)tc.y + 0.5f;
    const float T_fin = tc.inside ? t_final[tc.pix] : 1.f;
    float T = T_fin;
    float v_img[CH], behind[CH]; // dL/dimage; colour composited behind the current Gaussian
    float bg_dot = 0.f;
    const float *bg = a.backgrounds ? a.backgrounds + tc.cam * CH : nullptr;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
        v_img[k] = tc.inside ? v_image[(size_t)tc.pix * CH + k] : 0.f;
        behind[k] = 0.f;
        if (bg) bg_dot += bg[k] * v_img[k];
    }
    // alpha = 1 - T_fin and the background term both scale with T_fin / (1 - alpha_i)
    const float v_tfin = ((tc.inside && v_alpha) ? v_alpha[tc.pix] : 0.f) - bg_dot;

    for (int batch_end = range_end - 1; batch_end >= tc.range_start; batch_end -= bs) {
        __syncthreads(); // the previous batch is done with shared memory
        const int idx = batch_end - tr;
        if (idx >= tc.range_start) {
            const int g = a.flatten_ids[idx];
            s_id[tr] = g;
            stage_splat<CH>(a, g, tr, s_xyo, s_abc, s_col);
        }
        __syncthreads();
        const int n = min(bs, batch_end + 1 - tc.range_start);
        for (int t = max(0, batch_end - warp_last); t < n; ++t) {
            SplatEval e;
            const float4 xyo = s_xyo[t];
            const float4 abc = s_abc[t];
            bool valid = tc.inside && batch_end - t <= last;
            if (valid) valid = eval_splat(xyo, abc, px, py, e);
            const unsigned ballot = __ballot_sync(kFullMask, valid);
            if (ballot == 0) continue;

            float v[S::kCount];
#pragma unroll
            for (int i = 0; i < S::kCount; ++i) v[i] = 0.f;
            if (valid) {
                const float ra = __fdividef(1.f, 1.f - e.alpha);
                T *= ra; // transmittance in front of this Gaussian
                const float w = e.alpha * T;
                float v_a = T_fin * ra * v_tfin;
#pragma unroll
                for (int k = 0; k < CH; ++k) {
                    const float c = s_col[t * CH + k];
                    v[k] = w * v_img[k];
                    v_a += (c * T - behind[k] * ra) * v_img[k];
                    behind[k] += c * w;
                }
                if (xyo.z * e.vis <= kAlphaMax) { // the clamp passes no gradient
                    const float v_sigma = -xyo.z * e.vis * v_a;
                    v[S::kConic] = 0.5f * v_sigma * e.dx * e.dx;
                    v[S::kConic + 1] = v_sigma * e.dx * e.dy;
                    v[S::kConic + 2] = 0.5f * v_sigma * e.dy * e.dy;
                    v[S::kOpacity] = e.vis * v_a;
                    v[S::kMean] = v_sigma * (abc.x * e.dx + abc.y * e.dy);
                    v[S::kMean + 1] = v_sigma * (abc.y * e.dx + abc.z * e.dy);
                    v[S::kAbs] = fabsf(v[S::kMean]);
                    v[S::kAbs + 1] = fabsf(v[S::kMean + 1]);
                }
            }
            const int g = s_id[t];
            if (__popc(ballot) >= threshold) {
                bool done = false;
                if constexpr (S::kCount <= 16) {
                    if (scatter) { // warp-uniform
                        const float sum = warp_sum_scatter<CH>(v, lane);
                        if (!(lane & 1) && (lane >> 1) < n_slots) flush_slot<CH, VEC>(o, g, lane >> 1, sum);
                        done = true;
                    }
                }
                if (!done) {
                    warp_sum<CH>(v, absgrad);
                    if (lane == 0) flush_grads<CH, VEC>(o, g, v, absgrad);
                }
            } else if (valid) {
                flush_grads<CH, VEC>(o, g, v, absgrad);
            }
        }
    }
}

template <int CH, bool VEC>
cudaError_t launch_raster_bwd(
    const RasterArgs &a,
    const float *t_final,
    const int *last_ids,
    const float *v_image,
    const float *v_alpha,
    const GradPtrs &grads,
    bool absgrad,
    int threshold,
    bool scatter,
    cudaStream_t stream
) {
    if (a.n_isects <= 0 || a.width <= 0 || a.height <= 0 || a.n_cams <= 0) return cudaSuccess;
    const int bs = a.tile_size * a.tile_size;
    const size_t shmem = bs * stage_bytes_per_slot<CH>(true);
    if (shmem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(
            raster_bwd_kernel<CH, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shmem
        );
        if (err != cudaSuccess) return err;
    }
    const dim3 grid(a.tiles_x, a.tiles_y, a.n_cams);
    const dim3 block(a.tile_size, a.tile_size, 1);
    raster_bwd_kernel<CH, VEC><<<grid, block, shmem, stream>>>(
        a, t_final, last_ids, v_image, v_alpha, grads, absgrad, threshold, scatter
    );
    return cudaGetLastError();
}

} // namespace gstrain
