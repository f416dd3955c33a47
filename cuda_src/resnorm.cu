// add + rms_norm over a float32 residual stream: the pre-norm block of mixed-precision
// training, where the residual h is kept in float32, the branch x that adds to it comes out of
// a 16-bit matrix multiply, and the norm's output y feeds the next 16-bit one.
//
//   forward   h = residual + x (float32, x widened), rstd = 1 / sqrt(mean(h^2) + eps),
//             y = (h * rstd) * w, rounded once to TY
//   backward  g = rstd * (w dy - h * rstd^2 * mean(w dy h)) + dh   (float32: the residual's
//             gradient), gx = g rounded to TX (the branch's), dw = sum over rows of dy h rstd
//             (per-block partial rows, then col_sum: deterministic)
//
// x: TX (float16 / bfloat16 / float32), y and dy: TY (the same set), residual, h, dh, g, rstd
// and the weight: float32. One launch reads each row operand once and writes each output once.
//
// resnorm_fwd / resnorm_bwd hold a row in registers as 4-element quads (16 bytes of float32,
// 8 of 16-bit): TPR threads a row, NV quads a thread, THREADS / TPR rows a block. The backward
// is capped at 64 registers (four 256-thread blocks an SM), which its classes of two quads a
// thread fit without spilling (cupylab/ops/resnorm.py lists the classes). The host
// takes them when every row operand has a contiguous last axis, rows of a multiple of 4
// elements and quad-aligned starts, and the row fits (TPR * NV * 4 elements); anything else
// goes to the *_generic kernels: one block of RG threads a row, reading the row twice, any
// column stride.
#include "cupylab_reduce.cuh"
#include "cupylab_colsum.cuh"

namespace cl {

// Row operands by slot: forward 0 x, 1 residual, 2 y, 3 h (0: not written; may be the
// residual itself); backward 0 dy, 1 h, 2 dh (0: none), 3 g, 4 gx (0: not written).
struct ResArgs {
    u64 a0, a1, a2, a3, a4, w, rstd, part;  // w, part: 0 when absent
    i64 rows, cols, n1;
    i64 so[5], si[5], cs[5];  // row strides (outer, inner leading level), column strides
    double eps;
};

__device__ __forceinline__ u64 res_base(const ResArgs& p, int k) {
    return k == 0 ? p.a0 : k == 1 ? p.a1 : k == 2 ? p.a2 : k == 3 ? p.a3 : p.a4;
}

template <typename P>
__device__ __forceinline__ P* res_row(const ResArgs& p, int k, i64 row) {
    P* b = reinterpret_cast<P*>(res_base(p, k));
    if (p.n1 >= p.rows) return b + row * p.si[k];  // one leading level: no division
    const i64 ro = row / p.n1, ri = row - ro * p.n1;
    return b + ro * p.so[k] + ri * p.si[k];
}

template <typename T>
__device__ __forceinline__ void load4(const T* p, float (&v)[4]) {
    const Vec<T, 4> q = *reinterpret_cast<const Vec<T, 4>*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = to_acc<T>(q.v[k]);
}

template <typename T>
__device__ __forceinline__ void store4(T* p, const float (&v)[4]) {
    Vec<T, 4> q;
#pragma unroll
    for (int k = 0; k < 4; ++k) q.v[k] = from_acc<T>(v[k]);
    *reinterpret_cast<Vec<T, 4>*>(p) = q;
}

// ---- register kernels ------------------------------------------------------------------
template <typename TX, typename TY, int THREADS, int TPR, int NV>
__global__ void __launch_bounds__(THREADS) resnorm_fwd(const ResArgs p) {
    constexpr int RPB = THREADS / TPR;
    const int lane = threadIdx.x % TPR;
    const i64 row = (i64)blockIdx.x * RPB + threadIdx.x / TPR;
    const bool active = row < p.rows;
    const i64 rr = active ? row : 0;
    const int nq = (int)(p.cols >> 2);
    const TX* x = res_row<const TX>(p, 0, rr);
    const float* r = res_row<const float>(p, 1, rr);
    float h[NV][4];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int q = lane + j * TPR;
        if (active && q < nq) {
            float xv[4];
            load4(x + 4 * q, xv);
            load4(r + 4 * q, h[j]);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                h[j][k] += xv[k];
                ss = fmaf(h[j][k], h[j][k], ss);
            }
        }
    }
    ss = group_reduce<TPR, 1, 0, THREADS>(ss, SumOp());
    if (!active) return;
    const float rstd = rsqrtf(ss / (float)p.cols + (float)p.eps);
    if (lane == 0 && p.rstd) reinterpret_cast<float*>(p.rstd)[row] = rstd;
    float* ho = p.a3 ? res_row<float>(p, 3, row) : nullptr;
    TY* y = res_row<TY>(p, 2, row);
    const float* w = reinterpret_cast<const float*>(p.w);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int q = lane + j * TPR;
        if (q < nq) {
            if (ho) store4(ho + 4 * q, h[j]);
            float wv[4] = {1.f, 1.f, 1.f, 1.f};
            if (w) load4(w + 4 * q, wv);
            float yv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) yv[k] = (h[j][k] * rstd) * wv[k];
            store4(y + 4 * q, yv);
        }
    }
}

