// PyTorch bindings of the rasterizer (checks, allocation, channel padding / chunking, kernel dispatch)
// and the module's registrations; the intersection's bindings are in isect_bindings.cpp.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <type_traits>

#include "isect_bindings.h"
#include "project_bindings.h"
#include "raster.h"
#include "torch_checks.h"

namespace gstrain {
namespace {

// Smallest compiled channel count that holds `ch` (ch <= kMaxChunkChannels).
int compiled_channels(int64_t ch) {
    for (int c : {1, 2, 3, 4, 8, 16, 32}) {
        if (ch <= c) return c;
    }
    return -1;
}

// Calls f(std::integral_constant<int, CH>) for a compiled channel count.
template <typename F> cudaError_t dispatch_channels(int ch, F &&f) {
    switch (ch) {
#define GSTRAIN_CASE(CH)                                                                           \
    case CH:                                                                                       \
        return f(std::integral_constant<int, CH>{});
        GSTRAIN_FOR_EACH_CHANNELS(GSTRAIN_CASE)
#undef GSTRAIN_CASE
    default:
        TORCH_CHECK(false, "gstrain: no kernel for ", ch, " channels");
    }
}

// Zero-pads the last dimension up to `k` channels (a contiguous copy only when needed).
at::Tensor pad_channels(const at::Tensor &t, int64_t k) {
    const int64_t have = t.size(-1);
    if (have == k) return t.contiguous();
    return at::constant_pad_nd(t, {0, k - have}, 0.0).contiguous();
}

struct Inputs {
    RasterArgs args;
    int64_t channels;
};

Inputs make_args(
    const at::Tensor &means2d,
    const at::Tensor &conics,
    const at::Tensor &colors,
    const at::Tensor &opacities,
    const c10::optional<at::Tensor> &backgrounds,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const at::Tensor &tile_offsets,
    const at::Tensor &flatten_ids,
    const c10::optional<at::Tensor> &n_isects
) {
    check_tensor(means2d, "means2d", at::kFloat);
    check_tensor(conics, "conics", at::kFloat);
    check_tensor(colors, "colors", at::kFloat);
    check_tensor(opacities, "opacities", at::kFloat);
    check_tensor(tile_offsets, "isect_offsets", at::kInt);
    check_tensor(flatten_ids, "flatten_ids", at::kInt);
    TORCH_CHECK(means2d.dim() == 3 && means2d.size(2) == 2, "means2d must be [C, N, 2]");
    const int64_t C = means2d.size(0), N = means2d.size(1);
    TORCH_CHECK(conics.sizes() == at::IntArrayRef({C, N, 3}), "conics must be [C, N, 3]");
    TORCH_CHECK(colors.dim() == 3 && colors.size(0) == C && colors.size(1) == N, "colors must be [C, N, ch]");
    TORCH_CHECK(colors.size(2) >= 1, "colors need at least one channel");
    TORCH_CHECK(opacities.sizes() == at::IntArrayRef({C, N}), "opacities must be [C, N]");
    TORCH_CHECK(tile_size == 8 || tile_size == 16, "tile_size must be 8 or 16");
    TORCH_CHECK(tile_offsets.dim() == 3 && tile_offsets.size(0) == C, "isect_offsets must be [C, th, tw]");
    TORCH_CHECK(
        tile_offsets.size(1) * tile_size >= height && tile_offsets.size(2) * tile_size >= width,
        "isect_offsets does not cover the image"
    );
    TORCH_CHECK(flatten_ids.dim() == 1, "flatten_ids must be [M]");
    TORCH_CHECK(C * N < (int64_t(1) << 31) && flatten_ids.numel() < (int64_t(1) << 31), "too many Gaussians");
    if (backgrounds.has_value()) {
        check_tensor(*backgrounds, "backgrounds", at::kFloat);
        TORCH_CHECK(
            backgrounds->sizes() == at::IntArrayRef({C, colors.size(2)}), "backgrounds must be [C, ch]"
        );
    }
    RasterArgs a{};
    a.n_cams = (int)C;
    a.n_gauss = (int)N;
    a.n_isects = (int)flatten_ids.numel();
    a.width = (int)width;
    a.height = (int)height;
    a.tile_size = (int)tile_size;
    a.tiles_x = (int)tile_offsets.size(2);
    a.tiles_y = (int)tile_offsets.size(1);
    a.means2d = means2d.data_ptr<float>();
    a.conics = conics.data_ptr<float>();
    a.colors = nullptr; // per channel chunk
    a.opacities = opacities.data_ptr<float>();
    a.backgrounds = nullptr;
    a.tile_offsets = tile_offsets.data_ptr<int>();
    a.flatten_ids = flatten_ids.data_ptr<int>();
    a.n_isects_dev = nullptr;
    if (n_isects.has_value() && n_isects->defined()) {
        // the sync-free intersection: flatten_ids is a capacity, the real count lives on the device
        check_tensor(*n_isects, "n_isects", at::kInt);
        TORCH_CHECK(n_isects->numel() == 1, "n_isects must hold one count");
        a.n_isects_dev = n_isects->data_ptr<int>();
    }
    return {a, colors.size(2)};
}


} // namespace

// -> image [C,H,W,ch], alpha [C,H,W,1], final transmittance [C,H,W], last contributor [C,H,W]
std::vector<at::Tensor> rasterize_fwd(
    const at::Tensor &means2d,
    const at::Tensor &conics,
    const at::Tensor &colors,
    const at::Tensor &opacities,
    const c10::optional<at::Tensor> &backgrounds,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const at::Tensor &tile_offsets,
    const at::Tensor &flatten_ids,
    const c10::optional<at::Tensor> &n_isects
) {
    const c10::cuda::CUDAGuard guard(means2d.device());
    Inputs in = make_args(
        means2d, conics, colors, opacities, backgrounds, width, height, tile_size, tile_offsets, flatten_ids, n_isects
    );
    RasterArgs &a = in.args;
    const int64_t C = a.n_cams, ch = in.channels;
    const auto fopts = means2d.options();
    at::Tensor image = at::empty({C, height, width, ch}, fopts);
    at::Tensor alpha = at::empty({C, height, width, 1}, fopts);
    at::Tensor t_final = at::empty({C, height, width}, fopts);
    at::Tensor last_ids = at::empty({C, height, width}, fopts.dtype(at::kInt));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

    // Channels beyond one kernel's reach are composited in chunks; the weights are the same.
    for (int64_t k0 = 0; k0 < ch; k0 += kMaxChunkChannels) {
        const int64_t kc = std::min<int64_t>(kMaxChunkChannels, ch - k0);
        const int kp = compiled_channels(kc);
        const bool direct = kc == ch && kp == ch;
        at::Tensor col = direct ? colors : pad_channels(colors.narrow(-1, k0, kc), kp);
        at::Tensor bg;
        if (backgrounds.has_value()) {
            bg = direct ? *backgrounds : pad_channels(backgrounds->narrow(-1, k0, kc), kp);
        }
        at::Tensor img = direct ? image : at::empty({C, height, width, kp}, fopts);
        a.colors = col.data_ptr<float>();
        a.backgrounds = bg.defined() ? bg.data_ptr<float>() : nullptr;
        const bool first = k0 == 0;
        check_cuda(
            dispatch_channels(
                kp,
                [&](auto kpc) {
                    return launch_raster_fwd<decltype(kpc)::value>(
                        a,
                        img.data_ptr<float>(),
                        first ? alpha.data_ptr<float>() : nullptr,
                        first ? t_final.data_ptr<float>() : nullptr,
                        first ? last_ids.data_ptr<int>() : nullptr,
                        stream
                    );
                }
            ),
            "rasterize forward"
        );
        if (!direct) image.narrow(-1, k0, kc).copy_(img.narrow(-1, 0, kc));
    }
    return {image, alpha, t_final, last_ids};
}

// -> v_means2d [C,N,2], v_conics [C,N,3], v_colors [C,N,ch], v_opacities [C,N],
//    v_means2d_abs [C,N,2] (an empty tensor when absgrad is off)
std::vector<at::Tensor> rasterize_bwd(
    const at::Tensor &means2d,
    const at::Tensor &conics,
    const at::Tensor &colors,
    const at::Tensor &opacities,
    const c10::optional<at::Tensor> &backgrounds,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const at::Tensor &tile_offsets,
    const at::Tensor &flatten_ids,
    const at::Tensor &t_final,
    const at::Tensor &last_ids,
    const at::Tensor &v_image,
    const c10::optional<at::Tensor> &v_alpha,
    bool absgrad,
    int64_t threshold,
    bool vector_layout,
    bool scatter,
    const c10::optional<at::Tensor> &n_isects
) {
    const c10::cuda::CUDAGuard guard(means2d.device());
    Inputs in = make_args(
        means2d, conics, colors, opacities, backgrounds, width, height, tile_size, tile_offsets, flatten_ids, n_isects
    );
    RasterArgs &a = in.args;
    const int64_t C = a.n_cams, N = a.n_gauss, M = C * N, ch = in.channels;
    check_tensor(t_final, "t_final", at::kFloat);
    check_tensor(last_ids, "last_ids", at::kInt);
    check_tensor(v_image, "v_image", at::kFloat);
    TORCH_CHECK(v_image.sizes() == at::IntArrayRef({C, height, width, ch}), "v_image must be [C, H, W, ch]");
    TORCH_CHECK(t_final.numel() == C * height * width && last_ids.numel() == C * height * width, "bad fwd state");
    if (v_alpha.has_value()) {
        check_tensor(*v_alpha, "v_alpha", at::kFloat);
        TORCH_CHECK(v_alpha->numel() == C * height * width, "v_alpha must be [C, H, W, 1]");
    }
    TORCH_CHECK(threshold >= 0, "threshold must be >= 0");
    // chunks add up exactly for linear gradients, not for the per-pixel absolute values
    TORCH_CHECK(!absgrad || ch <= kMaxChunkChannels, "absgrad supports at most ", kMaxChunkChannels, " channels");
    const auto fopts = means2d.options();
    if (a.n_isects == 0 || height == 0 || width == 0) {
        return {
            at::zeros({C, N, 2}, fopts), at::zeros({C, N, 3}, fopts), at::zeros({C, N, ch}, fopts),
            at::zeros({C, N}, fopts), absgrad ? at::zeros({C, N, 2}, fopts) : at::empty({0}, fopts)
        };
    }
    // The vector layout accumulates into `geo` and copies out at the end: no zeroing needed.
    const auto out = [&](at::IntArrayRef sizes) {
        return vector_layout ? at::empty(sizes, fopts) : at::zeros(sizes, fopts);
    };
    at::Tensor v_means2d = out({C, N, 2});
    at::Tensor v_conics = out({C, N, 3});
    at::Tensor v_opacities = out({C, N});
    at::Tensor v_abs = absgrad ? out({C, N, 2}) : at::empty({0}, fopts);
    const bool one_chunk_direct = ch <= kMaxChunkChannels && compiled_channels(ch) == ch;
    const bool colors_direct = one_chunk_direct && !(vector_layout && ch == 3);
    at::Tensor v_colors = colors_direct ? at::zeros({C, N, ch}, fopts) : at::empty({C, N, ch}, fopts);
    at::Tensor geo = vector_layout ? at::zeros({M, 8}, fopts) : at::Tensor();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

    // By linearity each channel chunk adds its share of dL/dalpha to the geometry gradients;
    // the alpha output's own term is added once, with the first chunk.
    for (int64_t k0 = 0; k0 < ch; k0 += kMaxChunkChannels) {
        const int64_t kc = std::min<int64_t>(kMaxChunkChannels, ch - k0);
        const int kp = compiled_channels(kc);
        const bool direct = kc == ch && kp == ch;
        const int cstride = (vector_layout && kp == 3) ? 4 : kp;
        at::Tensor col = direct ? colors : pad_channels(colors.narrow(-1, k0, kc), kp);
        at::Tensor vimg = direct ? v_image : pad_channels(v_image.narrow(-1, k0, kc), kp);
        at::Tensor bg;
        if (backgrounds.has_value()) {
            bg = direct ? *backgrounds : pad_channels(backgrounds->narrow(-1, k0, kc), kp);
        }
        const bool col_direct = direct && colors_direct;
        at::Tensor vcol = col_direct ? v_colors : at::zeros({M, cstride}, fopts);
        a.colors = col.data_ptr<float>();
        a.backgrounds = bg.defined() ? bg.data_ptr<float>() : nullptr;
        GradPtrs o{};
        o.colors = vcol.data_ptr<float>();
        o.cstride = cstride;
        if (vector_layout) {
            o.geo = geo.data_ptr<float>();
        } else {
            o.means2d = v_means2d.data_ptr<float>();
            o.conics = v_conics.data_ptr<float>();
            o.opacities = v_opacities.data_ptr<float>();
            o.absgrad = absgrad ? v_abs.data_ptr<float>() : nullptr;
        }
        const float *va = (k0 == 0 && v_alpha.has_value()) ? v_alpha->data_ptr<float>() : nullptr;
        check_cuda(
            dispatch_channels(
                kp,
                [&](auto kpc) {
                    constexpr int CH = decltype(kpc)::value;
                    const float *tf = t_final.data_ptr<float>();
                    const int *li = last_ids.data_ptr<int>();
                    const float *vi = vimg.data_ptr<float>();
                    const int thr = (int)threshold;
                    return vector_layout
                               ? launch_raster_bwd<CH, true>(a, tf, li, vi, va, o, absgrad, thr, scatter, stream)
                               : launch_raster_bwd<CH, false>(a, tf, li, vi, va, o, absgrad, thr, scatter, stream);
                }
            ),
            "rasterize backward"
        );
        if (!col_direct) v_colors.view({M, ch}).narrow(1, k0, kc).copy_(vcol.narrow(1, 0, kc));
    }
    if (vector_layout) {
        v_conics.view({M, 3}).copy_(geo.narrow(1, 0, 3));
        v_opacities.view({M}).copy_(geo.select(1, 3));
        v_means2d.view({M, 2}).copy_(geo.narrow(1, 4, 2));
        if (absgrad) v_abs.view({M, 2}).copy_(geo.narrow(1, 6, 2));
    }
    return {v_means2d, v_conics, v_colors, v_opacities, v_abs};
}


} // namespace gstrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("rasterize_fwd", &gstrain::rasterize_fwd, "tile rasterizer forward");
    m.def("rasterize_bwd", &gstrain::rasterize_bwd, "tile rasterizer backward");
    m.def("isect_count", &gstrain::isect_count, "culled tile intersection: tiles kept per Gaussian");
    m.def("isect_fill", &gstrain::isect_fill, "culled tile intersection: sorted pairs");
    m.def("isect_fill_capped", &gstrain::isect_fill_capped, "culled tile intersection into a fixed capacity");
    m.def("project_fwd", &gstrain::project_fwd, "EWA projection, image size read on the device");
    m.def("project_bwd", &gstrain::project_bwd, "EWA projection backward, image size read on the device");
    m.def("sh_colors_fwd", &gstrain::sh_colors_fwd, "colours from spherical harmonics, fused");
    m.def("sh_colors_bwd", &gstrain::sh_colors_bwd, "colours from spherical harmonics, fused backward");
    m.attr("THRESHOLD_NEVER") = gstrain::kThresholdNever;
}
