// PyTorch bindings of the fused bilateral-grid slice-and-apply: checks, allocation, the launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "bilateral.h"
#include "torch_checks.h"

namespace gstrain {
namespace {

BilateralDims dims_of(const at::Tensor &image, const at::Tensor &grid, const std::optional<at::Tensor> &valid,
                      double luma_r, double luma_g, double luma_b) {
    const at::Device device = image.device();
    check_tensor_on(image, "image", device, at::kFloat);
    check_tensor_on(grid, "grid", device, at::kFloat);
    TORCH_CHECK(image.dim() == 3 && image.size(2) == 3, "image must be [H, W, 3]");
    TORCH_CHECK(grid.dim() == 4 && grid.size(0) == 12, "grid must be [12, L, Y, X]");
    TORCH_CHECK(grid.size(1) >= 1 && grid.size(2) >= 1 && grid.size(3) >= 1, "grid must have cells on every axis");
    TORCH_CHECK(grid.numel() < (int64_t)1 << 31 && image.size(0) < (int64_t)1 << 31 && image.size(1) < (int64_t)1 << 31,
                "bilateral grid or image too large");
    BilateralDims d{};
    d.height = (int)image.size(0);
    d.width = (int)image.size(1);
    d.levels = (int)grid.size(1);
    d.cells_y = (int)grid.size(2);
    d.cells_x = (int)grid.size(3);
    d.valid = valid_size(valid, device);
    d.luma_r = (float)luma_r;
    d.luma_g = (float)luma_g;
    d.luma_b = (float)luma_b;
    return d;
}

} // namespace

// out [H, W, 3]: each pixel's colour through the grid's trilinear blend at (x, y, luminance).
at::Tensor bilateral_fwd(const at::Tensor &image, const at::Tensor &grid, const std::optional<at::Tensor> &valid,
                         double luma_r, double luma_g, double luma_b) {
    const BilateralDims d = dims_of(image, grid, valid, luma_r, luma_g, luma_b);
    const c10::cuda::CUDAGuard guard(image.device());
    at::Tensor out = at::empty_like(image);
    check_cuda(launch_bilateral_fwd(d, image.data_ptr<float>(), grid.data_ptr<float>(), out.data_ptr<float>(),
                                    c10::cuda::getCurrentCUDAStream().stream()),
               "bilateral grid forward");
    return out;
}

// [grad_image [H, W, 3], grad_grid [12, L, Y, X]] for the upstream gradient grad_out [H, W, 3];
// variant: a BilateralBwdVariant (bilateral.h).
std::vector<at::Tensor> bilateral_bwd(const at::Tensor &image, const at::Tensor &grid,
                                      const std::optional<at::Tensor> &valid, const at::Tensor &grad_out,
                                      double luma_r, double luma_g, double luma_b, int64_t variant) {
    const BilateralDims d = dims_of(image, grid, valid, luma_r, luma_g, luma_b);
    check_tensor_on(grad_out, "grad_out", image.device(), at::kFloat);
    TORCH_CHECK(grad_out.sizes() == image.sizes(), "grad_out must have the image's shape");
    TORCH_CHECK(variant >= 0 && variant < kBilateralBwdVariants, "unknown bilateral backward variant ", variant);
    const c10::cuda::CUDAGuard guard(image.device());
    at::Tensor grad_image = at::empty_like(image);
    at::Tensor grad_grid = at::zeros_like(grid); // the kernel adds into it
    check_cuda(launch_bilateral_bwd(d, image.data_ptr<float>(), grid.data_ptr<float>(), grad_out.data_ptr<float>(),
                                    grad_image.data_ptr<float>(), grad_grid.data_ptr<float>(), (int)variant,
                                    c10::cuda::getCurrentCUDAStream().stream()),
               "bilateral grid backward");
    return {grad_image, grad_grid};
}

} // namespace gstrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("bilateral_fwd", &gstrain::bilateral_fwd, "bilateral grid slice-and-apply forward");
    m.def("bilateral_bwd", &gstrain::bilateral_bwd, "bilateral grid slice-and-apply backward (image, grid)");
}