// Persistent over rows (grid-stride over groups of RPB rows); with p.part, block b writes its
// weight-gradient partial sums to part[b * cols + c] (its RPB row groups added in order).
template <typename TX, typename TY, int THREADS, int TPR, int NV>
__global__ void __launch_bounds__(THREADS, 1024 / THREADS) resnorm_bwd(const ResArgs p) {
    constexpr int RPB = THREADS / TPR;
    const int lane = threadIdx.x % TPR, group = threadIdx.x / TPR;
    const int nq = (int)(p.cols >> 2);
    const float* w = reinterpret_cast<const float*>(p.w);
    const float* rstd = reinterpret_cast<const float*>(p.rstd);
    const bool wgrad = p.part != 0;
    const float n_inv = 1.f / (float)p.cols;
    float dwa[NV][4];
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int k = 0; k < 4; ++k) dwa[j][k] = 0.f;
    for (i64 unit = blockIdx.x; unit * RPB < p.rows; unit += gridDim.x) {
        const i64 row = unit * RPB + group;
        const bool active = row < p.rows;
        const i64 rr = active ? row : 0;
        const float rs = active ? rstd[rr] : 0.f;
        const TY* dy = res_row<const TY>(p, 0, rr);
        const float* h = res_row<const float>(p, 1, rr);
        const float* dh = p.a2 ? res_row<const float>(p, 2, rr) : nullptr;
        float gv[NV][4], hv[NV][4], dv[NV][4];
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int q = lane + j * TPR;
#pragma unroll
            for (int k = 0; k < 4; ++k) gv[j][k] = hv[j][k] = dv[j][k] = 0.f;
            if (active && q < nq) {
                float dyv[4], wv[4] = {1.f, 1.f, 1.f, 1.f};
                load4(dy + 4 * q, dyv);
                load4(h + 4 * q, hv[j]);
                if (dh) load4(dh + 4 * q, dv[j]);
                if (w) load4(w + 4 * q, wv);
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    gv[j][k] = dyv[k] * wv[k];
                    s = fmaf(gv[j][k], hv[j][k], s);
                    if (wgrad) dwa[j][k] = fmaf(dyv[k] * hv[j][k], rs, dwa[j][k]);
                }
            }
        }
        s = group_reduce<TPR, 1, 0, THREADS>(s, SumOp());
        if (active) {
            const float c = s * rs * rs * n_inv;
            float* g = res_row<float>(p, 3, row);
            TX* gx = p.a4 ? res_row<TX>(p, 4, row) : nullptr;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int q = lane + j * TPR;
                if (q < nq) {
                    float o[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) o[k] = rs * (gv[j][k] - c * hv[j][k]) + dv[j][k];
                    store4(g + 4 * q, o);
                    if (gx) store4(gx + 4 * q, o);
                }
            }
        }
    }
    if (!wgrad) return;
    float* part = reinterpret_cast<float*>(p.part) + (i64)blockIdx.x * p.cols;
    if constexpr (RPB == 1) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int q = lane + j * TPR;
            if (q < nq) store4(part + 4 * q, dwa[j]);
        }
    } else {
        // the block's row groups meet in shared memory: [group][j][lane] quads
        __shared__ __align__(16) float red[THREADS * NV * 4];
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int k = 0; k < 4; ++k) red[((group * NV + j) * TPR + lane) * 4 + k] = dwa[j][k];
        __syncthreads();
        if (group == 0) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int q = lane + j * TPR;
                if (q < nq) {
                    float t[4] = {0.f, 0.f, 0.f, 0.f};
                    for (int gr = 0; gr < RPB; ++gr)
#pragma unroll
                        for (int k = 0; k < 4; ++k) t[k] += red[((gr * NV + j) * TPR + lane) * 4 + k];
                    store4(part + 4 * q, t);
                }
            }
        }
    }
}

