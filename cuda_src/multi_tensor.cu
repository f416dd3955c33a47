// Multi-tensor operators: foreach arithmetic, norms, mixed-precision checks and fused
// optimizer steps, each an Op for the one launcher `cl::mt::mt_apply<Op, U>`
// (cupylab_multi_tensor.cuh), instantiated through NVRTC name expressions built by
// cupylab/ops/_mt_plan.py. The reductions (sum of squares per chunk, then one small
// deterministic finishing kernel) are the only other kernels.
#include "cupylab_multi_tensor.cuh"

namespace cl {
namespace mt {

enum EwOp { EW_ADD = 0, EW_ADD_SCALAR = 1, EW_MUL = 2, EW_MUL_SCALAR = 3, EW_LERP = 4,
            EW_ZERO = 5 };

template <typename C>
__device__ __forceinline__ bool finite(C x) { return x - x == C(0); }

template <typename C>
__device__ __forceinline__ C dev_scalar(u64 p, double fallback) {
    return p ? (C)(*reinterpret_cast<const float*>(p)) : (C)fallback;
}

// ---------------------------------------------------------------------------------------------
// foreach arithmetic. In place: slot 0 is x and the output, slot 1 is y. Otherwise slot 0 is the
// output, 1 is x, 2 is y. s[0]: alpha / scalar / weight; p[0]: that scalar on the device
// (MUL_SCALAR), a float32, or a float64 when s[2] != 0; s[1] != 0 with p[0]: skip the launch
// when the device scalar is exactly 1 (only for in-place scaling, where multiplying by 1
// changes nothing).
template <typename T, int OP, bool INPLACE>
struct Ew : OpBase {
    typedef T L0;
    typedef T L1;
    typedef T L2;
    typedef typename Comp<T>::type C;
    static constexpr int X = INPLACE ? 0 : 1;
    static constexpr bool HAS_Y = OP == EW_ADD || OP == EW_MUL || OP == EW_LERP;
    static constexpr int NL = OP == EW_ZERO ? 1 : X + 1 + (HAS_Y ? 1 : 0);
    static constexpr unsigned READ = OP == EW_ZERO ? 0u : ((1u << X) | (HAS_Y ? 1u << (X + 1) : 0u));
    static constexpr unsigned WRITE = 1u;
    C s;
    __device__ __forceinline__ bool prepare(const Args& a) {
        s = (a.p[0] && a.s[2] != 0.0) ? (C)*reinterpret_cast<const double*>(a.p[0])
                                      : dev_scalar<C>(a.p[0], a.s[0]);
        return !(a.p[0] && a.s[1] != 0.0 && s == C(1));
    }
    __device__ __forceinline__ void operator()(C (&v)[5]) const {
        const C x = v[X];
        const C y = HAS_Y ? v[X + 1] : C(0);
        C r;
        if (OP == EW_ADD) r = x + s * y;
        else if (OP == EW_ADD_SCALAR) r = x + s;
        else if (OP == EW_MUL) r = x * y;
        else if (OP == EW_MUL_SCALAR) r = x * s;
        else if (OP == EW_LERP) r = fabs(s) < C(0.5) ? x + s * (y - x) : y - (y - x) * (C(1) - s);
        else r = C(0);
        v[0] = r;
    }
};

// out (slot 0, TO) = x (slot 1, TI), converted.
template <typename TO, typename TI>
struct Copy : OpBase {
    typedef TO L0;
    typedef TI L1;
    typedef double C;
    static constexpr int NL = 2;
    static constexpr unsigned READ = 2u, WRITE = 1u;
    __device__ __forceinline__ bool prepare(const Args&) { return true; }
    __device__ __forceinline__ void operator()(C (&v)[5]) const { v[0] = v[1]; }
};

// x *= inv_scale (s[0], or the device float32 at p[0]); *p[2] = 1 when any x was not finite
// (torch's _amp_foreach_non_finite_check_and_unscale_). CHECK_ONLY: no write.
template <typename T, bool CHECK_ONLY>
struct Unscale : OpBase {
    typedef T L0;
    typedef typename Comp<T>::type C;
    static constexpr int NL = 1;
    static constexpr unsigned READ = 1u, WRITE = CHECK_ONLY ? 0u : 1u;
    C inv;
    bool bad;
    __device__ __forceinline__ bool prepare(const Args& a) {
        inv = dev_scalar<C>(a.p[0], a.s[0]);
        bad = false;
        return true;
    }
    __device__ __forceinline__ void operator()(C (&v)[5]) {
        bad |= !finite(v[0]);
        v[0] = v[0] * inv;
    }
    __device__ __forceinline__ void finish(const Args& a) {
        if (bad && a.p[2]) *reinterpret_cast<float*>(a.p[2]) = 1.0f;
    }
};

// ---------------------------------------------------------------------------------------------
// optimizers. Common: p[0] lr (device float32, else s[0]), p[2] found_inf (device float32:
// nonzero skips the whole step), p[3] grad scale (device float32: grads are divided by it).
template <typename C>
struct StepCommon {
    C lr, gs;  // gs: the gradient scale, 0 when none; gradients are divided by it, as torch
    __device__ __forceinline__ bool common(const Args& a) {
        if (a.p[2] && *reinterpret_cast<const float*>(a.p[2]) != 0.0f) return false;
        lr = dev_scalar<C>(a.p[0], a.s[0]);
        gs = a.p[3] ? (C)*reinterpret_cast<const float*>(a.p[3]) : C(0);
        return true;
    }
    // the gradient unscaled: a division (not a multiplication by 1/gs, which is 1 ulp off for
    // scales that are not powers of two), skipped without a scale (a uniform branch)
    __device__ __forceinline__ C unscale(C g) const { return gs != C(0) ? g / gs : g; }
};

// Adam / AdamW (torch's fused math, in float). Slots: 0 param (P), 1 grad (P), 2 exp_avg (S),
// 3 exp_avg_sq (S), 4 fp32 master copy (MASTER: updated, and the param is its rounding).
// s: 0 lr, 1 beta1, 2 beta2, 3 eps, 4 weight_decay, 5 bias_correction1,
// 6 sqrt(bias_correction2), 7 maximize. p[1]: device float32 step (bias corrections computed
// here, from the device lr and step).
template <typename P, typename S, bool MASTER, bool ADAMW>
struct Adam : OpBase, StepCommon<typename Comp<P>::type> {
    typedef P L0;
    typedef P L1;
    typedef S L2;
    typedef S L3;
    typedef typename Comp<P>::type C;
    typedef StepCommon<C> Base;
    using Base::lr;
    using Base::gs;
    using Base::common;
    static constexpr int NL = 5;
    static constexpr unsigned READ = MASTER ? 0x1Eu : 0x0Fu;
    static constexpr unsigned WRITE = MASTER ? 0x1Du : 0x0Du;
    C b1, b2, eps, wd, step_size, bc2s;
    bool maximize;
    __device__ __forceinline__ bool prepare(const Args& a) {
        if (!common(a)) return false;
        b1 = (C)a.s[1];
        b2 = (C)a.s[2];
        eps = (C)a.s[3];
        wd = (C)a.s[4];
        maximize = a.s[7] != 0.0;
        const double lrd = a.p[0] ? (double)lr : a.s[0];
        double bc1, b2s;
        if (a.p[1]) {
            const double step = (double)*reinterpret_cast<const float*>(a.p[1]);
            bc1 = 1.0 - pow(a.s[1], step);
            b2s = sqrt(1.0 - pow(a.s[2], step));
        } else {
            bc1 = a.s[5];
            b2s = a.s[6];
        }
        step_size = (C)(lrd / bc1);
        bc2s = (C)b2s;
        return true;
    }
    __device__ __forceinline__ void operator()(C (&v)[5]) const {
        C p = MASTER ? v[4] : v[0];
        C g = Base::unscale(v[1]);
        if (maximize) g = -g;
        if (wd != 0.0f) {
            if (ADAMW) p -= lr * wd * p;
            else g += wd * p;
        }
        const C m = b1 * v[2] + (1.0f - b1) * g;
        const C s = b2 * v[3] + (1.0f - b2) * g * g;
        const C denom = sqrt(s) / bc2s + eps;
        p -= step_size * m / denom;
        v[0] = p;
        v[2] = m;
        v[3] = s;
        v[4] = p;
    }
};

// SGD (momentum, dampening, Nesterov, weight decay, maximize). Slots: 0 param, 1 grad,
// 2 momentum buffer (S; MOM only), 3 fp32 master. s: 0 lr, 1 momentum, 2 dampening,
// 3 weight_decay, 4 nesterov, 5 maximize, 6 first step (buffer := gradient).
template <typename P, typename S, bool MASTER, bool MOM>
struct Sgd : OpBase, StepCommon<typename Comp<P>::type> {
    typedef P L0;
    typedef P L1;
    typedef S L2;
    typedef typename Comp<P>::type C;
    typedef StepCommon<C> Base;
    using Base::lr;
    using Base::gs;
    using Base::common;
    static constexpr int NL = 4;
    static constexpr unsigned READ = 0x2u | (MOM ? 0x4u : 0u) | (MASTER ? 0x8u : 0x1u);
    static constexpr unsigned WRITE = 0x1u | (MOM ? 0x4u : 0u) | (MASTER ? 0x8u : 0u);
    C mom, damp, wd;
    bool nesterov, maximize, first;
    __device__ __forceinline__ bool prepare(const Args& a) {
        if (!common(a)) return false;
        mom = (C)a.s[1];
        damp = (C)a.s[2];
        wd = (C)a.s[3];
        nesterov = a.s[4] != 0.0;
        maximize = a.s[5] != 0.0;
        first = a.s[6] != 0.0;
        return true;
    }
    __device__ __forceinline__ void operator()(C (&v)[5]) const {
        C p = MASTER ? v[3] : v[0];
        C g = Base::unscale(v[1]);
        if (maximize) g = -g;
        if (wd != 0.0f) g += wd * p;
        if (MOM) {
            const C b = first ? g : mom * v[2] + (1.0f - damp) * g;
            v[2] = b;
            g = nesterov ? g + mom * b : b;
        }
        p -= lr * g;
        v[0] = p;
        v[3] = p;
    }
};

// Lion (Chen et al. 2023): update = sign(b1 m + (1 - b1) g); p = p (1 - lr wd) - lr update;
// m = b2 m + (1 - b2) g. Slots: 0 param, 1 grad, 2 exp_avg (S), 3 fp32 master.
// s: 0 lr, 1 beta1, 2 beta2, 3 weight_decay, 4 maximize.
template <typename P, typename S, bool MASTER>
struct Lion : OpBase, StepCommon<typename Comp<P>::type> {
    typedef P L0;
    typedef P L1;
    typedef S L2;
    typedef typename Comp<P>::type C;
    typedef StepCommon<C> Base;
    using Base::lr;
    using Base::gs;
    using Base::common;
    static constexpr int NL = 4;
    static constexpr unsigned READ = 0x6u | (MASTER ? 0x8u : 0x1u);
    static constexpr unsigned WRITE = 0x5u | (MASTER ? 0x8u : 0u);
    C b1, b2, wd;
    bool maximize;
    __device__ __forceinline__ bool prepare(const Args& a) {
        if (!common(a)) return false;
        b1 = (C)a.s[1];
        b2 = (C)a.s[2];
        wd = (C)a.s[3];
        maximize = a.s[4] != 0.0;
        return true;
    }
    __device__ __forceinline__ void operator()(C (&v)[5]) const {
        C p = MASTER ? v[3] : v[0];
        C g = Base::unscale(v[1]);
        if (maximize) g = -g;
        const C c = b1 * v[2] + (1.0f - b1) * g;
        // sign(c) as torch.sign: NaN stays NaN (a NaN gradient makes the parameter NaN, not
        // a silent zero update)
        const C u = c > 0.0f ? C(1) : (c < 0.0f ? C(-1) : (c == 0.0f ? C(0) : c));
        p = p * (1.0f - lr * wd) - lr * u;
        v[2] = b2 * v[2] + (1.0f - b2) * g;
        v[0] = p;
        v[3] = p;
    }
};

// step[i] += 1 unless *found_inf is nonzero (the capturable optimizers' step counter).
__global__ void mt_step_inc(float* step, int n, const float* found_inf) {
    if (found_inf && *found_inf != 0.0f) return;
    for (int i = threadIdx.x; i < n; i += blockDim.x) step[i] += 1.0f;
}

// ---------------------------------------------------------------------------------------------
// norms: partial[blockIdx.x] = sum of squares of the block's chunk (one list), then
// mt_norm_finish adds the partials per tensor (one warp each) and over everything (the whole
// block), in a fixed order: the result does not depend on timing.
template <typename T>
__global__ void __launch_bounds__(BLOCK)
mt_sumsq(const long long* __restrict__ tab, const int2* __restrict__ map, long long chunk,
         double* __restrict__ partial) {
    typedef typename Comp<T>::type C;
    __shared__ C red[BLOCK / 32];
    char* base[5];
    long long start;
    int len;
    bool aligned;
    locate<1>(tab, map, chunk, base, start, len, aligned);
    C acc = C(0);
    int done = 0;
    if (aligned) {
        const int nv = len >> 2;
        for (int q = threadIdx.x; q < nv; q += BLOCK) {
            C x[4];
            ld4<T, C>(base[0], start + 4LL * q, x);
            acc += x[0] * x[0] + x[1] * x[1] + x[2] * x[2] + x[3] * x[3];
        }
        done = nv << 2;
    }
    for (int r = done + threadIdx.x; r < len; r += BLOCK) {
        const C x = ld1<T, C>(base[0], start + r);
        acc += x * x;
    }
    const C t = block_sum<C>(acc, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = (double)t;
}

// tb: per tensor, [first block, end block) into `partial`. Writes (each optional):
// per_tensor[t] = sqrt(sum over t's blocks); *total = sqrt(sum over all blocks);
// *coef = min(1, max_norm / (total + eps)) in float64 (clip_grad_norm_'s factor, NaN when the
// total is).
template <typename O>
__global__ void __launch_bounds__(1024)
mt_norm_finish(const double* __restrict__ partial, int nblocks, const int2* __restrict__ tb,
               int nt, O* per_tensor, O* total, double* coef, double max_norm, double eps) {
    __shared__ double red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (per_tensor) {
        for (int t = warp; t < nt; t += nwarps) {
            const int2 r = tb[t];
            double s = 0.0;
            for (int b = r.x + lane; b < r.y; b += 32) s += partial[b];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) per_tensor[t] = (O)sqrt(s);
        }
    }
    if (total || coef) {
        double s = 0.0;
        for (int b = threadIdx.x; b < nblocks; b += blockDim.x) s += partial[b];
        const double t = block_sum<double>(s, red);
        if (threadIdx.x == 0) {
            const double norm = sqrt(t);
            if (total) *total = (O)norm;
            if (coef) {
                const double c = max_norm / (norm + eps);
                *coef = c < 1.0 ? c : (c == c ? 1.0 : c);
            }
        }
    }
}

}  // namespace mt
}  // namespace cl
