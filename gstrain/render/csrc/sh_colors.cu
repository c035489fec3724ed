// Colours of N Gaussians from their spherical harmonics, as one kernel each way:
//   colour = max(SH(normalize(mean - camera centre)) + 0.5, 0)   for visible Gaussians (radii > 0),
//   0.5                                                          for the others.
// This is what render/cuda.splat_colors computes through gsplat (a difference for the directions,
// a concatenation of sh0 and shN, gsplat's SH kernel with a mask, an add and a clamp, and the
// backward of each). Fused, sh0 and shN are read where they lie and their gradients written
// there, so the [N, 16, 3] concatenation and its gradient's split never exist. The basis is
// gsplat's (real SH, Sloan's polynomial forms, degree <= 3), re-derived here with its partial
// derivatives for the direction's gradient; tests/test_sh_colors_cuda.py compares with gsplat.
#include "sh_colors.h"

namespace gstrain {
namespace {

constexpr int kShThreads = 256;
constexpr int kShBwdThreads = 128;
constexpr size_t kShBwdSharedBytes = 48 * 1024;

constexpr float kY0 = 0.2820947917738781f;
constexpr float kY1 = 0.48860251190292f;
constexpr float kY2xy = 0.5462742152960395f;  // times 2xy and x^2 - y^2
constexpr float kY2z = -1.092548430592079f;   // times zy and zx
constexpr float kY2zzA = 0.9461746957575601f; // times z^2 ...
constexpr float kY2zzB = -0.3153915652525201f;
constexpr float kY3s = -0.5900435899266435f;  // times 3x^2 y - y^3 and x^3 - 3xy^2
constexpr float kY3xyz = 1.445305721320277f;  // times z 2xy and z (x^2 - y^2)
constexpr float kY3zzA = -2.285228997322329f; // (A z^2 + B) times y and x
constexpr float kY3zzB = 0.4570457994644658f;
constexpr float kY3zA = 1.865881662950577f; // z (A z^2 + B)
constexpr float kY3zB = -1.119528997770346f;

// The unit direction from the camera centre (-R^T t of the world-to-camera matrix) to the
// mean, and 1 / the distance.
__device__ __forceinline__ void unit_direction(const ShColorArgs &a, int64_t i, float u[3], float &inorm) {
    const float *v = a.viewmat;
    float d[3];
#pragma unroll
    for (int j = 0; j < 3; ++j) {
        const float centre = -(v[j] * v[3] + v[4 + j] * v[7] + v[8 + j] * v[11]);
        d[j] = a.means[3 * i + j] - centre;
    }
    inorm = rsqrtf(d[0] * d[0] + d[1] * d[1] + d[2] * d[2]);
#pragma unroll
    for (int j = 0; j < 3; ++j) u[j] = d[j] * inorm;
}

// The basis functions 0..(D+1)^2-1 at the unit direction u.
template <int D> __device__ __forceinline__ void basis(const float u[3], float Y[16]) {
    const float x = u[0], y = u[1], z = u[2];
    Y[0] = kY0;
    if (D >= 1) {
        Y[1] = -kY1 * y;
        Y[2] = kY1 * z;
        Y[3] = -kY1 * x;
    }
    if (D >= 2) {
        const float z2 = z * z;
        Y[4] = kY2xy * (2.f * x * y);
        Y[5] = kY2z * z * y;
        Y[6] = kY2zzA * z2 + kY2zzB;
        Y[7] = kY2z * z * x;
        Y[8] = kY2xy * (x * x - y * y);
    }
    if (D >= 3) {
        const float z2 = z * z, c1 = x * x - y * y, s1 = 2.f * x * y;
        const float t = kY3zzA * z2 + kY3zzB;
        Y[9] = kY3s * (x * s1 + y * c1);
        Y[10] = kY3xyz * z * s1;
        Y[11] = t * y;
        Y[12] = z * (kY3zA * z2 + kY3zB);
        Y[13] = t * x;
        Y[14] = kY3xyz * z * c1;
        Y[15] = kY3s * (x * c1 - y * s1);
    }
}

// d(sum_k s[k] Y_k)/du for u's three components taken as independent.
template <int D> __device__ __forceinline__ void basis_vjp(const float u[3], const float s[16], float g[3]) {
    const float x = u[0], y = u[1], z = u[2];
    float gx = 0.f, gy = 0.f, gz = 0.f;
    if (D >= 1) {
        gx += -kY1 * s[3];
        gy += -kY1 * s[1];
        gz += kY1 * s[2];
    }
    if (D >= 2) {
        gx += 2.f * kY2xy * (y * s[4] + x * s[8]) + kY2z * z * s[7];
        gy += 2.f * kY2xy * (x * s[4] - y * s[8]) + kY2z * z * s[5];
        gz += kY2z * (y * s[5] + x * s[7]) + 2.f * kY2zzA * z * s[6];
    }
    if (D >= 3) {
        const float z2 = z * z, c1 = x * x - y * y, t = kY3zzA * z2 + kY3zzB;
        gx += kY3s * (6.f * x * y * s[9] + 3.f * c1 * s[15]) + 2.f * kY3xyz * z * (y * s[10] + x * s[14]) + t * s[13];
        gy += kY3s * (3.f * c1 * s[9] - 6.f * x * y * s[15]) + 2.f * kY3xyz * z * (x * s[10] - y * s[14]) + t * s[11];
        gz += 2.f * kY3xyz * x * y * s[10] + 2.f * kY3zzA * z * (y * s[11] + x * s[13]) +
              (3.f * kY3zA * z2 + kY3zB) * s[12] + kY3xyz * c1 * s[14];
    }
    g[0] = gx;
    g[1] = gy;
    g[2] = gz;
}

__device__ __forceinline__ bool visible(const ShColorArgs &a, int64_t i) {
    return a.radii[2 * i] > 0 && a.radii[2 * i + 1] > 0;
}

// SH(u) + 0.5 per channel, before the clamp: sh0 [3] and `rest`, the Gaussian's shN row
// (coefficient k >= 1 at rest[(k - 1) * 3 + c]; in global memory or a staged copy).
template <int D>
__device__ __forceinline__ void shifted_colour(const float *sh0, const float *rest, const float Y[16], float out[3]) {
    constexpr int kBases = (D + 1) * (D + 1);
#pragma unroll
    for (int c = 0; c < 3; ++c) {
        float sum = Y[0] * sh0[c];
#pragma unroll
        for (int k = 1; k < kBases; ++k) sum += Y[k] * rest[(k - 1) * 3 + c];
        out[c] = sum + 0.5f;
    }
}

template <int D> __global__ void sh_colors_fwd_kernel(const ShColorArgs a, float *__restrict__ colors) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    float v[3] = {0.5f, 0.5f, 0.5f};
    if (visible(a, i)) {
        float u[3] = {0.f, 0.f, 1.f}, inorm = 0.f, Y[16];
        if (D >= 1) unit_direction(a, i, u, inorm);
        basis<D>(u, Y);
        shifted_colour<D>(a.sh0 + 3 * i, a.shN + i * a.rest * 3, Y, v);
    }
#pragma unroll
    for (int c = 0; c < 3; ++c) colors[3 * i + c] = v[c] < 0.f ? 0.f : v[c]; // NaN stays NaN, as in torch
}

// The backward stages its block's shN rows through shared memory, in and out: a Gaussian's row
// (3 * rest floats) lies that far from its neighbour's, so a lane-per-Gaussian load or store
// touches a sector per lane (unstaged, this kernel cost ~7x its traffic: 0.22 ms at 300k
// Gaussians on an H200); staged, the block moves its contiguous slice coalesced. Each thread
// reads and overwrites only its own row between the two barriers.
template <int D> __global__ void sh_colors_bwd_kernel(const ShColorArgs a, const ShColorGrads g) {
    extern __shared__ float rows[]; // [blockDim.x, 3 * rest]
    constexpr int kBases = (D + 1) * (D + 1);
    const int row = a.rest * 3;
    const int64_t first = (int64_t)blockIdx.x * blockDim.x;
    const int count = (int)min((int64_t)blockDim.x, a.n - first);
    const float *shN = a.shN + first * row;
    for (int j = threadIdx.x; j < count * row; j += blockDim.x) rows[j] = shN[j];
    __syncthreads();
    const int64_t i = first + threadIdx.x;
    float *mine = rows + threadIdx.x * row;
    if (threadIdx.x < count) {
        float vu[3] = {0.f, 0.f, 0.f}, gc[3] = {0.f, 0.f, 0.f};
        if (visible(a, i)) {
            float u[3] = {0.f, 0.f, 1.f}, inorm = 0.f, Y[16], v[3];
            if (D >= 1) unit_direction(a, i, u, inorm);
            basis<D>(u, Y);
            shifted_colour<D>(a.sh0 + 3 * i, mine, Y, v);
#pragma unroll
            for (int c = 0; c < 3; ++c) gc[c] = v[c] >= 0.f ? g.v_colors[3 * i + c] : 0.f; // clamp_min's backward
            if (D >= 1) {
                float s[16];
#pragma unroll
                for (int k = 1; k < kBases; ++k) {
                    const float *sk = mine + (k - 1) * 3;
                    s[k] = gc[0] * sk[0] + gc[1] * sk[1] + gc[2] * sk[2];
                }
                basis_vjp<D>(u, s, vu);
                // through the normalisation: d u / d d = (I - u u^T) / |d|
                const float along = u[0] * vu[0] + u[1] * vu[1] + u[2] * vu[2];
#pragma unroll
                for (int j = 0; j < 3; ++j) vu[j] = (vu[j] - u[j] * along) * inorm;
            }
#pragma unroll
            for (int k = 1; k < kBases; ++k) {
#pragma unroll
                for (int c = 0; c < 3; ++c) mine[(k - 1) * 3 + c] = Y[k] * gc[c];
            }
#pragma unroll
            for (int c = 0; c < 3; ++c) g.v_sh0[3 * i + c] = Y[0] * gc[c];
        } else {
#pragma unroll
            for (int c = 0; c < 3; ++c) g.v_sh0[3 * i + c] = 0.f;
        }
        // invisible: the whole row; visible: the coefficients above the active degree
        for (int j = visible(a, i) ? (kBases - 1) * 3 : 0; j < row; ++j) mine[j] = 0.f;
#pragma unroll
        for (int c = 0; c < 3; ++c) g.v_means[3 * i + c] = vu[c];
    }
    __syncthreads();
    float *v_shN = g.v_shN + first * row;
    for (int j = threadIdx.x; j < count * row; j += blockDim.x) v_shN[j] = rows[j];
}

unsigned blocks_for(int64_t n) { return (unsigned)((n + kShThreads - 1) / kShThreads); }

template <int D> cudaError_t launch_fwd(const ShColorArgs &a, float *colors, cudaStream_t stream) {
    sh_colors_fwd_kernel<D><<<blocks_for(a.n), kShThreads, 0, stream>>>(a, colors);
    return cudaGetLastError();
}

template <int D> cudaError_t launch_bwd(const ShColorArgs &a, const ShColorGrads &g, cudaStream_t stream) {
    // as many Gaussians per block (a multiple of a warp, at most kShBwdThreads) as the default
    // 48 KiB of shared memory holds rows of
    const size_t row_bytes = (size_t)a.rest * 3 * sizeof(float);
    int threads = kShBwdThreads;
    while (threads > 32 && threads * row_bytes > kShBwdSharedBytes) threads -= 32;
    if (threads * row_bytes > kShBwdSharedBytes) return cudaErrorInvalidValue; // rest > kShBwdMaxRest
    const unsigned blocks = (unsigned)((a.n + threads - 1) / threads);
    sh_colors_bwd_kernel<D><<<blocks, threads, threads * row_bytes, stream>>>(a, g);
    return cudaGetLastError();
}

} // namespace

cudaError_t launch_sh_colors_fwd(const ShColorArgs &a, float *colors, cudaStream_t stream) {
    if (a.n == 0) return cudaSuccess;
    switch (a.degree) {
    case 0: return launch_fwd<0>(a, colors, stream);
    case 1: return launch_fwd<1>(a, colors, stream);
    case 2: return launch_fwd<2>(a, colors, stream);
    case 3: return launch_fwd<3>(a, colors, stream);
    default: return cudaErrorInvalidValue;
    }
}

cudaError_t launch_sh_colors_bwd(const ShColorArgs &a, const ShColorGrads &g, cudaStream_t stream) {
    if (a.n == 0) return cudaSuccess;
    switch (a.degree) {
    case 0: return launch_bwd<0>(a, g, stream);
    case 1: return launch_bwd<1>(a, g, stream);
    case 2: return launch_bwd<2>(a, g, stream);
    case 3: return launch_bwd<3>(a, g, stream);
    default: return cudaErrorInvalidValue;
    }
}

} // namespace gstrain
