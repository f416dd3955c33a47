// The row-wise generic kernel (row_generic), included by rowwise.cu after the register
// kernels: any layout (column stride, mixed alignment) and any length; one block per row,
// reading the row two or three times (the fallback, and the path for rows longer than
// every class).
#pragma once
#include "cupylab_rowwise.cuh"

namespace cl {

// ---- generic kernel: any strides, any length ----------------------------------------------
constexpr int GT = 512;

template <typename T, int OP>
__global__ void __launch_bounds__(GT) row_generic(const RowArgs p) {
    typedef typename Acc<T>::type A;
    const i64 cols = p.cols;
    const A n_inv = A(1) / (A)cols;
    const i64 c0 = p.cs[0], c1 = p.cs[1], c2 = p.cs[2], c3 = p.cs[3];
    for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const T* x = row_ptr<const T>(p.in0, p, 0, row);
        T* y = row_ptr<T>(p.out0, p, 2, row);
        const bool stat_thread = threadIdx.x == 0;
        if constexpr (OP == OP_SOFTMAX || OP == OP_LOG_SOFTMAX || OP == OP_CE) {
            MaxSum<A> ms;
            ms.m = neg_inf<A>();
            ms.s = A(0);
            A sx = A(0);
            i64 t = -1;  // cross-entropy: the target column (-1: ignored or out of range)
            bool ignored = false, bad = false;
            A xt = A(0);
            if constexpr (OP == OP_CE) {  // before the barriers (grad_out may be the logits)
                const i64 tg = load_target<T>(p, row);
                ignored = tg == p.ignore_index;
                bad = !ignored && (tg < 0 || tg >= cols);
                if (!ignored && !bad) {
                    t = tg;
                    xt = to_acc(x[t * c0]);
                }
            }
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                A v = to_acc(x[c * c0]);
                sx += v;
                if (v > ms.m) {
                    // with the max still -inf the sum is 0, or NaN from a NaN seen: kept
                    if (!(ms.m == neg_inf<A>())) ms.s *= exp_row<T>(ms.m - v);
                    ms.m = v;
                }
                // cross-entropy: the target's term is added after the reduction (as row_reg)
                if (!(v == neg_inf<A>()) && (OP != OP_CE || c != t))
                    ms.s += exp_row<T>(v - ms.m);
            }
            ms = group_reduce<GT, 1, 0>(ms, MaxSumOp());
            // cross-entropy: the others' sum, the target's term (an all -inf row: max -inf,
            // sums 0, exp(-inf - 0) = 0; the loss is NaN)
            const A mz = (ms.m == neg_inf<A>()) ? A(0) : ms.m;
            A so = ms.s, et = A(0);
            if constexpr (OP == OP_CE) {
                if (t >= 0) et = exp_row<T>(xt - mz);
                ms.s += et;
            }
            if constexpr (OP == OP_SOFTMAX) {
                const A inv = A(1) / ms.s;
                for (i64 c = threadIdx.x; c < cols; c += GT)
                    y[c * c2] = from_acc<T>(exp_row<T>(to_acc(x[c * c0]) - ms.m) * inv);
            } else if constexpr (OP == OP_LOG_SOFTMAX) {
                const A ls = log_acc(ms.s);
                for (i64 c = threadIdx.x; c < cols; c += GT)
                    y[c * c2] = from_acc<T>((to_acc(x[c * c0]) - ms.m) - ls);
            } else {
                const A eps = (A)p.smooth;
                if (eps > A(0)) sx = group_reduce<GT, 1, 1>(sx, SumOp());
                if (stat_thread)
                    ce_store_loss(p, row, ignored, bad, eps, et, so, ms.s, xt - mz,
                                  sx * n_inv - ms.m, ms.m);
                if (p.out0) {
                    const A scale = p.scale ? *reinterpret_cast<const A*>(p.scale) : A(1);
                    const A inv = A(1) / ms.s;
                    for (i64 c = threadIdx.x; c < cols; c += GT) {
                        A g;
                        if (ignored) g = A(0);
                        else if (bad) g = quiet_nan<A>();
                        else {
                            g = exp_row<T>(to_acc(x[c * c0]) - ms.m) * inv - eps * n_inv;
                            if (c == t) g -= A(1) - eps;
                            g *= scale;
                        }
                        y[c * c2] = from_acc<T>(g);
                    }
                }
            }
        } else if constexpr (OP == OP_RMS || OP == OP_ADD_RMS || OP == OP_LN) {
            // the values normalised: x, or h = x + residual (rounded, written to out1 first)
            const T* src = x;
            i64 cs = c0;
            if constexpr (OP == OP_ADD_RMS) {
                const T* r = row_ptr<const T>(p.in1, p, 1, row);
                T* h = row_ptr<T>(p.out1, p, 3, row);
                for (i64 c = threadIdx.x; c < cols; c += GT)
                    h[c * c3] = from_acc<T>(to_acc(x[c * c0]) + to_acc(r[c * c1]));
                src = h;
                cs = c3;
            }
            A mean = A(0);
            if constexpr (OP == OP_LN) {  // shifted by the first element, then corrected, as row_reg
                const A x0 = to_acc(src[0]);
                A s1 = A(0);
                for (i64 c = threadIdx.x; c < cols; c += GT) s1 += to_acc(src[c * cs]) - x0;
                mean = x0 + group_reduce<GT, 1, 0>(s1, SumOp()) / (A)cols;
            }
            A s2 = A(0), sd = A(0);
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                A d = to_acc(src[c * cs]) - mean;
                s2 += d * d;
                if constexpr (OP == OP_LN) sd += d;
            }
            if constexpr (OP == OP_LN) {
                Sum2<A> acc;
                acc.a = sd;
                acc.b = s2;
                acc = group_reduce<GT, 1, 1>(acc, SumOp());
                const A dm = acc.a * n_inv;
                mean += dm;
                s2 = acc.b - acc.a * dm;
                if (s2 < A(0)) s2 = A(0);
            } else {
                s2 = group_reduce<GT, 1, 1>(s2, SumOp());
            }
            const A rstd = rsqrt_acc(s2 * n_inv + (A)p.eps);
            if (stat_thread) {
                if (p.st0) reinterpret_cast<A*>(p.st0)[row] = mean;
                if (p.st1) reinterpret_cast<A*>(p.st1)[row] = rstd;
            }
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                const A wc = load_w<T>(p, p.w, c, A(1));
                if constexpr (OP == OP_LN)
                    y[c * c2] = from_acc<T>((to_acc(src[c * cs]) - mean) * rstd * wc +
                                            load_w<T>(p, p.b, c, -A(0)));  // as row_reg
                else  // the rms norms: no mean, no bias (as row_reg: -0 stays -0, as in torch)
                    y[c * c2] = from_acc<T>(to_acc(src[c * cs]) * rstd * wc);
            }
        } else if constexpr (OP == OP_SOFTMAX_BWD || OP == OP_LOG_SOFTMAX_BWD) {
            const T* dy = row_ptr<const T>(p.in1, p, 1, row);
            A d = A(0);
            for (i64 c = threadIdx.x; c < cols; c += GT)
                d += (OP == OP_SOFTMAX_BWD ? to_acc(x[c * c0]) : A(1)) * to_acc(dy[c * c1]);
            d = group_reduce<GT, 1, 0>(d, SumOp());
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                A yv = to_acc(x[c * c0]), g = to_acc(dy[c * c1]);
                y[c * c2] = from_acc<T>(OP == OP_SOFTMAX_BWD ? yv * (g - d) : g - exp_row<T>(yv) * d);
            }
        } else {  // OP_RMS_BWD, OP_LN_BWD
            const T* dy = row_ptr<const T>(p.in1, p, 1, row);
            const A mean = OP == OP_LN_BWD ? reinterpret_cast<const A*>(p.st0)[row] : A(0);
            const A rstd = reinterpret_cast<const A*>(p.st1)[row];
            const bool first = row == (i64)blockIdx.x;
            A* pw = reinterpret_cast<A*>(p.part0) + (i64)blockIdx.x * cols;
            A* pb = reinterpret_cast<A*>(p.part1) + (i64)blockIdx.x * cols;
            Sum2<A> acc;
            acc.a = A(0);
            acc.b = A(0);
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                A g = to_acc(dy[c * c1]), xh = (to_acc(x[c * c0]) - mean) * rstd;
                if (p.part0) pw[c] = (first ? A(0) : pw[c]) + g * xh;
                if (OP == OP_LN_BWD && p.part1) pb[c] = (first ? A(0) : pb[c]) + g;
                g *= load_w<T>(p, p.w, c, A(1));
                acc.a += g;
                acc.b += g * xh;
            }
            acc = group_reduce<GT, 1, 0>(acc, SumOp());
            const A k1 = OP == OP_LN_BWD ? acc.a * n_inv : A(0), k2 = acc.b * n_inv;
            for (i64 c = threadIdx.x; c < cols; c += GT) {
                A xh = (to_acc(x[c * c0]) - mean) * rstd;
                y[c * c2] = from_acc<T>(rstd * (to_acc(dy[c * c1]) * load_w<T>(p, p.w, c, A(1)) - k1 - xh * k2));
            }
        }
    }
}

}  // namespace cl
