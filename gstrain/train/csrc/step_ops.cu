// Training-step kernels: multi-tensor Adam (one launch for the whole model) and DefaultStrategy's
// screen-gradient statistics (dense, so no nonzero() and no host sync).
#include "step_ops.h"

namespace gstrain {
namespace {

constexpr int kAdamThreads = 256;
constexpr int kAdamPerThread = 4;
constexpr int64_t kAdamBlockElements = (int64_t)kAdamThreads * kAdamPerThread;

// The same update as torch.optim.Adam (no weight decay, no amsgrad), element by element:
//   m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2;  p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)
__device__ __forceinline__ void adam_update(const float g, float &m, float &v, float &p, const float step_size,
                                            const float inv_sqrt_bc2, const AdamBatch &batch) {
    m = fmaf(1.0f - batch.beta1, g - m, m);
    v = fmaf(batch.beta2, v, (1.0f - batch.beta2) * g * g);
    const float denom = sqrtf(v) * inv_sqrt_bc2 + batch.eps;
    p -= step_size * (m / denom);
}

// optim.moments=bf16, the same bits as gstrain/train/bf16_moments.py (mix32, step_seed,
// rounding_noise, stochastic_round_bf16): the multipliers are odd and below 2^31 so that the
// Python side's int64 products keep these low 32 bits.
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x1B873593u;
    return x ^ (x >> 16);
}

__device__ __forceinline__ uint32_t step_seed(const uint32_t step, const uint32_t salt) { return mix32(salt ^ mix32(step)); }

// float32 -> bfloat16 bits: the upper 16 bits of (bits + 16 bits of noise hashed from the element
// index and the seed). NaN -> 0x7FC0; a finite value stops at the largest finite bfloat16.
__device__ __forceinline__ uint16_t round_bf16(const float x, const uint32_t seed, const int64_t e) {
    uint32_t h = mix32((uint32_t)e ^ seed);
    const uint32_t hi = (uint32_t)((uint64_t)e >> 32);
    if (hi != 0) h = mix32(h ^ hi);
    if (isnan(x)) return 0x7FC0u;
    uint32_t r = (__float_as_uint(x) + (h >> 16)) >> 16;
    if (isfinite(x) && (r & 0x7FFFu) == 0x7F80u) r = (r & 0x8000u) | 0x7F7Fu;
    return (uint16_t)r;
}

__device__ __forceinline__ float bf16_to_float(const uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// Adam with bfloat16 moments: float32 math with explicitly rounded operations (no contraction into
// fused multiply-adds), in bf16_moments.update_moments' order, so the moments before rounding are
// the CPU path's bits; the parameter update uses the unrounded moments.
__device__ __forceinline__ void adam_update_bf16(const AdamTensor &t, const int64_t e, const AdamBatch &batch,
                                                 const float step_size, const float inv_sqrt_bc2,
                                                 const uint32_t seed_avg, const uint32_t seed_avg_sq) {
    const float g = t.grad[e];
    const float m0 = bf16_to_float(t.exp_avg_bf16[e]);
    const float v0 = bf16_to_float(t.exp_avg_sq_bf16[e]);
    const float c1 = __fsub_rn(1.0f, batch.beta1);
    const float c2 = __fsub_rn(1.0f, batch.beta2);
    const float m = __fadd_rn(m0, __fmul_rn(__fsub_rn(g, m0), c1));
    const float v = __fadd_rn(__fmul_rn(v0, batch.beta2), __fmul_rn(__fmul_rn(g, g), c2));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(v), inv_sqrt_bc2), batch.eps);
    t.param[e] -= step_size * __fdiv_rn(m, denom);
    t.exp_avg_bf16[e] = round_bf16(m, seed_avg, e);
    t.exp_avg_sq_bf16[e] = round_bf16(v, seed_avg_sq, e);
}

