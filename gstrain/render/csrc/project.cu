// EWA projection of 3D Gaussians through one pinhole camera, with the image size read from the
// device. The math is gsplat's fully_fused_projection (pinhole, radius 3.33 sigma, radius_clip 0,
// optionally the antialiased mode's opacity compensations) re-derived here; the only difference is where width and height come
// from. gsplat takes them as kernel arguments, so a CUDA graph captured for one image size cannot
// replay a view of another. Here they sit in device memory, which the graph step refills before
// each replay (train/graph_step.py), and one graph serves views of every size.
//
// Matrices are row-major float[3][3]; quaternions (w, x, y, z), unnormalised; scales linear.
#include "project.h"

namespace gstrain {
namespace {

constexpr int kProjectThreads = 256;
constexpr float kExtendSigmas = 3.33f;

struct Mat3 {
    float m[3][3];
};

__device__ __forceinline__ Mat3 mul(const Mat3 &a, const Mat3 &b) {
    Mat3 c;
#pragma unroll
    for (int i = 0; i < 3; ++i)
#pragma unroll
        for (int j = 0; j < 3; ++j) c.m[i][j] = a.m[i][0] * b.m[0][j] + a.m[i][1] * b.m[1][j] + a.m[i][2] * b.m[2][j];
    return c;
}

__device__ __forceinline__ Mat3 transpose(const Mat3 &a) {
    Mat3 t;
#pragma unroll
    for (int i = 0; i < 3; ++i)
#pragma unroll
        for (int j = 0; j < 3; ++j) t.m[i][j] = a.m[j][i];
    return t;
}

// The camera's rotation rows and translation from a row-major world-to-camera [4, 4].
struct Camera {
    Mat3 R;
    float t[3];
    float fx, fy, cx, cy;
    float width, height;
};

__device__ __forceinline__ Camera load_camera(const ProjectArgs &a) {
    Camera c;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
#pragma unroll
        for (int j = 0; j < 3; ++j) c.R.m[i][j] = a.viewmat[4 * i + j];
        c.t[i] = a.viewmat[4 * i + 3];
    }
    c.fx = a.K[0];
    c.cx = a.K[2];
    c.fy = a.K[4];
    c.cy = a.K[5];
    c.width = (float)a.size[0];
    c.height = (float)a.size[1];
    return c;
}

// Normalised quaternion and its rotation matrix.
__device__ __forceinline__ Mat3 rotation(const float *q, float qn[4], float &inv_norm) {
    const float w = q[0], x = q[1], y = q[2], z = q[3];
    inv_norm = rsqrtf(x * x + y * y + z * z + w * w);
    qn[0] = w * inv_norm;
    qn[1] = x * inv_norm;
    qn[2] = y * inv_norm;
    qn[3] = z * inv_norm;
    const float W = qn[0], X = qn[1], Y = qn[2], Z = qn[3];
    Mat3 r;
    r.m[0][0] = 1.f - 2.f * (Y * Y + Z * Z);
    r.m[0][1] = 2.f * (X * Y - W * Z);
    r.m[0][2] = 2.f * (X * Z + W * Y);
    r.m[1][0] = 2.f * (X * Y + W * Z);
    r.m[1][1] = 1.f - 2.f * (X * X + Z * Z);
    r.m[1][2] = 2.f * (Y * Z - W * X);
    r.m[2][0] = 2.f * (X * Z - W * Y);
    r.m[2][1] = 2.f * (Y * Z + W * X);
    r.m[2][2] = 1.f - 2.f * (X * X + Y * Y);
    return r;
}

// The forward's shared part: camera-space mean and covariance, and the clamped Jacobian.
struct Projected {
    float mean_c[3];
    Mat3 cov_c;   // R Sigma R^T
    Mat3 rot;     // the Gaussian's rotation
    Mat3 m;       // rot * diag(scale)
    float qn[4];  // normalised quaternion
    float inv_norm;
    float J[2][3];
    float tx, ty, rz, rz2;
    bool in_x, in_y; // x/z, y/z inside the clamp limits (the backward's branch)
};

__device__ __forceinline__ void project_one(const ProjectArgs &a, const Camera &c, int64_t i, Projected &p) {
    const float *mean = a.means + 3 * i;
#pragma unroll
    for (int r = 0; r < 3; ++r) p.mean_c[r] = c.R.m[r][0] * mean[0] + c.R.m[r][1] * mean[1] + c.R.m[r][2] * mean[2] + c.t[r];
    p.rot = rotation(a.quats + 4 * i, p.qn, p.inv_norm);
    const float *s = a.scales + 3 * i;
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
        for (int k = 0; k < 3; ++k) p.m.m[r][k] = p.rot.m[r][k] * s[k];
    const Mat3 cov = mul(p.m, transpose(p.m));
    p.cov_c = mul(mul(c.R, cov), transpose(c.R));

    // gsplat's frustum clamp of the Jacobian: 0.3 tan(half fov) beyond the image on each side,
    // which is why the image size matters to the projection at all
    const float tan_x = 0.5f * c.width / c.fx, tan_y = 0.5f * c.height / c.fy;
    const float lim_xp = (c.width - c.cx) / c.fx + 0.3f * tan_x, lim_xn = c.cx / c.fx + 0.3f * tan_x;
    const float lim_yp = (c.height - c.cy) / c.fy + 0.3f * tan_y, lim_yn = c.cy / c.fy + 0.3f * tan_y;
    const float x = p.mean_c[0], y = p.mean_c[1], z = p.mean_c[2];
    p.rz = 1.f / z;
    p.rz2 = p.rz * p.rz;
    const float u = x * p.rz, v = y * p.rz;
    p.in_x = u <= lim_xp && u >= -lim_xn;
    p.in_y = v <= lim_yp && v >= -lim_yn;
    p.tx = z * fminf(lim_xp, fmaxf(-lim_xn, u));
    p.ty = z * fminf(lim_yp, fmaxf(-lim_yn, v));
    p.J[0][0] = c.fx * p.rz;
    p.J[0][1] = 0.f;
    p.J[0][2] = -c.fx * p.tx * p.rz2;
    p.J[1][0] = 0.f;
    p.J[1][1] = c.fy * p.rz;
    p.J[1][2] = -c.fy * p.ty * p.rz2;
}

// J Sigma_c J^T, 2x2.
__device__ __forceinline__ void cov2d_of(const Projected &p, float cov[2][2]) {
    float js[2][3];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < 3; ++k)
            js[r][k] = p.J[r][0] * p.cov_c.m[0][k] + p.J[r][1] * p.cov_c.m[1][k] + p.J[r][2] * p.cov_c.m[2][k];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < 2; ++k) cov[r][k] = js[r][0] * p.J[k][0] + js[r][1] * p.J[k][1] + js[r][2] * p.J[k][2];
}

