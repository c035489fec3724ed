// PyTorch bindings of the fused SSIM: checks, allocation, and the two launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <optional>

#include "fused_ssim.h"
#include "torch_checks.h"

namespace gstrain {
namespace {

// The taps of losses.gaussian_window_1d(11, 1.5): computed in double, normalised, then rounded.
const SsimTaps &gaussian_taps() {
    static const SsimTaps taps = [] {
        double g[kSsimWindow];
        double total = 0.0;
        for (int j = 0; j < kSsimWindow; ++j) {
            const double x = j - kSsimRadius;
            g[j] = std::exp(-(x * x) / (2.0 * (double)kSsimSigma * (double)kSsimSigma));
            total += g[j];
        }
        SsimTaps t{};
        for (int j = 0; j < kSsimWindow; ++j) t.w[j] = (float)(g[j] / total);
        return t;
    }();
    return taps;
}

void check_image(const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " has dtype ", t.scalar_type(), ", expected float32");
    TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
    TORCH_CHECK(t.dim() == 4, name, " must be [B, H, W, C]");
}

SsimDims dims_of(const at::Tensor &img, const at::Tensor &gt) {
    check_image(img, "img");
    check_image(gt, "gt");
    TORCH_CHECK(img.sizes() == gt.sizes(), "img and gt shapes differ: ", img.sizes(), " vs ", gt.sizes());
    TORCH_CHECK(img.device() == gt.device(), "img and gt are on different devices");
    for (int i = 0; i < 4; ++i) TORCH_CHECK(img.size(i) > 0, "fused SSIM needs a non-empty image");
    constexpr int64_t kMax = std::numeric_limits<int>::max();
    TORCH_CHECK(img.size(0) <= 65535, "fused SSIM: batch too large (grid z)");
    TORCH_CHECK(img.size(1) <= kMax && img.size(2) <= kMax && img.size(3) <= kMax, "fused SSIM: image too large");
    return SsimDims{(int)img.size(0), (int)img.size(1), (int)img.size(2), (int)img.size(3), nullptr};
}

} // namespace

namespace {

// The forward of ssim_fwd / loss_fwd: `ssim` gets SSIM (and with_l1: `l1` and `loss`), 0-dim each.
at::Tensor run_fwd(
    const at::Tensor &img, const at::Tensor &gt, bool save_partials, bool with_l1, double ssim_lambda,
    at::Tensor &ssim, at::Tensor &l1, at::Tensor &loss, const int *valid
) {
    SsimDims d = dims_of(img, gt);
    d.valid = valid;
    const c10::cuda::CUDAGuard guard(img.device());
    const auto fopts = img.options();
    const int blocks = ssim_fwd_num_blocks(d);
    at::Tensor block_sums = at::empty({with_l1 ? 2 * blocks : blocks}, fopts);
    at::Tensor partials = save_partials ? at::empty({d.batch, d.channels, 3, d.height, d.width}, fopts)
                                        : at::empty({0}, fopts);
    check_cuda(
        launch_ssim_fwd(
            d,
            gaussian_taps(),
            img.data_ptr<float>(),
            gt.data_ptr<float>(),
            block_sums.data_ptr<float>(),
            with_l1 ? block_sums.data_ptr<float>() + blocks : nullptr,
            ssim_lambda,
            ssim.data_ptr<float>(),
            with_l1 ? l1.data_ptr<float>() : nullptr,
            with_l1 ? loss.data_ptr<float>() : nullptr,
            save_partials ? partials.data_ptr<float>() : nullptr,
            c10::cuda::getCurrentCUDAStream().stream()
        ),
        "fused SSIM forward"
    );
    return partials;
}

} // namespace

// img, gt [B,H,W,C] -> mean SSIM (a 0-dim tensor), and the per-pixel partial derivatives
// [B,C,3,H,W] the backward needs (an empty tensor when save_partials is false).
std::vector<at::Tensor> ssim_fwd(const at::Tensor &img, const at::Tensor &gt, bool save_partials) {
    at::Tensor mean = at::empty({}, img.options());
    at::Tensor unused;
    at::Tensor partials = run_fwd(img, gt, save_partials, false, 0.0, mean, unused, unused, nullptr);
    return {mean, partials};
}

