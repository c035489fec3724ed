// The fused undistortion remap (remap.h). It computes what data/undistort.py's torch path does
// with F.interpolate, the inside test and F.grid_sample, written as those kernels write it so the
// float results agree (tests/test_remap_cuda.py), with no full-resolution map in memory: a pixel
// reads four coarse nodes (cached: neighbours share them) and four source pixels.
#include "remap.h"

namespace gstrain {
namespace {

constexpr int kTileX = 32;
constexpr int kTileY = 8;

__global__ void remap_kernel(const RemapDims d, const uint8_t *__restrict__ image, const float *__restrict__ coarse,
                             uint8_t *__restrict__ out) {
    const int x = blockIdx.x * kTileX + threadIdx.x;
    const int y = blockIdx.y * kTileY + threadIdx.y;
    if (x >= d.width || y >= d.height) return;

    // the map at (x, y): F.interpolate(mode="bilinear", align_corners=True)
    const float h1r = d.scale_y * y;
    const int h1 = (int)h1r;
    const int h1p = (h1 < d.rows - 1) ? 1 : 0;
    const float h1lambda = h1r - h1;
    const float h0lambda = 1.0f - h1lambda;
    const float w1r = d.scale_x * x;
    const int w1 = (int)w1r;
    const int w1p = (w1 < d.cols - 1) ? 1 : 0;
    const float w1lambda = w1r - w1;
    const float w0lambda = 1.0f - w1lambda;
    float g[2];
    for (int k = 0; k < 2; ++k) {
        const float *plane = coarse + (size_t)k * d.rows * d.cols;
        const float *top = plane + (size_t)h1 * d.cols + w1;
        const float *bottom = plane + (size_t)(h1 + h1p) * d.cols + w1;
        g[k] = h0lambda * (w0lambda * top[0] + w1lambda * top[w1p]) +
               h1lambda * (w0lambda * bottom[0] + w1lambda * bottom[w1p]);
    }
    uint8_t *pixel = out + ((size_t)y * d.width + x) * d.channels;
    if (d.check_inside && !(g[0] >= -1.0f && g[0] < 1.0f && g[1] >= -1.0f && g[1] < 1.0f)) {
        for (int c = 0; c < d.channels; ++c) pixel[c] = 0; // COLMAP blacks it out
        return;
    }

    // F.grid_sample(mode="bilinear", padding_mode="zeros", align_corners=True) of image + 0.5
    const float ix = ((g[0] + 1.f) / 2) * (d.src_width - 1);
    const float iy = ((g[1] + 1.f) / 2) * (d.src_height - 1);
    const int ix_nw = (int)floorf(ix);
    const int iy_nw = (int)floorf(iy);
    const int ix_ne = ix_nw + 1, iy_ne = iy_nw;
    const int ix_sw = ix_nw, iy_sw = iy_nw + 1;
    const int ix_se = ix_nw + 1, iy_se = iy_nw + 1;
    const float nw = (ix_se - ix) * (iy_se - iy);
    const float ne = (ix - ix_sw) * (iy_sw - iy);
    const float sw = (ix_ne - ix) * (iy - iy_ne);
    const float se = (ix - ix_nw) * (iy - iy_nw);
    const bool in_nw = ix_nw >= 0 && ix_nw < d.src_width && iy_nw >= 0 && iy_nw < d.src_height;
    const bool in_ne = ix_ne >= 0 && ix_ne < d.src_width && iy_ne >= 0 && iy_ne < d.src_height;
    const bool in_sw = ix_sw >= 0 && ix_sw < d.src_width && iy_sw >= 0 && iy_sw < d.src_height;
    const bool in_se = ix_se >= 0 && ix_se < d.src_width && iy_se >= 0 && iy_se < d.src_height;
    const size_t row = (size_t)d.src_width * d.channels;
    for (int c = 0; c < d.channels; ++c) {
        float acc = 0;
        if (in_nw) acc += ((float)image[iy_nw * row + (size_t)ix_nw * d.channels + c] + 0.5f) * nw;
        if (in_ne) acc += ((float)image[iy_ne * row + (size_t)ix_ne * d.channels + c] + 0.5f) * ne;
        if (in_sw) acc += ((float)image[iy_sw * row + (size_t)ix_sw * d.channels + c] + 0.5f) * sw;
        if (in_se) acc += ((float)image[iy_se * row + (size_t)ix_se * d.channels + c] + 0.5f) * se;
        pixel[c] = (uint8_t)acc; // truncation of value + 0.5: rounded half up, as COLMAP does
    }
}

} // namespace

cudaError_t launch_remap(const RemapDims &d, const uint8_t *image, const float *coarse, uint8_t *out,
                         cudaStream_t stream) {
    if (d.width <= 0 || d.height <= 0) return cudaSuccess;
    const dim3 blocks((d.width + kTileX - 1) / kTileX, (d.height + kTileY - 1) / kTileY);
    remap_kernel<<<blocks, dim3(kTileX, kTileY), 0, stream>>>(d, image, coarse, out);
    return cudaGetLastError();
}

} // namespace gstrain
