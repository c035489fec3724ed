// The per-Gaussian preprocessing's PyTorch entry points (project_bindings.cpp): the device-sized
// projection and the fused SH colours, registered by bindings.cpp. Argument meanings are
// documented at the definitions.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace gstrain {

std::vector<at::Tensor> project_fwd(
    const at::Tensor &means, const at::Tensor &quats, const at::Tensor &scales, const at::Tensor &viewmat,
    const at::Tensor &K, const at::Tensor &size, double eps2d, double near_plane, double far_plane, bool compensate
);

std::vector<at::Tensor> project_bwd(
    const at::Tensor &means, const at::Tensor &quats, const at::Tensor &scales, const at::Tensor &viewmat,
    const at::Tensor &K, const at::Tensor &size, double eps2d, const at::Tensor &radii, const at::Tensor &conics,
    const at::Tensor &v_means2d, const std::optional<at::Tensor> &v_depths, const at::Tensor &v_conics,
    const std::optional<at::Tensor> &compensations, const std::optional<at::Tensor> &v_compensations
);

std::vector<at::Tensor> sh_colors_fwd(
    const at::Tensor &means, const at::Tensor &sh0, const at::Tensor &shN, const at::Tensor &viewmat,
    const at::Tensor &radii, int64_t degree
);

std::vector<at::Tensor> sh_colors_bwd(
    const at::Tensor &means, const at::Tensor &sh0, const at::Tensor &shN, const at::Tensor &viewmat,
    const at::Tensor &radii, int64_t degree, const at::Tensor &v_colors
);

} // namespace gstrain