// The 3DGS training loss in one pass: (1 - lambda) L1 + lambda (1 - SSIM), SSIM and L1 (0-dim
// tensors each), and the partials for loss_bwd. valid: see SsimDims (None: the whole images).
std::vector<at::Tensor> loss_fwd(const at::Tensor &img, const at::Tensor &gt, double ssim_lambda, bool save_partials,
                                 const std::optional<at::Tensor> &valid) {
    TORCH_CHECK(ssim_lambda >= 0.0 && ssim_lambda <= 1.0, "ssim_lambda must be in [0, 1]");
    at::Tensor loss = at::empty({}, img.options());
    at::Tensor ssim = at::empty({}, img.options());
    at::Tensor l1 = at::empty({}, img.options());
    at::Tensor partials =
        run_fwd(img, gt, save_partials, true, ssim_lambda, ssim, l1, loss, valid_size(valid, img.device()));
    return {loss, ssim, l1, partials};
}

namespace {

at::Tensor run_bwd(
    const at::Tensor &img, const at::Tensor &gt, const at::Tensor &partials, const at::Tensor &grad_out,
    double ssim_weight, double l1_weight, const int *valid
) {
    SsimDims d = dims_of(img, gt);
    d.valid = valid;
    TORCH_CHECK(partials.is_cuda() && partials.scalar_type() == at::kFloat && partials.is_contiguous(),
                "partials must be a contiguous float32 CUDA tensor");
    TORCH_CHECK(
        partials.sizes() == at::IntArrayRef({d.batch, d.channels, 3, d.height, d.width}),
        "partials must be [B, C, 3, H, W] (was the forward run without saving them?)"
    );
    TORCH_CHECK(grad_out.is_cuda() && grad_out.numel() == 1, "grad_out must be one CUDA value");
    const c10::cuda::CUDAGuard guard(img.device());
    const at::Tensor g = grad_out.to(at::kFloat).contiguous();
    at::Tensor grad_img = at::empty_like(img);
    check_cuda(
        launch_ssim_bwd(
            d,
            gaussian_taps(),
            img.data_ptr<float>(),
            gt.data_ptr<float>(),
            partials.data_ptr<float>(),
            g.data_ptr<float>(),
            ssim_weight,
            l1_weight,
            grad_img.data_ptr<float>(),
            c10::cuda::getCurrentCUDAStream().stream()
        ),
        "fused SSIM backward"
    );
    return grad_img;
}

} // namespace

// dL/dimg [B,H,W,C] for L = grad_out * mean SSIM; grad_out stays on the device (no host sync).
at::Tensor ssim_bwd(
    const at::Tensor &img, const at::Tensor &gt, const at::Tensor &partials, const at::Tensor &grad_out
) {
    return run_bwd(img, gt, partials, grad_out, 1.0, 0.0, nullptr);
}

// dL/dimg for L = grad_out * ((1 - lambda) L1 + lambda (1 - SSIM)).
at::Tensor loss_bwd(
    const at::Tensor &img, const at::Tensor &gt, const at::Tensor &partials, const at::Tensor &grad_out,
    double ssim_lambda, const std::optional<at::Tensor> &valid
) {
    return run_bwd(img, gt, partials, grad_out, -ssim_lambda, 1.0 - ssim_lambda, valid_size(valid, img.device()));
}

} // namespace gstrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("ssim_fwd", &gstrain::ssim_fwd, "fused SSIM forward (mean, saved partial derivatives)");
    m.def("ssim_bwd", &gstrain::ssim_bwd, "fused SSIM backward (gradient of the rendered image)");
    m.def("loss_fwd", &gstrain::loss_fwd, "fused L1 + SSIM loss forward (loss, SSIM, L1, partials)");
    m.def("loss_bwd", &gstrain::loss_bwd, "fused L1 + SSIM loss backward (gradient of the rendered image)");
    m.attr("WINDOW") = gstrain::kSsimWindow;
    m.attr("SIGMA") = gstrain::kSsimSigma;
}
