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
__global__ void adam_kernel(const AdamBatch batch) {
    if (batch.skip != nullptr && *batch.skip != 0) return;
    const int64_t block = blockIdx.x;
    int i = 0;
    while (i + 1 < batch.count && block >= batch.first_block[i + 1]) ++i; // at most 8 compares
    AdamTensor t = batch.tensors[i];
    if (batch.scalars != nullptr) {
        t.step_size = batch.scalars[2 * i];
        t.inv_sqrt_bc2 = batch.scalars[2 * i + 1];
    }
    const int64_t base = (block - batch.first_block[i]) * kAdamBlockElements;
    const float one_minus_b1 = 1.0f - batch.beta1;
    const float one_minus_b2 = 1.0f - batch.beta2;
#pragma unroll
    for (int k = 0; k < kAdamPerThread; ++k) {
        // consecutive threads take consecutive elements: coalesced loads in every pass
        const int64_t e = base + (int64_t)k * kAdamThreads + threadIdx.x;
        if (e >= t.numel) break;
        if (batch.visible != nullptr && !batch.visible[e / t.row]) continue;
        const float g = t.grad[e];
        float m = t.exp_avg[e];
        m = fmaf(one_minus_b1, g - m, m);
        const float v = fmaf(batch.beta2, t.exp_avg_sq[e], one_minus_b2 * g * g);
        t.exp_avg[e] = m;
        t.exp_avg_sq[e] = v;
        const float denom = sqrtf(v) * t.inv_sqrt_bc2 + batch.eps;
        t.param[e] -= t.step_size * (m / denom);
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
