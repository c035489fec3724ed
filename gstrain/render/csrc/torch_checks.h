// Argument checks shared by every extension's binding files (the train extensions list this
// header among theirs: gstrain/extensions.py).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace gstrain {

inline void check_tensor(const at::Tensor &t, const char *name, at::ScalarType dtype) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// As check_tensor, and on `device` (the other arguments' device).
inline void check_tensor_on(const at::Tensor &t, const char *name, const at::Device &device, at::ScalarType dtype) {
    TORCH_CHECK(t.is_cuda() && t.device() == device, name, " must be on ", device);
    TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// An optional [2] int32 tensor on `device`: a view's valid width and height inside its canvas;
// nullptr when it is not given.
inline const int *valid_size(const std::optional<at::Tensor> &valid, const at::Device &device) {
    if (!valid.has_value() || !valid->defined()) return nullptr;
    TORCH_CHECK(valid->is_cuda() && valid->device() == device && valid->scalar_type() == at::kInt &&
                    valid->is_contiguous() && valid->numel() == 2,
                "valid must be [width, height], int32 on the images' device");
    return valid->data_ptr<int>();
}

inline void check_cuda(cudaError_t err, const char *what) {
    TORCH_CHECK(err == cudaSuccess, "gstrain: ", what, " failed: ", cudaGetErrorString(err));
}

} // namespace gstrain