__global__ void __launch_bounds__(kProjectThreads) project_fwd_kernel(const ProjectArgs a, ProjectOut out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n) return;
    const Camera c = load_camera(a);
    out.radii[2 * i] = 0;
    out.radii[2 * i + 1] = 0;
    Projected p;
    project_one(a, c, i, p);
    const float z = p.mean_c[2];
    if (z < a.near_plane || z > a.far_plane) return;
    float cov[2][2];
    cov2d_of(p, cov);
    const float det_orig = cov[0][0] * cov[1][1] - cov[0][1] * cov[1][0];
    cov[0][0] += a.eps2d;
    cov[1][1] += a.eps2d;
    const float det = cov[0][0] * cov[1][1] - cov[0][1] * cov[1][0];
    if (det <= 0.f) return;
    const float inv_det = 1.f / det;
    const float rx = ceilf(kExtendSigmas * sqrtf(cov[0][0]));
    const float ry = ceilf(kExtendSigmas * sqrtf(cov[1][1]));
    if (rx <= 0.f && ry <= 0.f) return;
    const float mx = c.fx * p.mean_c[0] * p.rz + c.cx;
    const float my = c.fy * p.mean_c[1] * p.rz + c.cy;
    if (mx + rx <= 0.f || mx - rx >= c.width || my + ry <= 0.f || my - ry >= c.height) return;
    out.radii[2 * i] = (int)rx;
    out.radii[2 * i + 1] = (int)ry;
    out.means2d[2 * i] = mx;
    out.means2d[2 * i + 1] = my;
    out.depths[i] = z;
    out.conics[3 * i] = cov[1][1] * inv_det;
    out.conics[3 * i + 1] = -cov[0][1] * inv_det;
    out.conics[3 * i + 2] = cov[0][0] * inv_det;
    // the share of the footprint the eps2d blur did not add (0 for a degenerate, flat one)
    if (out.compensations != nullptr) out.compensations[i] = sqrtf(fmaxf(0.f, det_orig / det));
}

