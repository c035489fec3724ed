// Host-visible interface of the fused bilateral-grid slice-and-apply (train.appearance=bilateral):
// out = A(x, y, g) @ rgb + b(x, y, g) per pixel, the 3x4 [A | b] the trilinear blend of a grid of
// them. Torch-free, like step_ops.h.
#pragma once

#include <cuda_runtime.h>

namespace gstrain {

// The image is [height, width, 3] float32, contiguous (HWC); the grid [12, levels, cells_y,
// cells_x] float32, contiguous, channel 4 * r + c holding entry (r, c) of [A | b]. With `valid`
// ([2] int32 on the device: width, height; else nullptr) the image is a canvas whose top-left part
// is the view: positions are the view's, and pixels past it sit at the grid's last cells (clamped).
// The guide is clamp(luma_r R + luma_g G + luma_b B, 0, 1) (the caller owns the weights).
struct BilateralDims {
    int height;
    int width;
    int levels;
    int cells_y;
    int cells_x;
    const int *valid;
    float luma_r;
    float luma_g;
    float luma_b;
};

// out [height, width, 3] = each pixel's blended transform applied to its colour.
cudaError_t launch_bilateral_fwd(const BilateralDims &d, const float *image, const float *grid, float *out,
                                 cudaStream_t stream);

// How the backward sums a block's pixels into the grid's gradient (the same sums, up to float
// rounding; kept side by side so one benchmark times them):
enum BilateralBwdVariant {
    kBilateralBwdShared = 0,   // shared-memory atomics per pixel; a warp all in one cell sums by shuffles
    kBilateralBwdWarpRuns = 1, // lanes in runs of one cell sum by segmented shuffles; one atomic a run
    kBilateralBwdRowRuns = 2,  // as 1, the row's common y weight factored out: half the shuffles
    kBilateralBwdVariants = 3,
};

// grad_image [height, width, 3] (written, through the transform and through the guide) and
// grad_grid [12, levels, cells_y, cells_x] (added to: the caller zeroes it) for upstream grad_out;
// variant: a BilateralBwdVariant (cudaErrorInvalidValue otherwise).
cudaError_t launch_bilateral_bwd(const BilateralDims &d, const float *image, const float *grid, const float *grad_out,
                                 float *grad_image, float *grad_grid, int variant, cudaStream_t stream);

} // namespace gstrain
