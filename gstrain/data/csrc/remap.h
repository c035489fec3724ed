// Host-visible interface of the fused undistortion remap (data/undistort.py): one kernel that
// upsamples the coarse map at each pixel and samples the distorted uint8 image there. Torch-free,
// like train/csrc/bilateral.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace gstrain {

// The distorted image is [src_height, src_width, channels] uint8, contiguous (HWC); the coarse map
// [2, rows, cols] float32, contiguous: node (i, j)'s source point (x, y) in grid_sample's normalised
// units (align_corners=True). The output [height, width, channels] uint8 is, per pixel, the
// bilinear upsampling of the map (align_corners=True, F.interpolate's arithmetic) and the bilinear
// sample of image + 0.5 there (zero padding, F.grid_sample's arithmetic), truncated to uint8; with
// check_inside, black where the source point is not inside [-1, 1) on both axes.
struct RemapDims {
    int src_width;
    int src_height;
    int channels;
    int rows;
    int cols;
    int width;
    int height;
    float scale_y; // (rows - 1) / (height - 1), 0 for one row: F.interpolate's scale
    float scale_x;
    bool check_inside;
};

cudaError_t launch_remap(const RemapDims &d, const uint8_t *image, const float *coarse, uint8_t *out,
                         cudaStream_t stream);

} // namespace gstrain
