// Fused SSIM, forward and backward, for images [B, H, W, C] float32 (HWC).
//
// SSIM(p) = (2 mu1 mu2 + C1)(2 s12 + C2) / ((mu1^2 + mu2^2 + C1)(s11 + s22 + C2)), where mu, s are
// Gaussian-weighted (11 taps, sigma 1.5, zero padding) means and (co)variances; the loss value is
// the mean over pixels and channels, exactly as losses.ssim_conv computes it.
//
// Forward, one block per 32x16 output tile, channels one after another:
//   1. stage the tile plus a 5-pixel halo of img and gt in shared memory, zeros outside (conv2d's
//      zero padding), all shifted by the tile's centre value: the (co)variances do not change,
//      and E[x^2] - mu^2 cancels far less in smooth regions than on raw values in [0, 1],
//   2. horizontal pass: the 5 moments (x, y, x^2, y^2, xy) filtered along rows, for all halo
//      rows and the tile's columns, into shared memory,
//   3. vertical pass: each thread filters its column -> mu1, mu2, E[x^2], E[y^2], E[xy], then
//      SSIM and, when a backward will follow, dSSIM/dmu1, dSSIM/ds11, dSSIM/ds12 at its pixel.
// The block's SSIM sum goes to one slot (no atomics: the mean is deterministic), and a one-block
// kernel adds the slots in double.
//
// Backward: with S a function of mu1 = G*x, E[x^2] = G*x^2 and E[xy] = G*(x y) (G the window),
//   dmeanS/dx(q) = 1/N [ (G*dm)(q) + 2 x(q) (G*ds)(q) + y(q) (G*dc)(q) ]
// where dm is the total derivative by mu1 (through s11 and s12 too). G is symmetric, so its
// adjoint with zero padding is the same filter: one more pass with the same tiling.
#include "fused_ssim.h"

