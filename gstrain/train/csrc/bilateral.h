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

// grad_image [height, width, 3] (written, through the transform and through the guide) and
// grad_grid [12, levels, cells_y, cells_x] (added to: the caller zeroes it) for upstream grad_out.
cudaError_t launch_bilateral_bwd(const BilateralDims &d, const float *image, const float *grid, const float *grad_out,
                                 float *grad_image, float *grad_grid, cudaStream_t stream);

} // namespace gstrain