__global__ void __launch_bounds__(kProjectThreads) project_bwd_kernel(const ProjectArgs a, ProjectGrads g) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= a.n || g.radii[2 * i] <= 0 || g.radii[2 * i + 1] <= 0) return;
    const Camera c = load_camera(a);
    Projected p;
    project_one(a, c, i, p);

    // conic = inverse(cov2d): dL/dcov2d = -P G P with P the conic and G its (symmetrised) gradient
    const float P[2][2] = {{g.conics[3 * i], g.conics[3 * i + 1]}, {g.conics[3 * i + 1], g.conics[3 * i + 2]}};
    const float G[2][2] = {{g.v_conics[3 * i], 0.5f * g.v_conics[3 * i + 1]},
                           {0.5f * g.v_conics[3 * i + 1], g.v_conics[3 * i + 2]}};
    float PG[2][2], v_cov2d[2][2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < 2; ++k) PG[r][k] = P[r][0] * G[0][k] + P[r][1] * G[1][k];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < 2; ++k) v_cov2d[r][k] = -(PG[r][0] * P[0][k] + PG[r][1] * P[1][k]);

    // compensation c = sqrt(det(M) / det(B)), M the unblurred cov2d, B = M + eps2d I, P = B^-1:
    // d(c^2)/dM = (adj(M) - c^2 adj(B)) / det(B) = (1 - c^2) P - eps2d det(P) I (adj(B) = adj(M) +
    // eps2d I for 2x2), and dc = d(c^2) / 2c. c = 0 (clamped, flat Gaussian): no gradient
    if (g.v_compensations != nullptr) {
        const float comp = g.compensations[i];
        if (comp > 0.f) {
            const float v_sq = 0.5f * g.v_compensations[i] / comp;
            const float keep = 1.f - comp * comp;
            const float det_p = P[0][0] * P[1][1] - P[0][1] * P[1][0];
            v_cov2d[0][0] += v_sq * (keep * P[0][0] - a.eps2d * det_p);
            v_cov2d[0][1] += v_sq * keep * P[0][1];
            v_cov2d[1][0] += v_sq * keep * P[1][0];
            v_cov2d[1][1] += v_sq * (keep * P[1][1] - a.eps2d * det_p);
        }
    }

    // cov2d = J Sigma_c J^T: dL/dSigma_c = J^T V J, dL/dJ = V J Sigma_c^T + V^T J Sigma_c
    Mat3 v_cov_c;
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int t = 0; t < 2; ++t) acc += p.J[s][r] * v_cov2d[s][t] * p.J[t][k];
            v_cov_c.m[r][k] = acc;
        }
    float vJ[2][3];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            float acc = 0.f;
#pragma unroll
            for (int s = 0; s < 2; ++s)
#pragma unroll
                for (int t = 0; t < 3; ++t)
                    acc += v_cov2d[r][s] * p.J[s][t] * p.cov_c.m[k][t] + v_cov2d[s][r] * p.J[s][t] * p.cov_c.m[t][k];
            vJ[r][k] = acc;
        }

    const float x = p.mean_c[0], y = p.mean_c[1];
    const float vmx = g.v_means2d[2 * i], vmy = g.v_means2d[2 * i + 1];
    const float rz = p.rz, rz2 = p.rz2, rz3 = rz2 * rz;
    float v_mean_c[3] = {c.fx * rz * vmx, c.fy * rz * vmy, -(c.fx * x * vmx + c.fy * y * vmy) * rz2};
    // the clamped coordinate is a constant of x (or y): its derivative goes to z alone
    if (p.in_x) v_mean_c[0] += -c.fx * rz2 * vJ[0][2];
    else v_mean_c[2] += -c.fx * rz3 * vJ[0][2] * p.tx;
    if (p.in_y) v_mean_c[1] += -c.fy * rz2 * vJ[1][2];
    else v_mean_c[2] += -c.fy * rz3 * vJ[1][2] * p.ty;
    v_mean_c[2] += -c.fx * rz2 * vJ[0][0] - c.fy * rz2 * vJ[1][1] + 2.f * c.fx * p.tx * rz3 * vJ[0][2] +
                   2.f * c.fy * p.ty * rz3 * vJ[1][2];
    if (g.v_depths != nullptr) v_mean_c[2] += g.v_depths[i];

    // mean_c = R mean + t; Sigma_c = R Sigma R^T
