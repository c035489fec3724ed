// PyTorch bindings of the training-step kernels: checks, batching, and the launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "step_ops.h"
#include "torch_checks.h"

namespace gstrain {
namespace {

bool aligned16(const void *p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

} // namespace

// One Adam step over every tensor in the lists (lists index-aligned), in ceil(n / 8) launches.
// step_sizes[i] = lr_i / (1 - beta1^step_i); inv_sqrt_bc2[i] = 1 / sqrt(1 - beta2^step_i).
// With `visible` ([N] bool), rows of Gaussians that are not visible are left untouched.
// Moments may be float32 or bfloat16 per tensor (both of one tensor alike); bfloat16 ones are
// stochastically rounded with the hash of (element, steps[i], salts[2i] or salts[2i+1]), and in a
// graph step (`scalars`) the step counts are read from scalars[2n + i] instead of `steps`.
// A tensor with 8-bit moments (exp_avg int8, exp_avg_sq uint8: optim.moments=int8) has its two
// bfloat16 row scales at scales[2i], scales[2i+1] and a launch of its own (launch_adam_rows8);
// the other tensors' entries in `scales` are not read. hash_offsets[i] is added to tensor i's
// element indices in the rounding hash (0 for a whole tensor; a slice's first element in it).
void adam_step(
    const std::vector<at::Tensor> &params,
    const std::vector<at::Tensor> &grads,
    const std::vector<at::Tensor> &exp_avgs,
    const std::vector<at::Tensor> &exp_avg_sqs,
    const std::vector<double> &step_sizes,
    const std::vector<double> &inv_sqrt_bc2,
    double beta1,
    double beta2,
    double eps,
    const std::optional<at::Tensor> &visible,
    const std::optional<at::Tensor> &scalars,
    const std::optional<at::Tensor> &skip,
    const std::vector<double> &steps,
    const std::vector<int64_t> &salts,
    const std::vector<at::Tensor> &scales,
    const std::vector<int64_t> &hash_offsets
) {
    const size_t n = params.size();
    TORCH_CHECK(
        grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && step_sizes.size() == n &&
            inv_sqrt_bc2.size() == n && steps.size() == n && salts.size() == 2 * n && scales.size() == 2 * n &&
            hash_offsets.size() == n,
        "adam_step: the lists must have the same length (two salts and two scales per tensor)"
    );
    if (n == 0) return;
    bool any_rounded = false; // bfloat16 or 8-bit moments: their rounding hash reads the step counts
    for (const at::Tensor &m : exp_avgs) any_rounded = any_rounded || m.scalar_type() != at::kFloat;
    const at::Device device = params[0].device();
    int64_t gaussians = -1;
    const bool *visible_ptr = nullptr;
    if (visible.has_value() && visible->defined()) {
        TORCH_CHECK(visible->is_cuda() && visible->device() == device, "visible must be on ", device);
        TORCH_CHECK(visible->scalar_type() == at::kBool && visible->dim() == 1 && visible->is_contiguous(),
                    "visible must be a contiguous [N] bool tensor");
        gaussians = visible->size(0);
        visible_ptr = visible->data_ptr<bool>();
    }
    const float *scalars_ptr = nullptr;
    if (scalars.has_value() && scalars->defined()) {
        check_tensor_on(*scalars, "scalars", device, at::kFloat);
        TORCH_CHECK(scalars->numel() >= (int64_t)(2 * n), "scalars must hold a (step size, 1/sqrt(bc2)) pair per tensor");
        scalars_ptr = scalars->data_ptr<float>();
        TORCH_CHECK(!any_rounded || scalars->numel() >= (int64_t)(3 * n),
                    "scalars must also hold a step count per tensor with bfloat16 or 8-bit moments");
    }
    const float *counts_ptr = scalars_ptr != nullptr && any_rounded ? scalars_ptr + 2 * n : nullptr;
    const int *skip_ptr = nullptr;
    if (skip.has_value() && skip->defined()) {
        TORCH_CHECK(skip->is_cuda() && skip->device() == device && skip->scalar_type() == at::kInt && skip->numel() == 1,
                    "skip must be one int32 on ", device);
        skip_ptr = skip->data_ptr<int>();
    }
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    const int64_t per_block = adam_block_elements();
    AdamBatch batch{};
    auto reset = [&]() {
        batch = AdamBatch{};
        batch.beta1 = (float)beta1;
        batch.beta2 = (float)beta2;
        batch.eps = (float)eps;
        batch.visible = visible_ptr;
        batch.scalars = scalars_ptr;
        batch.step_counts = counts_ptr;
        batch.skip = skip_ptr;
        batch.first_block[0] = 0;
        batch.count = 0;
    };
    auto flush = [&]() {
        if (batch.count == 0) return;
        TORCH_CHECK(batch.first_block[batch.count] <= std::numeric_limits<int>::max(), "adam_step: too many elements");
        check_cuda(launch_adam(batch, stream), "fused Adam");
        reset();
    };
    reset();
    for (size_t i = 0; i < n; ++i) {
        const at::Tensor &p = params[i];
        check_tensor_on(p, "param", device, at::kFloat);
        check_tensor_on(grads[i], "grad", device, at::kFloat);
        const int64_t numel = p.numel();
        TORCH_CHECK(grads[i].numel() == numel && exp_avgs[i].numel() == numel && exp_avg_sqs[i].numel() == numel,
                    "adam_step: tensor ", i, " and its gradient or state differ in size");
        if (exp_avgs[i].scalar_type() == at::kChar) {
            TORCH_CHECK(visible_ptr == nullptr, "adam_step: 8-bit moments take no visibility mask");
            check_tensor_on(exp_avgs[i], "exp_avg", device, at::kChar);
            check_tensor_on(exp_avg_sqs[i], "exp_avg_sq", device, at::kByte);
            check_tensor_on(scales[2 * i], "exp_avg_scale", device, at::kBFloat16);
            check_tensor_on(scales[2 * i + 1], "exp_avg_sq_scale", device, at::kBFloat16);
            TORCH_CHECK(p.dim() >= 1, "adam_step: a tensor with 8-bit moments needs rows");
            const int64_t rows = p.size(0);
            TORCH_CHECK(scales[2 * i].numel() == rows && scales[2 * i + 1].numel() == rows,
                        "adam_step: tensor ", i, " needs a scale per row");
            AdamRows8 t{};
            t.param = p.data_ptr<float>();
            t.grad = grads[i].data_ptr<float>();
            t.exp_avg = exp_avgs[i].data_ptr<int8_t>();
            t.exp_avg_sq = exp_avg_sqs[i].data_ptr<uint8_t>();
            t.exp_avg_scale = reinterpret_cast<uint16_t *>(scales[2 * i].data_ptr<at::BFloat16>());
            t.exp_avg_sq_scale = reinterpret_cast<uint16_t *>(scales[2 * i + 1].data_ptr<at::BFloat16>());
            t.rows = rows;
            t.width = rows > 0 ? numel / rows : 0;
            t.beta1 = (float)beta1;
            t.beta2 = (float)beta2;
            t.eps = (float)eps;
            t.step_size = (float)step_sizes[i];
            t.inv_sqrt_bc2 = (float)inv_sqrt_bc2[i];
            t.step = (float)steps[i];
            t.salt_avg = (uint32_t)(salts[2 * i] & 0xFFFFFFFF);
            t.salt_avg_sq = (uint32_t)(salts[2 * i + 1] & 0xFFFFFFFF);
            t.scalars = scalars_ptr != nullptr ? scalars_ptr + 2 * i : nullptr;
            t.step_count = counts_ptr != nullptr ? counts_ptr + i : nullptr;
            t.skip = skip_ptr;
            t.hash_offset = hash_offsets[i];
            check_cuda(launch_adam_rows8(t, stream), "fused Adam (8-bit moments)");
            continue;
        }
        const bool bf16 = exp_avgs[i].scalar_type() == at::kBFloat16;
        if (bf16) {
            check_tensor_on(exp_avgs[i], "exp_avg", device, at::kBFloat16);
            check_tensor_on(exp_avg_sqs[i], "exp_avg_sq", device, at::kBFloat16);
        } else {
            check_tensor_on(exp_avgs[i], "exp_avg", device, at::kFloat);
            check_tensor_on(exp_avg_sqs[i], "exp_avg_sq", device, at::kFloat);
        }
        int64_t row = 1;
        if (visible_ptr != nullptr) {
            TORCH_CHECK(p.dim() >= 1 && p.size(0) == gaussians,
                        "adam_step: tensor ", i, " has ", p.size(0), " rows but visible has ", gaussians);
            row = gaussians > 0 ? numel / gaussians : 1;
        }
        const int count = batch.count;
        AdamTensor &t = batch.tensors[count];
        t.param = p.data_ptr<float>();
        t.grad = grads[i].data_ptr<float>();
        t.bf16 = bf16;
        if (bf16) {
            t.exp_avg_bf16 = reinterpret_cast<uint16_t *>(exp_avgs[i].data_ptr<at::BFloat16>());
            t.exp_avg_sq_bf16 = reinterpret_cast<uint16_t *>(exp_avg_sqs[i].data_ptr<at::BFloat16>());
        } else {
            t.exp_avg = exp_avgs[i].data_ptr<float>();
            t.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
        }
        t.salt_avg = (uint32_t)(salts[2 * i] & 0xFFFFFFFF);
        t.salt_avg_sq = (uint32_t)(salts[2 * i + 1] & 0xFFFFFFFF);
        t.step = (float)steps[i];
        t.numel = numel;
        t.row = row > 0 ? row : 1;
        t.step_size = (float)step_sizes[i];
        t.inv_sqrt_bc2 = (float)inv_sqrt_bc2[i];
        t.vec4 = !bf16 && aligned16(t.param) && aligned16(t.grad) && aligned16(t.exp_avg) && aligned16(t.exp_avg_sq);
        t.index = (int)i;
        t.hash_offset = hash_offsets[i];
        batch.first_block[count + 1] = batch.first_block[count] + (numel + per_block - 1) / per_block;
        batch.count = count + 1;
        if (batch.count == kMaxAdamTensors) flush();
    }
    flush();
}

// DefaultStrategy's running statistics for one camera, in place: grad2d and count [N] float32.
void grad2d_stats(
    const at::Tensor &grad, const at::Tensor &radii, double scale_x, double scale_y, at::Tensor &grad2d,
    at::Tensor &count, const std::optional<at::Tensor> &skip, const std::optional<at::Tensor> &size
) {
    const at::Device device = grad.device();
    check_tensor_on(grad, "grad", device, at::kFloat);
    check_tensor_on(grad2d, "grad2d", device, at::kFloat);
    check_tensor_on(count, "count", device, at::kFloat);
    TORCH_CHECK(radii.is_cuda() && radii.device() == device && radii.scalar_type() == at::kInt && radii.is_contiguous(),
                "radii must be a contiguous int32 tensor on ", device);
    const int64_t n = grad2d.numel();
    TORCH_CHECK(grad.numel() == 2 * n && radii.numel() == 2 * n && count.numel() == n,
                "grad2d_stats: expected grad and radii [N, 2] and grad2d, count [N]");
    const int *skip_ptr = nullptr;
    if (skip.has_value() && skip->defined()) {
        TORCH_CHECK(skip->is_cuda() && skip->scalar_type() == at::kInt && skip->numel() == 1, "skip must be one int32");
        skip_ptr = skip->data_ptr<int>();
    }
    const int *size_ptr = nullptr;
    if (size.has_value() && size->defined()) {
        TORCH_CHECK(size->is_cuda() && size->device() == device && size->scalar_type() == at::kInt &&
                        size->is_contiguous() && size->numel() == 2,
                    "size must be [width, height], int32 on ", device);
        size_ptr = size->data_ptr<int>();
    }
    const c10::cuda::CUDAGuard guard(device);
    check_cuda(
        launch_grad2d_stats(
            n, grad.data_ptr<float>(), radii.data_ptr<int32_t>(), (float)scale_x, (float)scale_y,
            grad2d.data_ptr<float>(), count.data_ptr<float>(), skip_ptr, size_ptr,
            c10::cuda::getCurrentCUDAStream().stream()
        ),
        "densification statistics"
    );
}

} // namespace gstrain

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("adam_step", &gstrain::adam_step, "multi-tensor Adam step (one launch per 8 tensors)");
    m.def("grad2d_stats", &gstrain::grad2d_stats, "DefaultStrategy grad2d/count update without a host sync");
}
