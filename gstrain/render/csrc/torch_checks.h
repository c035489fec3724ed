// Argument checks shared by the extension's binding files.
#pragma once

#include <torch/extension.h>

namespace gstrain {

inline void check_tensor(const at::Tensor &t, const char *name, at::ScalarType dtype) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline void check_cuda(cudaError_t err, const char *what) {
    TORCH_CHECK(err == cudaSuccess, "gstrain: ", what, " failed: ", cudaGetErrorString(err));
}

} // namespace gstrain
