// PyTorch bindings of the culled tile intersection (csrc/isect.cu): checks, allocation, launches.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <utility>

#include "isect.h"
#include "isect_bindings.h"
#include "torch_checks.h"

namespace gstrain {

namespace {

int bit_width(int64_t v) {
    int bits = 0;
    for (; v > 0; v >>= 1) ++bits;
    return bits;
}

IsectArgs make_isect_args(
    const at::Tensor &means2d,
    const at::Tensor &radii,
    const at::Tensor &conics,
    const at::Tensor &opacities,
    int64_t width,
    int64_t height,
    int64_t tile_size
) {
    check_tensor(means2d, "means2d", at::kFloat);
    check_tensor(radii, "radii", at::kInt);
    check_tensor(conics, "conics", at::kFloat);
    check_tensor(opacities, "opacities", at::kFloat);
    TORCH_CHECK(means2d.dim() == 3 && means2d.size(2) == 2, "means2d must be [C, N, 2]");
    const int64_t C = means2d.size(0), N = means2d.size(1);
    TORCH_CHECK(radii.sizes() == at::IntArrayRef({C, N, 2}), "radii must be [C, N, 2]");
    TORCH_CHECK(conics.sizes() == at::IntArrayRef({C, N, 3}), "conics must be [C, N, 3]");
    TORCH_CHECK(opacities.sizes() == at::IntArrayRef({C, N}), "opacities must be [C, N]");
    TORCH_CHECK(C * N < (int64_t(1) << 31), "too many Gaussians");
    TORCH_CHECK(width > 0 && height > 0 && tile_size > 0, "empty image or tile");
    IsectArgs a{};
    a.n_cams = (int)C;
    a.n_gauss = (int)N;
    a.width = (int)width;
    a.height = (int)height;
    a.tile_size = (int)tile_size;
    a.tiles_x = (int)((width + tile_size - 1) / tile_size);
    a.tiles_y = (int)((height + tile_size - 1) / tile_size);
    a.bound_x = a.tiles_x;
    a.bound_y = a.tiles_y;
    // gsplat's key: camera | tile | 32 depth bits, the first two in 32 bits together
    TORCH_CHECK(bit_width(C) + bit_width((int64_t)a.tiles_x * a.tiles_y) <= 32, "too many cameras and tiles");
    a.means2d = means2d.data_ptr<float>();
    a.radii = radii.data_ptr<int>();
    a.conics = conics.data_ptr<float>();
    a.opacities = opacities.data_ptr<float>();
    return a;
}

// An optional [2] int32 device tensor: the valid width and height inside the canvas.
const int *valid_size(const std::optional<at::Tensor> &valid) {
    if (!valid.has_value() || !valid->defined()) return nullptr;
    check_tensor(*valid, "valid", at::kInt);
    TORCH_CHECK(valid->numel() == 2, "valid must be [width, height]");
    return valid->data_ptr<int>();
}

} // namespace

// -> tiles kept per (camera, Gaussian) [C*N] int32, and [pairs of the bounding rectangles
//    (gsplat's isect_tiles count), pairs kept] int64 [2] (read once: the one host sync)
std::vector<at::Tensor> isect_count(
    const at::Tensor &means2d,
    const at::Tensor &radii,
    const at::Tensor &conics,
    const at::Tensor &opacities,
    int64_t width,
    int64_t height,
    int64_t tile_size,
    const std::optional<at::Tensor> &valid
) {
    const c10::cuda::CUDAGuard guard(means2d.device());
    IsectArgs a = make_isect_args(means2d, radii, conics, opacities, width, height, tile_size);
    a.valid = valid_size(valid);
    at::Tensor counts = at::empty({(int64_t)a.n_cams * a.n_gauss}, means2d.options().dtype(at::kInt));
    at::Tensor totals = at::zeros({2}, means2d.options().dtype(at::kLong));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    check_cuda(
        launch_isect_count(
            a, counts.data_ptr<int>(), reinterpret_cast<unsigned long long *>(totals.data_ptr<int64_t>()), stream
        ),
        "intersection count"
    );
    return {counts, totals};
}

namespace {

// Stable radix sort of the first n (keys, ids) on key bits [0, end_bit) -> sorted copies.
std::pair<at::Tensor, at::Tensor> sort_pairs(const at::Tensor &keys, const at::Tensor &ids, int64_t n, int end_bit,
                                             cudaStream_t stream) {
    at::Tensor keys_sorted = at::empty_like(keys);
    at::Tensor ids_sorted = at::empty_like(ids);
    size_t temp_bytes = 0;
    const auto sort = [&](void *temp) {
        return isect_sort_pairs(
            temp, temp_bytes, keys.data_ptr<int64_t>(), keys_sorted.data_ptr<int64_t>(), ids.data_ptr<int>(),
            ids_sorted.data_ptr<int>(), (int)n, end_bit, stream
        );
    };
    check_cuda(sort(nullptr), "intersection sort (size query)");
    // at least one byte: a null pointer would make the second call a size query again
    at::Tensor temp = at::empty({std::max<int64_t>((int64_t)temp_bytes, 1)}, keys.options().dtype(at::kByte));
    check_cuda(sort(temp.data_ptr()), "intersection sort");
    return {keys_sorted, ids_sorted};
}

// The key's tile field width and the sort's bit range (gsplat's isect_ids: camera | tile | depth).
struct KeyBits {
    int tile_bits;
    int end_bit;
};

KeyBits key_bits(const IsectArgs &a) {
    const int tile_bits = bit_width((int64_t)a.tiles_x * a.tiles_y);
    return {tile_bits, 32 + tile_bits + bit_width(a.n_cams)};
}

// isect_fill_kernel into `slots` fresh (keys, ids) slots: Gaussian i's pairs at [cum[i-1], cum[i]),
// none at or past `slots`.
std::pair<at::Tensor, at::Tensor> fill_pairs(const IsectArgs &a, const at::Tensor &depths, const at::Tensor &cum,
                                             int64_t slots, int tile_bits, cudaStream_t stream) {
    const int64_t n = (int64_t)a.n_cams * a.n_gauss;
    check_tensor(depths, "depths", at::kFloat);
    check_tensor(cum, "cum", at::kLong);
    TORCH_CHECK(depths.numel() == n && cum.numel() == n, "depths and cum must hold C*N values");
    TORCH_CHECK(slots >= 0 && slots < (int64_t(1) << 31), "pair count out of range: ", slots);
    const auto opts = depths.options();
    at::Tensor keys = at::empty({slots}, opts.dtype(at::kLong));
    at::Tensor ids = at::empty({slots}, opts.dtype(at::kInt));
    if (slots == 0) return {keys, ids};
    check_cuda(
        launch_isect_fill(
            a, depths.data_ptr<float>(), cum.data_ptr<int64_t>(), tile_bits, slots, keys.data_ptr<int64_t>(),
            ids.data_ptr<int>(), stream
        ),
        "intersection fill"
    );
    return {keys, ids};
}

} // namespace

// -> isect_ids [M] int64 (gsplat's layout) and flatten_ids [M] int32, sorted by isect_id (stable:
//    a tile's equal depths keep Gaussian order); cum = inclusive prefix sum of isect_count's counts.
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
) {
    const c10::cuda::CUDAGuard guard(means2d.device());
    const IsectArgs a = make_isect_args(means2d, radii, conics, opacities, width, height, tile_size);
    const KeyBits bits = key_bits(a);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    auto filled = fill_pairs(a, depths, cum, n_pairs, bits.tile_bits, stream);
    if (n_pairs == 0) return {filled.first, filled.second};
    auto sorted = sort_pairs(filled.first, filled.second, n_pairs, bits.end_bit, stream);
    return {sorted.first, sorted.second};
}

