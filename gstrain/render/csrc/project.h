// Host-visible interface of the device-sized EWA projection (project.cu). Torch-free, like
// raster.h and isect.h.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace gstrain {

// One camera, N Gaussians; every pointer is float32 / int32 on the device, contiguous.
struct ProjectArgs {
    int64_t n;
    const float *means;   // [N, 3]
    const float *quats;   // [N, 4] (w, x, y, z), unnormalised
    const float *scales;  // [N, 3] linear
    const float *viewmat; // [4, 4] world-to-camera, row-major
    const float *K;       // [3, 3]
    const int *size;      // [2]: the image's width and height, read by the kernels
    float eps2d;
    float near_plane;
    float far_plane;
};

// Outputs as gsplat's fully_fused_projection (packed=False) gives them for one camera. Culled
// Gaussians get radii 0; their other outputs are not written (the caller zero-fills them).
struct ProjectOut {
    int *radii;     // [N, 2]
    float *means2d; // [N, 2]
    float *depths;  // [N]
    float *conics;  // [N, 3]
    // [N] sqrt(max(0, det(cov2d) / det(cov2d + eps2d I))), gsplat's antialiased mode (its
    // calc_compensations); nullptr: not asked for
    float *compensations;
};

// The backward's inputs (the forward's radii and conics, the outputs' gradients; v_depths may be
// nullptr) and outputs (written for Gaussians with radii > 0; the caller zero-fills them).
struct ProjectGrads {
    const int *radii;
    const float *conics;
    const float *v_means2d;
    const float *v_depths;
    const float *v_conics;
    // the forward's compensations and their gradient; both nullptr when the forward made none
    const float *compensations;
    const float *v_compensations;
    float *v_means;  // [N, 3]
    float *v_quats;  // [N, 4]
    float *v_scales; // [N, 3]
};

cudaError_t launch_project_fwd(const ProjectArgs &a, const ProjectOut &out, cudaStream_t stream);
cudaError_t launch_project_bwd(const ProjectArgs &a, const ProjectGrads &g, cudaStream_t stream);

} // namespace gstrain
