// PyTorch bindings of the device-sized projection (project.cu) and the fused SH colours
// (sh_colors.cu): checks, allocation, launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "project.h"
#include "project_bindings.h"
#include "sh_colors.h"
#include "torch_checks.h"

namespace gstrain {
namespace {

ProjectArgs make_project_args(
    const at::Tensor &means, const at::Tensor &quats, const at::Tensor &scales, const at::Tensor &viewmat,
    const at::Tensor &K, const at::Tensor &size, double eps2d, double near_plane, double far_plane
) {
    check_tensor(means, "means", at::kFloat);
    check_tensor(quats, "quats", at::kFloat);
    check_tensor(scales, "scales", at::kFloat);
    check_tensor(viewmat, "viewmat", at::kFloat);
    check_tensor(K, "K", at::kFloat);
    check_tensor(size, "size", at::kInt);
    const int64_t n = means.size(0);
    TORCH_CHECK(means.dim() == 2 && means.size(1) == 3, "means must be [N, 3]");
    TORCH_CHECK(quats.sizes() == at::IntArrayRef({n, 4}), "quats must be [N, 4]");
    TORCH_CHECK(scales.sizes() == at::IntArrayRef({n, 3}), "scales must be [N, 3]");
    TORCH_CHECK(viewmat.numel() == 16 && K.numel() == 9 && size.numel() == 2, "viewmat [4, 4], K [3, 3], size [2]");
    ProjectArgs a{};
    a.n = n;
    a.means = means.data_ptr<float>();
    a.quats = quats.data_ptr<float>();
    a.scales = scales.data_ptr<float>();
    a.viewmat = viewmat.data_ptr<float>();
    a.K = K.data_ptr<float>();
    a.size = size.data_ptr<int>();
    a.eps2d = (float)eps2d;
    a.near_plane = (float)near_plane;
    a.far_plane = (float)far_plane;
    return a;
}

ShColorArgs make_sh_args(
    const at::Tensor &means, const at::Tensor &sh0, const at::Tensor &shN, const at::Tensor &viewmat,
    const at::Tensor &radii, int64_t degree
) {
    check_tensor(means, "means", at::kFloat);
    check_tensor(sh0, "sh0", at::kFloat);
    check_tensor(shN, "shN", at::kFloat);
    check_tensor(viewmat, "viewmat", at::kFloat);
    check_tensor(radii, "radii", at::kInt);
    const int64_t n = means.size(0);
    TORCH_CHECK(means.dim() == 2 && means.size(1) == 3, "means must be [N, 3]");
    TORCH_CHECK(sh0.sizes() == at::IntArrayRef({n, 1, 3}), "sh0 must be [N, 1, 3]");
    TORCH_CHECK(shN.dim() == 3 && shN.size(0) == n && shN.size(2) == 3, "shN must be [N, K, 3]");
    TORCH_CHECK(degree >= 0 && degree <= 3, "SH degree must be in 0..3, got ", degree);
    TORCH_CHECK(shN.size(1) >= (degree + 1) * (degree + 1) - 1, "shN holds too few coefficients for degree ", degree);
    TORCH_CHECK(viewmat.numel() == 16 && radii.numel() == 2 * n, "viewmat [4, 4], radii [N, 2]");
    ShColorArgs a{};
    a.n = n;
    a.degree = (int)degree;
    a.rest = (int)shN.size(1);
    a.means = means.data_ptr<float>();
    a.sh0 = sh0.data_ptr<float>();
    a.shN = shN.data_ptr<float>();
    a.viewmat = viewmat.data_ptr<float>();
    a.radii = radii.data_ptr<int>();
    return a;
}

} // namespace

// -> radii [1, N, 2] int32, means2d [1, N, 2], depths [1, N], conics [1, N, 3] (zeros where culled),
// compensations [1, N] (zeros where culled) with `compensate`, else an empty [0] placeholder
std::vector<at::Tensor> project_fwd(
    const at::Tensor &means, const at::Tensor &quats, const at::Tensor &scales, const at::Tensor &viewmat,
    const at::Tensor &K, const at::Tensor &size, double eps2d, double near_plane, double far_plane, bool compensate
) {
    const c10::cuda::CUDAGuard guard(means.device());
    const ProjectArgs a = make_project_args(means, quats, scales, viewmat, K, size, eps2d, near_plane, far_plane);
    const auto opts = means.options();
    at::Tensor radii = at::empty({1, a.n, 2}, opts.dtype(at::kInt));
    at::Tensor means2d = at::zeros({1, a.n, 2}, opts);
    at::Tensor depths = at::zeros({1, a.n}, opts);
    at::Tensor conics = at::zeros({1, a.n, 3}, opts);
    at::Tensor compensations = compensate ? at::zeros({1, a.n}, opts) : at::empty({0}, opts);
    const ProjectOut out{radii.data_ptr<int>(), means2d.data_ptr<float>(), depths.data_ptr<float>(),
                         conics.data_ptr<float>(), compensate ? compensations.data_ptr<float>() : nullptr};
    check_cuda(launch_project_fwd(a, out, c10::cuda::getCurrentCUDAStream().stream()), "projection forward");
    return {radii, means2d, depths, conics, compensations};
}

// -> v_means [N, 3], v_quats [N, 4], v_scales [N, 3]; v_depths may be undefined (no gradient), and
// compensations with v_compensations (both [1, N]) are given when the forward made them
std::vector<at::Tensor> project_bwd(
    const at::Tensor &means, const at::Tensor &quats, const at::Tensor &scales, const at::Tensor &viewmat,
    const at::Tensor &K, const at::Tensor &size, double eps2d, const at::Tensor &radii, const at::Tensor &conics,
    const at::Tensor &v_means2d, const std::optional<at::Tensor> &v_depths, const at::Tensor &v_conics,
    const std::optional<at::Tensor> &compensations, const std::optional<at::Tensor> &v_compensations
) {
    const c10::cuda::CUDAGuard guard(means.device());
    const ProjectArgs a = make_project_args(means, quats, scales, viewmat, K, size, eps2d, 0.0, 0.0);
    check_tensor(radii, "radii", at::kInt);
    check_tensor(conics, "conics", at::kFloat);
    check_tensor(v_means2d, "v_means2d", at::kFloat);
    check_tensor(v_conics, "v_conics", at::kFloat);
    TORCH_CHECK(radii.numel() == 2 * a.n && conics.numel() == 3 * a.n && v_means2d.numel() == 2 * a.n &&
                    v_conics.numel() == 3 * a.n,
                "project_bwd: radii, conics and the gradients must hold N Gaussians");
    const float *vd = nullptr;
    if (v_depths.has_value() && v_depths->defined()) {
        check_tensor(*v_depths, "v_depths", at::kFloat);
        TORCH_CHECK(v_depths->numel() == a.n, "v_depths must hold N values");
        vd = v_depths->data_ptr<float>();
    }
    const float *comp = nullptr, *v_comp = nullptr;
    const bool has_comp = compensations.has_value() && compensations->defined();
    TORCH_CHECK(has_comp == (v_compensations.has_value() && v_compensations->defined()),
                "project_bwd: compensations and v_compensations come together");
    if (has_comp) {
        check_tensor(*compensations, "compensations", at::kFloat);
        check_tensor(*v_compensations, "v_compensations", at::kFloat);
        TORCH_CHECK(compensations->numel() == a.n && v_compensations->numel() == a.n,
                    "compensations and v_compensations must hold N values");
        comp = compensations->data_ptr<float>();
        v_comp = v_compensations->data_ptr<float>();
    }
    at::Tensor v_means = at::zeros_like(means);
    at::Tensor v_quats = at::zeros_like(quats);
    at::Tensor v_scales = at::zeros_like(scales);
    const ProjectGrads g{radii.data_ptr<int>(), conics.data_ptr<float>(), v_means2d.data_ptr<float>(), vd,
                         v_conics.data_ptr<float>(), comp, v_comp, v_means.data_ptr<float>(),
                         v_quats.data_ptr<float>(), v_scales.data_ptr<float>()};
    check_cuda(launch_project_bwd(a, g, c10::cuda::getCurrentCUDAStream().stream()), "projection backward");
    return {v_means, v_quats, v_scales};
}

// -> colours [1, N, 3]: max(SH + 0.5, 0) where both radii are > 0, else 0.5
std::vector<at::Tensor> sh_colors_fwd(
    const at::Tensor &means, const at::Tensor &sh0, const at::Tensor &shN, const at::Tensor &viewmat,
    const at::Tensor &radii, int64_t degree
) {
    const c10::cuda::CUDAGuard guard(means.device());
    const ShColorArgs a = make_sh_args(means, sh0, shN, viewmat, radii, degree);
    at::Tensor colors = at::empty({1, a.n, 3}, means.options());
    check_cuda(launch_sh_colors_fwd(a, colors.data_ptr<float>(), c10::cuda::getCurrentCUDAStream().stream()),
               "SH colours forward");
    return {colors};
}

// -> v_means [N, 3], v_sh0 [N, 1, 3], v_shN [N, K, 3] (every element written)
std::vector<at::Tensor> sh_colors_bwd(
    const at::Tensor &means, const at::Tensor &sh0, const at::Tensor &shN, const at::Tensor &viewmat,
    const at::Tensor &radii, int64_t degree, const at::Tensor &v_colors
) {
    const c10::cuda::CUDAGuard guard(means.device());
    const ShColorArgs a = make_sh_args(means, sh0, shN, viewmat, radii, degree);
    check_tensor(v_colors, "v_colors", at::kFloat);
    TORCH_CHECK(v_colors.numel() == 3 * a.n, "v_colors must hold N colours");
    at::Tensor v_means = at::empty_like(means);
    at::Tensor v_sh0 = at::empty_like(sh0);
    at::Tensor v_shN = at::empty_like(shN);
    const ShColorGrads g{v_colors.data_ptr<float>(), v_means.data_ptr<float>(), v_sh0.data_ptr<float>(),
                         v_shN.data_ptr<float>()};
    check_cuda(launch_sh_colors_bwd(a, g, c10::cuda::getCurrentCUDAStream().stream()), "SH colours backward");
    return {v_means, v_sh0, v_shN};
}

} // namespace gstrain
