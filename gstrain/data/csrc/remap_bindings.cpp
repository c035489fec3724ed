// PyTorch binding of the fused undistortion remap: checks, allocation, the launch.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "remap.h"
#include "torch_checks.h"

namespace gstrain {

// [height, width, C] uint8: the distorted [h, w, C] uint8 image resampled through the coarse map
// [1, 2, rows, cols] float32 (data/undistort.py's UndistortMap.grid, on the image's device).
at::Tensor remap_uint8(const at::Tensor &image, const at::Tensor &coarse, int64_t width, int64_t height,
                       bool check_inside) {
    const at::Device device = image.device();
    check_tensor_on(image, "image", device, at::kByte);
    check_tensor_on(coarse, "coarse", device, at::kFloat);
    TORCH_CHECK(image.dim() == 3 && image.size(2) >= 1, "image must be [h, w, C]");
    TORCH_CHECK(coarse.dim() == 4 && coarse.size(0) == 1 && coarse.size(1) == 2 && coarse.size(2) >= 1 &&
                    coarse.size(3) >= 1,
                "coarse must be [1, 2, rows, cols]");
    TORCH_CHECK(width >= 1 && height >= 1, "the output must have at least one pixel");
    TORCH_CHECK(image.numel() < (int64_t)1 << 31 && width * height * image.size(2) < (int64_t)1 << 31,
                "image too large for the remap kernel");
    RemapDims d{};
    d.src_height = (int)image.size(0);
    d.src_width = (int)image.size(1);
    d.channels = (int)image.size(2);
    d.rows = (int)coarse.size(2);
    d.cols = (int)coarse.size(3);
    d.width = (int)width;
    d.height = (int)height;
    // F.interpolate's scale (align_corners=True): float(in - 1) / (out - 1), on the host in float
    d.scale_y = height > 1 ? (float)(d.rows - 1) / (d.height - 1) : 0.0f;
    d.scale_x = width > 1 ? (float)(d.cols - 1) / (d.width - 1) : 0.0f;
    d.check_inside = check_inside;
    const c10::cuda::CUDAGuard guard(device);
    at::Tensor out = at::empty({height, width, image.size(2)}, image.options());
    check_cuda(launch_remap(d, image.data_ptr<uint8_t>(), coarse.data_ptr<float>(), out.data_ptr<uint8_t>(),
                            c10::cuda::getCurrentCUDAStream().stream()),
               "undistortion remap");
    return out;
}

} // namespace gstrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("remap_uint8", &gstrain::remap_uint8, "undistortion remap through a coarse map, uint8 in and out");
}