namespace gstrain {
namespace {

constexpr float kC1 = 0.01f * 0.01f;
constexpr float kC2 = 0.03f * 0.03f;

constexpr int kTileW = 32; // one warp per tile row: conflict-free shared reads in both passes
constexpr int kTileH = 16;
constexpr int kThreads = kTileW * kTileH;
constexpr int kHaloW = kTileW + 2 * kSsimRadius;
constexpr int kHaloH = kTileH + 2 * kSsimRadius;
constexpr int kFinishThreads = 512;

static_assert((kThreads & (kThreads - 1)) == 0, "the block reduction halves a power of two");
static_assert((kFinishThreads & (kFinishThreads - 1)) == 0, "the block reduction halves a power of two");

// Filtered moments of the shifted images x - kx, y - ky (see the forward kernel).
struct Moments {
    float mu1, mu2, e11, e22, e12;
};

struct PixelSsim {
    float s;  // SSIM at this pixel
    float dm; // dS/dmu1, total (through s11 = E[x^2] - mu1^2 and s12 = E[xy] - mu1 mu2 as well)
    float ds; // dS/ds11
    float dc; // dS/ds12
};

__device__ __forceinline__ PixelSsim ssim_pixel(const Moments m, const float kx, const float ky) {
    // (Co)variances are shift-invariant; the shifted moments are small in smooth regions, so
    // E[x^2] - mu^2 cancels less than on the raw values.
    const float s11 = m.e11 - __fmul_rn(m.mu1, m.mu1);
    const float s22 = m.e22 - __fmul_rn(m.mu2, m.mu2);
    const float s12 = m.e12 - __fmul_rn(m.mu1, m.mu2);
    const float mu1 = m.mu1 + kx;
    const float mu2 = m.mu2 + ky;
    // __fmul_rn: never contracted into an FMA, so equal images give a == c and b == d bit for
    // bit (SSIM exactly 1).
    const float mu11 = __fmul_rn(mu1, mu1);
    const float mu22 = __fmul_rn(mu2, mu2);
    const float mu12 = __fmul_rn(mu1, mu2);
    const float a = 2.f * mu12 + kC1;
    const float b = 2.f * s12 + kC2;
    const float c = (mu11 + mu22) + kC1;
    const float d = (s11 + s22) + kC2;
    const float den = c * d;
    PixelSsim r;
    r.s = (a * b) / den;
    const float rden = 1.f / den;
    r.dc = 2.f * a * rden;
    r.ds = -r.s * c * rden; // -S / d
    r.dm = 2.f * rden * (mu2 * (b - a) + mu1 * r.s * (c - d));
    return r;
}

// In-block sum of one value per thread, in shared memory (a fixed order: deterministic).
template <typename T, int N> __device__ __forceinline__ T block_sum(T *s_red, const int tid, const T v) {
    s_red[tid] = v;
    __syncthreads();
#pragma unroll
    for (int s = N / 2; s > 0; s >>= 1) {
        if (tid < s) s_red[tid] += s_red[tid + s];
        __syncthreads();
    }
    return s_red[0];
}

__global__ void __launch_bounds__(kThreads) ssim_fwd_kernel(
    const SsimDims dims,
    const SsimTaps taps,
    const float *__restrict__ img,
    const float *__restrict__ gt,
    float *__restrict__ block_sums,
    float *__restrict__ l1_block_sums,
    float *__restrict__ partials
) {
    __shared__ float s_x[kHaloH][kHaloW];
    __shared__ float s_y[kHaloH][kHaloW];
    __shared__ float s_h[5][kHaloH][kTileW];
    __shared__ float s_red[kThreads];

    const int H = dims.height, W = dims.width, C = dims.channels;
    const int VW = dims.valid != nullptr ? dims.valid[0] : W; // the image inside the canvas
    const int VH = dims.valid != nullptr ? dims.valid[1] : H;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tid = ty * kTileW + tx;
    const int x0 = blockIdx.x * kTileW, y0 = blockIdx.y * kTileH;
    const int b = blockIdx.z;
    const int px = x0 + tx, py = y0 + ty;
    const bool inside = px < VW && py < VH;
    const size_t hw = (size_t)H * W;
    const float *img_b = img + (size_t)b * hw * C;
    const float *gt_b = gt + (size_t)b * hw * C;

    // The tile's centre pixel (clamped into the image) is the shift of each channel.
    const size_t centre = ((size_t)min(y0 + kTileH / 2, VH - 1) * W + min(x0 + kTileW / 2, VW - 1)) * C;

    float sum = 0.f;
    float l1 = 0.f; // sum of |x - y| at this thread's pixel over channels (when asked for)
    for (int k = 0; k < C; ++k) {
        // 1. halo tile of channel k, shifted: x - kx inside, 0 - kx in the zero padding (the
        //    window's weights sum to 1, so the padding stays exact). The previous channel's
        //    horizontal pass finished reading s_x / s_y before the barrier that ended it.
        const float kx = img_b[centre + k], ky = gt_b[centre + k];
        for (int i = tid; i < kHaloH * kHaloW; i += kThreads) {
            const int r = i / kHaloW, c = i - r * kHaloW;
            const int gy = y0 - kSsimRadius + r, gx = x0 - kSsimRadius + c;
            float xv = -kx, yv = -ky;
            if (gy >= 0 && gy < VH && gx >= 0 && gx < VW) {
                const size_t o = ((size_t)gy * W + gx) * C + k;
                xv = img_b[o] - kx;
                yv = gt_b[o] - ky;
            }
            s_x[r][c] = xv;
            s_y[r][c] = yv;
        }
        __syncthreads(); // also: every thread is done reading s_h of the previous channel

        // 2. horizontal pass: a warp per halo row, a lane per tile column
        for (int i = tid; i < kHaloH * kTileW; i += kThreads) {
            const int r = i / kTileW, c = i - r * kTileW;
            float m1 = 0.f, m2 = 0.f, e11 = 0.f, e22 = 0.f, e12 = 0.f;
#pragma unroll
            for (int j = 0; j < kSsimWindow; ++j) {
                const float w = taps.w[j];
                const float xv = s_x[r][c + j];
                const float yv = s_y[r][c + j];
                m1 += w * xv;
                m2 += w * yv;
                e11 += w * (xv * xv);
                e22 += w * (yv * yv);
                e12 += w * (xv * yv);
            }
            s_h[0][r][c] = m1;
            s_h[1][r][c] = m2;
            s_h[2][r][c] = e11;
            s_h[3][r][c] = e22;
            s_h[4][r][c] = e12;
        }
        __syncthreads();

        // 3. vertical pass at this thread's pixel (threads past the image edge read valid
        //    shared rows and drop the result)
        Moments m{0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSsimWindow; ++j) {
            const float w = taps.w[j];
            m.mu1 += w * s_h[0][ty + j][tx];
            m.mu2 += w * s_h[1][ty + j][tx];
            m.e11 += w * s_h[2][ty + j][tx];
            m.e22 += w * s_h[3][ty + j][tx];
            m.e12 += w * s_h[4][ty + j][tx];
        }
        if (inside) {
            const PixelSsim p = ssim_pixel(m, kx, ky);
            sum += p.s;
            if (l1_block_sums != nullptr) {
                const size_t o = ((size_t)py * W + px) * C + k; // unshifted: |x - y| exactly as torch
                l1 += fabsf(img_b[o] - gt_b[o]);
            }
            if (partials != nullptr) {
                float *plane = partials + ((size_t)b * C + k) * 3 * hw + (size_t)py * W + px;
                plane[0] = p.dm;
                plane[hw] = p.ds;
                plane[2 * hw] = p.dc;
            }
        }
    }

    const size_t slot = ((size_t)b * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const float total = block_sum<float, kThreads>(s_red, tid, sum);
    if (tid == 0) block_sums[slot] = total;
    if (l1_block_sums != nullptr) {
        __syncthreads(); // s_red is reused
        const float l1_total = block_sum<float, kThreads>(s_red, tid, l1);
        if (tid == 0) l1_block_sums[slot] = l1_total;
    }
}

// One block: the mean of the per-block sums, accumulated in double. With L1 sums it also writes
// mean |x - y| and (1 - lambda) L1 + lambda (1 - SSIM), the training loss.
__global__ void __launch_bounds__(kFinishThreads) ssim_finish_kernel(
    const float *__restrict__ block_sums,
    const float *__restrict__ l1_block_sums,
    const int n,
    const double inv_count,
    const int *__restrict__ valid,
    const double per_valid_pixel,
    const double ssim_lambda,
    float *__restrict__ out_ssim,
    float *__restrict__ out_l1,
    float *__restrict__ out_loss
) {
    __shared__ double s_red[kFinishThreads];
    const int tid = threadIdx.x;
    // a valid size on the device: the mean over its pixels
    const double inv = valid != nullptr ? 1.0 / (per_valid_pixel * valid[0] * valid[1]) : inv_count;
    double acc = 0.0;
    for (int i = tid; i < n; i += kFinishThreads) acc += (double)block_sums[i];
    const double total = block_sum<double, kFinishThreads>(s_red, tid, acc);
    if (l1_block_sums == nullptr) {
        if (tid == 0) out_ssim[0] = (float)(total * inv);
        return;
    }
    __syncthreads(); // s_red is reused
    double acc_l1 = 0.0;
    for (int i = tid; i < n; i += kFinishThreads) acc_l1 += (double)l1_block_sums[i];
    const double total_l1 = block_sum<double, kFinishThreads>(s_red, tid, acc_l1);
    if (tid == 0) {
        const double ssim = total * inv, l1 = total_l1 * inv;
        out_ssim[0] = (float)ssim;
        out_l1[0] = (float)l1;
        out_loss[0] = (float)((1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - ssim));
    }
}

__global__ void __launch_bounds__(kThreads) ssim_bwd_kernel(
    const SsimDims dims,
    const SsimTaps taps,
    const float *__restrict__ img,
    const float *__restrict__ gt,
    const float *__restrict__ partials,
    const float *__restrict__ grad_out,
    const double ssim_weight,
    const double l1_weight,
    float *__restrict__ grad_img
) {
    __shared__ float s_p[3][kHaloH][kHaloW];
    __shared__ float s_h[3][kHaloH][kTileW];

    const int H = dims.height, W = dims.width, C = dims.channels;
    const int VW = dims.valid != nullptr ? dims.valid[0] : W; // the image inside the canvas
    const int VH = dims.valid != nullptr ? dims.valid[1] : H;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int tid = ty * kTileW + tx;
    const int x0 = blockIdx.x * kTileW, y0 = blockIdx.y * kTileH;
    const int b = blockIdx.z;
    const int px = x0 + tx, py = y0 + ty;
    const bool in_canvas = px < W && py < H;
    const bool inside = px < VW && py < VH;
    const size_t hw = (size_t)H * W;
    const size_t pix = (size_t)b * hw * C + ((size_t)py * W + px) * C; // only used in the canvas
    const double count = (double)dims.batch * VH * VW * C;
    const float g = grad_out[0] * (float)(ssim_weight / count);
    const float g_l1 = grad_out[0] * (float)(l1_weight / count); // 0 for SSIM alone

    for (int k = 0; k < C; ++k) {
        // the three planes of channel k; outside the image they are zero (the adjoint of the
        // forward's zero padding: pixels outside produced no SSIM term)
        const float *planes = partials + ((size_t)b * C + k) * 3 * hw;
        for (int i = tid; i < kHaloH * kHaloW; i += kThreads) {
            const int r = i / kHaloW, c = i - r * kHaloW;
            const int gy = y0 - kSsimRadius + r, gx = x0 - kSsimRadius + c;
            float dm = 0.f, ds = 0.f, dc = 0.f;
            if (gy >= 0 && gy < VH && gx >= 0 && gx < VW) {
                const size_t o = (size_t)gy * W + gx;
                dm = planes[o];
                ds = planes[hw + o];
                dc = planes[2 * hw + o];
            }
            s_p[0][r][c] = dm;
            s_p[1][r][c] = ds;
            s_p[2][r][c] = dc;
        }
        __syncthreads();

        for (int i = tid; i < kHaloH * kTileW; i += kThreads) {
            const int r = i / kTileW, c = i - r * kTileW;
            float fm = 0.f, fs = 0.f, fc = 0.f;
#pragma unroll
            for (int j = 0; j < kSsimWindow; ++j) {
                const float w = taps.w[j];
                fm += w * s_p[0][r][c + j];
                fs += w * s_p[1][r][c + j];
                fc += w * s_p[2][r][c + j];
            }
            s_h[0][r][c] = fm;
            s_h[1][r][c] = fs;
            s_h[2][r][c] = fc;
        }
        __syncthreads();

        float fm = 0.f, fs = 0.f, fc = 0.f;
#pragma unroll
        for (int j = 0; j < kSsimWindow; ++j) {
            const float w = taps.w[j];
            fm += w * s_h[0][ty + j][tx];
            fs += w * s_h[1][ty + j][tx];
            fc += w * s_h[2][ty + j][tx];
        }
        if (inside) {
            const float xv = img[pix + k];
            const float yv = gt[pix + k];
            const float sign = (float)(xv > yv) - (float)(xv < yv); // d|x - y|/dx, 0 at x == y as torch
            grad_img[pix + k] = g * (fm + 2.f * xv * fs + yv * fc) + g_l1 * sign;
        } else if (in_canvas) {
            grad_img[pix + k] = 0.f; // outside the valid image: no loss term reads this pixel
        }
        // the next channel's staging writes s_p only: its horizontal pass comes after a barrier
        // that every thread reaches after this vertical pass
    }
}

dim3 tile_grid(const SsimDims &d) {
    return dim3((d.width + kTileW - 1) / kTileW, (d.height + kTileH - 1) / kTileH, d.batch);
}

} // namespace

int ssim_fwd_num_blocks(const SsimDims &d) {
    const dim3 g = tile_grid(d);
    return (int)(g.x * g.y * g.z);
}

cudaError_t launch_ssim_fwd(
    const SsimDims &d,
    const SsimTaps &taps,
    const float *img,
    const float *gt,
    float *block_sums,
    float *l1_block_sums,
    double ssim_lambda,
    float *out_ssim,
    float *out_l1,
    float *out_loss,
    float *partials,
    cudaStream_t stream
) {
    if (d.batch <= 0 || d.height <= 0 || d.width <= 0 || d.channels <= 0) return cudaErrorInvalidValue;
    const dim3 grid = tile_grid(d);
    const dim3 block(kTileW, kTileH);
    ssim_fwd_kernel<<<grid, block, 0, stream>>>(d, taps, img, gt, block_sums, l1_block_sums, partials);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const double count = (double)d.batch * d.height * d.width * d.channels;
    const dim3 one(1);
    const dim3 finish_block(kFinishThreads);
    ssim_finish_kernel<<<one, finish_block, 0, stream>>>(
        block_sums, l1_block_sums, ssim_fwd_num_blocks(d), 1.0 / count, d.valid, (double)d.batch * d.channels,
        ssim_lambda, out_ssim, out_l1, out_loss
    );
    return cudaGetLastError();
}

cudaError_t launch_ssim_bwd(
    const SsimDims &d,
    const SsimTaps &taps,
    const float *img,
    const float *gt,
    const float *partials,
    const float *grad_out,
    double ssim_weight,
    double l1_weight,
    float *grad_img,
    cudaStream_t stream
) {
    if (d.batch <= 0 || d.height <= 0 || d.width <= 0 || d.channels <= 0) return cudaErrorInvalidValue;
    const dim3 grid = tile_grid(d);
    const dim3 block(kTileW, kTileH);
    ssim_bwd_kernel<<<grid, block, 0, stream>>>(d, taps, img, gt, partials, grad_out, ssim_weight, l1_weight,
                                                grad_img);
    return cudaGetLastError();
}

} // namespace gstrain