// ---- generic kernels: any column stride, any length ------------------------------------
constexpr int RG = 256;

template <typename TX, typename TY>
__global__ void __launch_bounds__(RG) resnorm_fwd_generic(const ResArgs p) {
    const float* w = reinterpret_cast<const float*>(p.w);
    for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const TX* x = res_row<const TX>(p, 0, row);
        const float* r = res_row<const float>(p, 1, row);
        float ss = 0.f;
        for (i64 c = threadIdx.x; c < p.cols; c += RG) {
            const float v = r[c * p.cs[1]] + to_acc<TX>(x[c * p.cs[0]]);
            ss = fmaf(v, v, ss);
        }
        ss = group_reduce<RG, 1, 0, RG>(ss, SumOp());
        const float rstd = rsqrtf(ss / (float)p.cols + (float)p.eps);
        if (threadIdx.x == 0 && p.rstd) reinterpret_cast<float*>(p.rstd)[row] = rstd;
        float* ho = p.a3 ? res_row<float>(p, 3, row) : nullptr;
        TY* y = res_row<TY>(p, 2, row);
        // each element is read again and written by the thread that read it (h may be the
        // residual itself)
        for (i64 c = threadIdx.x; c < p.cols; c += RG) {
            const float v = r[c * p.cs[1]] + to_acc<TX>(x[c * p.cs[0]]);
            if (ho) ho[c * p.cs[3]] = v;
            y[c * p.cs[2]] = from_acc<TY>((v * rstd) * (w ? w[c] : 1.f));
        }
    }
}

// Persistent over rows; block b accumulates its weight-gradient partial sums in
// part[b * cols + c], each column by one thread (no atomics).
template <typename TX, typename TY>
__global__ void __launch_bounds__(RG) resnorm_bwd_generic(const ResArgs p) {
    const float* w = reinterpret_cast<const float*>(p.w);
    const float* rstd = reinterpret_cast<const float*>(p.rstd);
    float* part = p.part ? reinterpret_cast<float*>(p.part) + (i64)blockIdx.x * p.cols : nullptr;
    if (part)
        for (i64 c = threadIdx.x; c < p.cols; c += RG) part[c] = 0.f;
    const float n_inv = 1.f / (float)p.cols;
    for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const TY* dy = res_row<const TY>(p, 0, row);
        const float* h = res_row<const float>(p, 1, row);
        const float rs = rstd[row];
        float s = 0.f;
        for (i64 c = threadIdx.x; c < p.cols; c += RG)
            s = fmaf(to_acc<TY>(dy[c * p.cs[0]]) * (w ? w[c] : 1.f), h[c * p.cs[1]], s);
        s = group_reduce<RG, 1, 0, RG>(s, SumOp());
        const float cf = s * rs * rs * n_inv;
        const float* dh = p.a2 ? res_row<const float>(p, 2, row) : nullptr;
        float* g = res_row<float>(p, 3, row);
        TX* gx = p.a4 ? res_row<TX>(p, 4, row) : nullptr;
        for (i64 c = threadIdx.x; c < p.cols; c += RG) {
            const float d = to_acc<TY>(dy[c * p.cs[0]]);
            const float hv = h[c * p.cs[1]];
            float o = rs * (d * (w ? w[c] : 1.f) - cf * hv);
            if (dh) o += dh[c * p.cs[2]];
            g[c * p.cs[3]] = o;
            if (gx) gx[c * p.cs[4]] = from_acc<TX>(o);
            if (part) part[c] = fmaf(d * hv, rs, part[c]);
        }
    }
}

}  // namespace cl
