// Host-visible interface of the fused SH colour kernels (sh_colors.cu). Torch-free, like
// project.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace gstrain {

// N Gaussians seen by one camera; every pointer is float32 / int32 on the device, contiguous.
struct ShColorArgs {
    int64_t n;
    int degree;           // active SH degree, 0..3
    int rest;             // coefficients per Gaussian in shN (bases - 1, at least degree's)
    const float *means;   // [N, 3]
    const float *sh0;     // [N, 1, 3]
    const float *shN;     // [N, rest, 3]
    const float *viewmat; // [4, 4] world-to-camera, row-major
    const int *radii;     // [N, 2]: a Gaussian is visible when both are > 0
};

// The backward's gradients in (v_colors) and out (written for every Gaussian: zeros where
// invisible, and for shN's coefficients above the degree).
struct ShColorGrads {
    const float *v_colors; // [N, 3]
    float *v_means;        // [N, 3]
    float *v_sh0;          // [N, 1, 3]
    float *v_shN;          // [N, rest, 3]
};

// The most shN coefficients per Gaussian the backward takes (it stages at least a warp's rows,
// 32 * 3 * rest floats, in 48 KiB of shared memory).
constexpr int kShBwdMaxRest = 128;

cudaError_t launch_sh_colors_fwd(const ShColorArgs &a, float *colors, cudaStream_t stream);
cudaError_t launch_sh_colors_bwd(const ShColorArgs &a, const ShColorGrads &g, cudaStream_t stream);

} // namespace gstrain