// The sync-free intersection: isect_fill into `capacity` slots with the kept count read on the
// device, so nothing returns to the host and every shape is fixed (a CUDA graph can hold it).
// -> isect_offsets [C, tiles_y, tiles_x] int32, flatten_ids [capacity] int32 (the first n_isects
//    real), n_isects [1] int32. totals: isect_count's; tag [1] float32, flag [1] int32 and
//    pair_sum [3] int64 as IsectPad describes.
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
) {
    const c10::cuda::CUDAGuard guard(means2d.device());
    IsectArgs a = make_isect_args(means2d, radii, conics, opacities, width, height, tile_size);
    a.valid = valid_size(valid);
    check_tensor(totals, "totals", at::kLong);
    check_tensor(tag, "tag", at::kFloat);
    check_tensor(flag, "flag", at::kInt);
    check_tensor(pair_sum, "pair_sum", at::kLong);
    const bool slotted = slot.has_value() && slot->defined();
    // with a slot, pair_sum holds a row of three per slot (the caller keeps slot in range)
    TORCH_CHECK(totals.numel() == 2 && pair_sum.numel() % 3 == 0 && pair_sum.numel() >= 3 && tag.numel() >= 1 &&
                    flag.numel() == 1 && (slotted || pair_sum.numel() == 3),
                "isect_fill_capped: bad bookkeeping tensors");
    if (slotted) check_tensor(*slot, "slot", at::kInt);
    TORCH_CHECK(capacity > 0, "pair capacity must be positive, got ", capacity);
    const auto opts = means2d.options();
    at::Tensor n_isects = at::empty({1}, opts.dtype(at::kInt));
    const KeyBits bits = key_bits(a);
    const int tile_bits = bits.tile_bits, end_bit = bits.end_bit;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    auto [keys, ids] = fill_pairs(a, depths, cum, capacity, tile_bits, stream);
    IsectPad pad{};
    pad.totals = reinterpret_cast<const unsigned long long *>(totals.data_ptr<int64_t>());
    pad.capacity = capacity;
    pad.pad_key = (int64_t)((uint64_t(1) << end_bit) - 1);
    pad.tag = tag.data_ptr<float>();
    pad.flag = flag.data_ptr<int>();
    pad.pair_sum = reinterpret_cast<long long *>(pair_sum.data_ptr<int64_t>());
    pad.slot = slotted ? slot->data_ptr<int>() : nullptr;
    pad.n_isects = n_isects.data_ptr<int>();
    check_cuda(launch_isect_pad(pad, keys.data_ptr<int64_t>(), ids.data_ptr<int>(), stream), "intersection pad");
    auto sorted = sort_pairs(keys, ids, capacity, end_bit, stream);
    const int tiles_per_cam = a.tiles_x * a.tiles_y;
    at::Tensor offsets = at::empty({a.n_cams, a.tiles_y, a.tiles_x}, opts.dtype(at::kInt));
    check_cuda(
        launch_isect_offsets(
            sorted.first.data_ptr<int64_t>(), n_isects.data_ptr<int>(), capacity, tile_bits, tiles_per_cam,
            a.n_cams * tiles_per_cam, offsets.data_ptr<int>(), stream
        ),
        "intersection offsets"
    );
    return {offsets, sorted.second, n_isects};
}

} // namespace gstrain
