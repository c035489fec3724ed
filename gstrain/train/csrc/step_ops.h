// Host-visible interface of the training-step kernels: one multi-tensor Adam launch, and the
// densification statistics gsplat's DefaultStrategy keeps, without a host sync. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gstrain {

// One launch updates up to this many tensors (a Gaussian model has six); more are chunked.
constexpr int kMaxAdamTensors = 8;

// One parameter tensor and its Adam state, contiguous, `numel` elements: parameter and gradient
// float32, the moments float32 or (bf16) bfloat16 bit patterns, stochastically rounded on store.
// `row` = elements per Gaussian (3 for means, 45 for shN), used only with a visibility mask.
struct AdamTensor {
    float *param;
    const float *grad;
    float *exp_avg;    // float32 moments (bf16 false)
    float *exp_avg_sq;
    uint16_t *exp_avg_bf16; // bfloat16 moments (bf16 true)
    uint16_t *exp_avg_sq_bf16;
    bool bf16;
    uint32_t salt_avg;    // the rounding hash's salt of each moment (gstrain/train/bf16_moments.py)
    uint32_t salt_avg_sq;
    float step;           // the Adam step count (1 first): the rounding hash's counter
    int64_t numel;
    int64_t row;
    float step_size;    // lr / (1 - beta1^step)
    float inv_sqrt_bc2; // 1 / sqrt(1 - beta2^step)
    bool vec4;          // all four arrays 16-byte aligned: the kernel moves float4s
    int index;          // the tensor's place in the whole list: its pair and count in the device scalars
    // added to the element index in the rounding hash: a slice of rows [a, b) of a tensor passes
    // a * row, so that stepping a tensor slice by slice stores the codes of one whole step
    int64_t hash_offset;
};

struct AdamBatch {
    AdamTensor tensors[kMaxAdamTensors];
    int64_t first_block[kMaxAdamTensors + 1]; // block range of tensor i: [first_block[i], first_block[i+1])
    int count;
    float beta1;
    float beta2;
    float eps;
    const bool *visible; // [N] or nullptr: when set, Gaussians off screen keep parameter and moments
    // CUDA-graph steps: per-tensor (step_size, inv_sqrt_bc2) pairs read on the device (tensor t's
    // at [2 t.index]) instead of the fields above, and a flag that, when non-zero, skips the step
    const float *scalars; // nullptr: use AdamTensor's fields
    // with `scalars` and bfloat16 moments: each tensor's step count on the device (at [t.index])
    // instead of AdamTensor::step
    const float *step_counts;
    const int *skip;      // nullptr: never skip
};

// Elements one block updates.
int64_t adam_block_elements();

cudaError_t launch_adam(const AdamBatch &batch, cudaStream_t stream);

// optim.moments=int8 (gstrain/train/int8_moments.py): one tensor of `rows` rows of `width` values
// whose moments are 8-bit codes with a bfloat16 scale per row: exp_avg int8 (m = code * scale),
// exp_avg_sq uint8 (sqrt(v) = code * scale). A warp updates a row: the row's new largest |m| and
// sqrt(v) set its new scales, then every code is stochastically rounded against them.
struct AdamRows8 {
    float *param;
    const float *grad;
    int8_t *exp_avg;
    uint8_t *exp_avg_sq;
    uint16_t *exp_avg_scale; // bfloat16 bits, [rows]
    uint16_t *exp_avg_sq_scale;
    int64_t rows;
    int64_t width;
    float beta1;
    float beta2;
    float eps;
    float step_size;    // lr / (1 - beta1^step)
    float inv_sqrt_bc2; // 1 / sqrt(1 - beta2^step)
    float step;         // the Adam step count (1 first): the rounding hash's counter
    uint32_t salt_avg;
    uint32_t salt_avg_sq;
    const float *scalars;     // nullptr, or this tensor's (step_size, inv_sqrt_bc2) on the device (graph steps)
    const float *step_count;  // nullptr, or this tensor's step count on the device (graph steps)
    const int *skip;          // nullptr: never skip
    int64_t hash_offset;      // added to the element index in the rounding hash (AdamTensor's)
};

cudaError_t launch_adam_rows8(const AdamRows8 &t, cudaStream_t stream);

// grad2d[i] += |(grad[i].x * scale_x, grad[i].y * scale_y)| and count[i] += 1 for every Gaussian
// whose radii are both > 0 (DefaultStrategy's running statistics for one camera). With `size`
// ([2] int32 on the device: the image's width and height), the scales multiply them.
cudaError_t launch_grad2d_stats(
    int64_t n,
    const float *grad,   // [n, 2]
    const int32_t *radii, // [n, 2]
    float scale_x,
    float scale_y,
    float *grad2d, // [n]
    float *count,  // [n]
    const int *skip, // nullptr, or a flag: non-zero leaves grad2d and count as they are
    const int *size, // nullptr, or [2]
    cudaStream_t stream
);

} // namespace gstrain