#pragma unroll
    for (int k = 0; k < 3; ++k)
        g.v_means[3 * i + k] = c.R.m[0][k] * v_mean_c[0] + c.R.m[1][k] * v_mean_c[1] + c.R.m[2][k] * v_mean_c[2];
    const Mat3 v_cov = mul(mul(transpose(c.R), v_cov_c), c.R);

    // Sigma = M M^T, M = rot diag(s): dL/dM = (V + V^T) M
    Mat3 v_m;
#pragma unroll
    for (int r = 0; r < 3; ++r)
#pragma unroll
        for (int k = 0; k < 3; ++k) {
            float acc = 0.f;
#pragma unroll
            for (int t = 0; t < 3; ++t) acc += (v_cov.m[r][t] + v_cov.m[t][r]) * p.m.m[t][k];
            v_m.m[r][k] = acc;
        }
    const float *s = a.scales + 3 * i;
    // dL/drot. __fmul_rn keeps each product rounded on its own: contracted into the differences
    // below (an FMA), G[2][1] - G[1][2] would leave the rounding error of one product where an
    // isotropic Gaussian's true quaternion gradient is exactly zero, and Adam turns such noise
    // into full learning-rate steps of random sign (gsplat's order gives exact zeros there)
    Mat3 vR;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        g.v_scales[3 * i + k] = p.rot.m[0][k] * v_m.m[0][k] + p.rot.m[1][k] * v_m.m[1][k] + p.rot.m[2][k] * v_m.m[2][k];
#pragma unroll
        for (int r = 0; r < 3; ++r) vR.m[r][k] = __fmul_rn(v_m.m[r][k], s[k]);
    }
    // the rotation's derivative by the normalised quaternion, then through the normalisation
    const float W = p.qn[0], X = p.qn[1], Y = p.qn[2], Z = p.qn[3];
    const float (*G3)[3] = vR.m;
    float vq[4];
    vq[0] = 2.f * (X * (G3[2][1] - G3[1][2]) + Y * (G3[0][2] - G3[2][0]) + Z * (G3[1][0] - G3[0][1]));
    vq[1] = 2.f * (-2.f * X * (G3[1][1] + G3[2][2]) + Y * (G3[1][0] + G3[0][1]) + Z * (G3[2][0] + G3[0][2]) +
                   W * (G3[2][1] - G3[1][2]));
    vq[2] = 2.f * (X * (G3[1][0] + G3[0][1]) - 2.f * Y * (G3[0][0] + G3[2][2]) + Z * (G3[2][1] + G3[1][2]) +
                   W * (G3[0][2] - G3[2][0]));
    vq[3] = 2.f * (X * (G3[2][0] + G3[0][2]) + Y * (G3[2][1] + G3[1][2]) - 2.f * Z * (G3[0][0] + G3[1][1]) +
                   W * (G3[1][0] - G3[0][1]));
    const float dot = vq[0] * W + vq[1] * X + vq[2] * Y + vq[3] * Z;
#pragma unroll
    for (int k = 0; k < 4; ++k) g.v_quats[4 * i + k] = (vq[k] - dot * p.qn[k]) * p.inv_norm;
}

int blocks_for(int64_t n) { return (int)((n + kProjectThreads - 1) / kProjectThreads); }

} // namespace

cudaError_t launch_project_fwd(const ProjectArgs &a, const ProjectOut &out, cudaStream_t stream) {
    if (a.n == 0) return cudaSuccess;
    project_fwd_kernel<<<blocks_for(a.n), kProjectThreads, 0, stream>>>(a, out);
    return cudaGetLastError();
}

cudaError_t launch_project_bwd(const ProjectArgs &a, const ProjectGrads &g, cudaStream_t stream) {
    if (a.n == 0) return cudaSuccess;
    project_bwd_kernel<<<blocks_for(a.n), kProjectThreads, 0, stream>>>(a, g);
    return cudaGetLastError();
}

} // namespace gstrain
