// Host-visible interface of the fused SSIM kernels (3DGS SSIM: 11x11 Gaussian window, sigma 1.5,
// zero padding, same-size output). Free of torch headers, like render/csrc/raster.h.
#pragma once

#include <cuda_runtime.h>

namespace gstrain {

constexpr int kSsimWindow = 11;
constexpr int kSsimRadius = kSsimWindow / 2;
constexpr float kSsimSigma = 1.5f;

// Normalised 1-D Gaussian taps, passed by value so they sit in the kernel's constant bank.
struct SsimTaps {
    float w[kSsimWindow];
};

// Images are [batch, height, width, channels] float32, contiguous (HWC, as the trainer has them).
// With `valid` ([2] int32 on the device: width, height; else nullptr) each image is that top-left
// part of the height x width canvas: the loss is the one of the cropped images (zero padding at
// the valid edge, the mean over valid pixels) and the gradient outside it is 0.
struct SsimDims {
    int batch;
    int height;
    int width;
    int channels;
    const int *valid;
};

// Number of per-block partial sums the forward writes (the length of `block_sums`).
int ssim_fwd_num_blocks(const SsimDims &d);

// Forward: SSIM map summed per block into `block_sums`, then reduced to the mean (out_ssim).
// With `l1_block_sums` (else nullptr, same length) also mean |img - gt| (out_l1) and the 3DGS
// loss (1 - lambda) L1 + lambda (1 - SSIM) (out_loss); each out_* is one float. With `partials` (else nullptr) also the
// per-pixel dSSIM/dmu1, dSSIM/dsigma1^2 and dSSIM/dsigma12, planar [batch, channels, 3, height,
// width], which the backward filters.
cudaError_t launch_ssim_fwd(
    const SsimDims &d,
    const SsimTaps &taps,
    const float *img,
    const float *gt,
    float *block_sums,
    float *l1_block_sums,
    double ssim_lambda,
    float *out_ssim,
    float *out_l1,
    float *out_loss,
    float *partials,
    cudaStream_t stream
);

// Backward: grad_img = grad_out[0] * (ssim_weight / N * (G*dm + 2 img G*ds + gt G*dc) +
// l1_weight / N * sign(img - gt)), G the same window, N the (valid) values (l1_weight 0 for SSIM
// alone). grad_out is a device pointer, so the upstream gradient is never read on the host.
cudaError_t launch_ssim_bwd(
    const SsimDims &d,
    const SsimTaps &taps,
    const float *img,
    const float *gt,
    const float *partials,
    const float *grad_out,
    double ssim_weight,
    double l1_weight,
    float *grad_img,
    cudaStream_t stream
);

} // namespace gstrain