// A thread updates four consecutive elements: with 16-byte aligned tensors (AdamTensor::vec4) as
// one float4 load and store per array, which keeps more bytes in flight than four scalar passes
// (the kernel is bound by its 28 bytes per element); the update per element is the same either way.
__global__ void adam_kernel(const AdamBatch batch) {
    if (batch.skip != nullptr && *batch.skip != 0) return;
    const int64_t block = blockIdx.x;
    int i = 0;
    while (i + 1 < batch.count && block >= batch.first_block[i + 1]) ++i; // at most 8 compares
    const AdamTensor &t = batch.tensors[i];
    const float step_size = batch.scalars != nullptr ? batch.scalars[2 * i] : t.step_size;
    const float inv_sqrt_bc2 = batch.scalars != nullptr ? batch.scalars[2 * i + 1] : t.inv_sqrt_bc2;
    const int64_t e0 = (block - batch.first_block[i]) * kAdamBlockElements + (int64_t)kAdamPerThread * threadIdx.x;
    if (e0 >= t.numel) return;
    bool drawn[kAdamPerThread];
#pragma unroll
    for (int k = 0; k < kAdamPerThread; ++k)
        drawn[k] = batch.visible == nullptr || (e0 + k < t.numel && batch.visible[(e0 + k) / t.row]);
    if (t.bf16) {
        // in a graph replay the count comes from the device: the argument is frozen at capture
        const float count = batch.step_counts != nullptr ? batch.step_counts[i] : t.step;
        const uint32_t step = (uint32_t)count;
        const uint32_t seed_avg = step_seed(step, t.salt_avg), seed_avg_sq = step_seed(step, t.salt_avg_sq);
#pragma unroll
        for (int k = 0; k < kAdamPerThread; ++k) {
            if (e0 + k >= t.numel) break;
            if (drawn[k]) adam_update_bf16(t, e0 + k, batch, step_size, inv_sqrt_bc2, seed_avg, seed_avg_sq);
        }
        return;
    }
    if (t.vec4 && e0 + kAdamPerThread <= t.numel) {
        const float4 g = *reinterpret_cast<const float4 *>(t.grad + e0);
        float4 m = *reinterpret_cast<const float4 *>(t.exp_avg + e0);
        float4 v = *reinterpret_cast<const float4 *>(t.exp_avg_sq + e0);
        float4 p = *reinterpret_cast<const float4 *>(t.param + e0);
        if (drawn[0]) adam_update(g.x, m.x, v.x, p.x, step_size, inv_sqrt_bc2, batch);
        if (drawn[1]) adam_update(g.y, m.y, v.y, p.y, step_size, inv_sqrt_bc2, batch);
        if (drawn[2]) adam_update(g.z, m.z, v.z, p.z, step_size, inv_sqrt_bc2, batch);
        if (drawn[3]) adam_update(g.w, m.w, v.w, p.w, step_size, inv_sqrt_bc2, batch);
        if (drawn[0] || drawn[1] || drawn[2] || drawn[3]) { // (hidden elements are stored back unchanged)
            *reinterpret_cast<float4 *>(t.exp_avg + e0) = m;
            *reinterpret_cast<float4 *>(t.exp_avg_sq + e0) = v;
            *reinterpret_cast<float4 *>(t.param + e0) = p;
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < kAdamPerThread; ++k) { // a tensor's tail, or unaligned storage
        const int64_t e = e0 + k;
        if (e >= t.numel) break;
        if (!drawn[k]) continue;
        float m = t.exp_avg[e], v = t.exp_avg_sq[e], p = t.param[e];
        adam_update(t.grad[e], m, v, p, step_size, inv_sqrt_bc2, batch);
        t.exp_avg[e] = m;
        t.exp_avg_sq[e] = v;
        t.param[e] = p;
    }
}

__global__ void grad2d_stats_kernel(
    const int64_t n,
    const float2 *__restrict__ grad,
    const int2 *__restrict__ radii,
    const float scale_x,
    const float scale_y,
    float *__restrict__ grad2d,
    float *__restrict__ count,
    const int *__restrict__ skip,
    const int *__restrict__ size
) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || (skip != nullptr && *skip != 0)) return;
    const int2 r = radii[i];
    if (r.x <= 0 || r.y <= 0) return;
    const float2 g = grad[i];
    // with the image size on the device, the scales are per-pixel factors of its width and height
    const float sx = size != nullptr ? scale_x * (float)size[0] : scale_x;
    const float sy = size != nullptr ? scale_y * (float)size[1] : scale_y;
    const float gx = g.x * sx;
    const float gy = g.y * sy;
    grad2d[i] += sqrtf(gx * gx + gy * gy);
    count[i] += 1.0f;
}

} // namespace

int64_t adam_block_elements() { return kAdamBlockElements; }

cudaError_t launch_adam(const AdamBatch &batch, cudaStream_t stream) {
    const int64_t blocks = batch.first_block[batch.count];
    if (blocks == 0) return cudaSuccess;
    adam_kernel<<<(unsigned)blocks, kAdamThreads, 0, stream>>>(batch);
    return cudaGetLastError();
}

cudaError_t launch_grad2d_stats(
    int64_t n,
    const float *grad,
    const int32_t *radii,
    float scale_x,
    float scale_y,
    float *grad2d,
    float *count,
    const int *skip,
    const int *size,
    cudaStream_t stream
) {
    if (n == 0) return cudaSuccess;
    constexpr int kThreads = 256;
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    grad2d_stats_kernel<<<(unsigned)blocks, kThreads, 0, stream>>>(
        n, reinterpret_cast<const float2 *>(grad), reinterpret_cast<const int2 *>(radii), scale_x, scale_y,
        grad2d, count, skip, size
    );
    return cudaGetLastError();
}

} // namespace gstrain
