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
    t.exp_avg_bf16[e] = round_bf16(m, seed_avg, e + t.hash_offset);
    t.exp_avg_sq_bf16[e] = round_bf16(v, seed_avg_sq, e + t.hash_offset);
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
    const float step_size = batch.scalars != nullptr ? batch.scalars[2 * t.index] : t.step_size;
    const float inv_sqrt_bc2 = batch.scalars != nullptr ? batch.scalars[2 * t.index + 1] : t.inv_sqrt_bc2;
    const int64_t e0 = (block - batch.first_block[i]) * kAdamBlockElements + (int64_t)kAdamPerThread * threadIdx.x;
    if (e0 >= t.numel) return;
    bool drawn[kAdamPerThread];
#pragma unroll
    for (int k = 0; k < kAdamPerThread; ++k)
        drawn[k] = batch.visible == nullptr || (e0 + k < t.numel && batch.visible[(e0 + k) / t.row]);
    if (t.bf16) {
        // in a graph replay the count comes from the device: the argument is frozen at capture
        const float count = batch.step_counts != nullptr ? batch.step_counts[t.index] : t.step;
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

// optim.moments=int8, the same codes as gstrain/train/int8_moments.py (scale_up_bf16,
// quantise_rows, step_tensor): explicitly rounded float32 operations in its order.
constexpr int kRows8Threads = 256;
constexpr int kWarp = 32;

// torch.amax's maximum: NaN wins
__device__ __forceinline__ float nan_max(const float a, const float b) { return (isnan(a) || a > b) ? a : b; }

// float32 x >= 0 -> the next bfloat16 at or above it; past the largest finite one (and infinity)
// the largest finite one; NaN the canonical NaN
__device__ __forceinline__ uint16_t scale_up_bf16(const float x) {
    if (isnan(x)) return 0x7FC0u;
    const uint32_t r = (__float_as_uint(x) + 0xFFFFu) >> 16;
    return r >= 0x7F80u ? (uint16_t)0x7F7Fu : (uint16_t)r;
}

// y = x / scale, u = 16 bits of the element's noise / 2^16: code = floor(y + u), or with `squares`
// lo + (u < (y^2 - lo^2) / (2 lo + 1)), lo = floor(y) (unbiased in y^2); in [-levels, levels]; NaN -> 0
__device__ __forceinline__ float code_of(const float x, const float scale, const float levels, const bool squares,
                                         const uint32_t seed, const int64_t e) {
    uint32_t h = mix32((uint32_t)e ^ seed);
    const uint32_t hi = (uint32_t)((uint64_t)e >> 32);
    if (hi != 0) h = mix32(h ^ hi);
    const float u = __fmul_rn((float)(h >> 16), 1.0f / 65536.0f);
    const float y = scale == 0.0f ? 0.0f : __fdiv_rn(x, scale);
    float q;
    if (squares) {
        const float lo = floorf(y);
        const float f = __fdiv_rn(__fsub_rn(__fmul_rn(y, y), __fmul_rn(lo, lo)), __fadd_rn(__fmul_rn(lo, 2.0f), 1.0f));
        q = __fadd_rn(lo, u < f ? 1.0f : 0.0f);
    } else {
        q = floorf(__fadd_rn(y, u));
    }
    if (isnan(q)) return 0.0f;
    return fminf(fmaxf(q, -levels), levels);
}

// m and v of element e from its decoded moments (int8_moments.step_tensor: update_moments' order)
__device__ __forceinline__ void rows8_moments(const AdamRows8 &t, const int64_t e, const float sm, const float sr,
                                              float &m, float &v) {
    const float g = t.grad[e];
    const float m0 = __fmul_rn((float)t.exp_avg[e], sm);
    const float r0 = __fmul_rn((float)t.exp_avg_sq[e], sr);
    const float v0 = __fmul_rn(r0, r0);
    const float c1 = __fsub_rn(1.0f, t.beta1);
    const float c2 = __fsub_rn(1.0f, t.beta2);
    m = __fadd_rn(m0, __fmul_rn(__fsub_rn(g, m0), c1));
    v = __fadd_rn(__fmul_rn(v0, t.beta2), __fmul_rn(__fmul_rn(g, g), c2));
}

// A warp per row: pass one computes the row's new moments for their largest magnitudes (the new
// scales), pass two computes them again (the same bits), updates the parameter with the guarded
// denominator max(sqrt(v) / sqrt(bc2) + eps, |m|) and stores the codes; each lane reads and writes
// only its own elements, and the old scales are read before lane 0 stores the new ones.
__global__ void adam_rows8_kernel(const AdamRows8 t) {
    if (t.skip != nullptr && *t.skip != 0) return;
    const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
    const int lane = threadIdx.x % kWarp;
    if (row >= t.rows) return; // (the whole warp: its lanes share the row)
    const float step_size = t.scalars != nullptr ? t.scalars[0] : t.step_size;
    const float inv_sqrt_bc2 = t.scalars != nullptr ? t.scalars[1] : t.inv_sqrt_bc2;
    // in a graph replay the count comes from the device: the argument is frozen at capture
    const uint32_t step = (uint32_t)(t.step_count != nullptr ? *t.step_count : t.step);
    const uint32_t seed_avg = step_seed(step, t.salt_avg), seed_avg_sq = step_seed(step, t.salt_avg_sq);
    const float sm = bf16_to_float(t.exp_avg_scale[row]);
    const float sr = bf16_to_float(t.exp_avg_sq_scale[row]);
    const int64_t first = row * t.width;
    float m_max = 0.0f, r_max = 0.0f;
    for (int64_t j = lane; j < t.width; j += kWarp) {
        float m, v;
        rows8_moments(t, first + j, sm, sr, m, v);
        m_max = nan_max(m_max, fabsf(m));
        r_max = nan_max(r_max, __fsqrt_rn(v));
    }
    for (int offset = kWarp / 2; offset > 0; offset /= 2) {
        m_max = nan_max(m_max, __shfl_xor_sync(0xFFFFFFFFu, m_max, offset));
        r_max = nan_max(r_max, __shfl_xor_sync(0xFFFFFFFFu, r_max, offset));
    }
    const uint16_t new_sm = scale_up_bf16(__fdiv_rn(m_max, 127.0f));
    const uint16_t new_sr = scale_up_bf16(__fdiv_rn(r_max, 255.0f));
    const float sm1 = bf16_to_float(new_sm), sr1 = bf16_to_float(new_sr);
    for (int64_t j = lane; j < t.width; j += kWarp) {
        const int64_t e = first + j;
        float m, v;
        rows8_moments(t, e, sm, sr, m, v);
        const float r = __fsqrt_rn(v);
        const float denom = nan_max(__fadd_rn(__fmul_rn(r, inv_sqrt_bc2), t.eps), fabsf(m)); // torch.maximum
        t.param[e] -= step_size * __fdiv_rn(m, denom);
        t.exp_avg[e] = (int8_t)code_of(m, sm1, 127.0f, false, seed_avg, e + t.hash_offset);
        t.exp_avg_sq[e] = (uint8_t)code_of(r, sr1, 255.0f, true, seed_avg_sq, e + t.hash_offset);
    }
    __syncwarp();
    if (lane == 0) {
        t.exp_avg_scale[row] = new_sm;
        t.exp_avg_sq_scale[row] = new_sr;
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

cudaError_t launch_adam_rows8(const AdamRows8 &t, cudaStream_t stream) {
    if (t.rows == 0) return cudaSuccess;
    const int64_t blocks = (t.rows * kWarp + kRows8Threads - 1) / kRows8Threads;
    adam_rows8_kernel<<<(unsigned)blocks, kRows8Threads, 0, stream>>>(t);
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
