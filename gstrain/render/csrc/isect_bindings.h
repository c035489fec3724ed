// The culled tile intersection's PyTorch entry points (isect_bindings.cpp), registered by
// bindings.cpp. Argument meanings are documented at the definitions.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace gstrain {

std::vector<at::Tensor> isect_count(
    const at::Tensor &means2d,
    const at::Tensor &radii,
    const at::Tensor &conics,
    const at::Tensor &opacities,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const std::optional<at::Tensor> &valid
);

std::vector<at::Tensor> isect_fill(
    const at::Tensor &means2d,
    const at::Tensor &radii,
    const at::Tensor &depths,
    const at::Tensor &conics,
    const at::Tensor &opacities,
    const at::Tensor &cum,
    int64_t n_pairs,
    int64_t width,
    int64_t height,
    int64_t tile_size
);

std::vector<at::Tensor> isect_fill_capped(
    const at::Tensor &means2d,
    const at::Tensor &radii,
    const at::Tensor &depths,
    const at::Tensor &conics,
    const at::Tensor &opacities,
    const at::Tensor &cum,
    const at::Tensor &totals,
    int64_t capacity,
    const at::Tensor &tag,
    const at::Tensor &flag,
    const at::Tensor &pair_sum,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const std::optional<at::Tensor> &valid,
    const std::optional<at::Tensor> &slot
);

} // namespace gstrain
