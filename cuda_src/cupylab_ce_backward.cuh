// Cross-entropy backward from the forward's per-row log-sum-exp (rowwise.cu includes this
// after ce_aux): one read of the logits and one write of the gradient, no reduction.
//
//   dlogits[r, c] = g_r * (exp(x[r, c] - lse[r]) - eps / n - (1 - eps) * [c == t_r])
//
// with g_r = dloss_r * scale: dloss_r from p.loss through operand slot 3's row strides (zero
// strides for one value; T when flags & 8, else the accumulation type), or the number p.eps
// when p.loss is 0; scale = p.scale[0] (1 / count of the rows not ignored, ce_aux) for the
// mean, else 1. An ignored row's gradient is 0 and a bad target's (t < 0 or t >= n) NaN,
// written without reading the row, as the forward's gradient.
//
// Grid: blockIdx.x over rows, blockIdx.y over tiles of CEB_U * CEB_THREADS 16-byte slots of a
// row (both grid-stride). Rows whose logits and gradient have a unit column stride and the
// same 16-byte alignment go by 16-byte vectors (the slots of cupylab_rowwise.cuh: slot s
// covers word s of the row's aligned base, partial words at the ends element by element);
// any other layout element by element with the column strides.
#pragma once

namespace cl {

constexpr int CEB_THREADS = 256, CEB_U = 4;

template <typename T>
__global__ void __launch_bounds__(CEB_THREADS) ce_backward(const RowArgs p) {
    typedef typename Acc<T>::type A;
    constexpr int V = 16 / sizeof(T);
    constexpr i64 TILE = CEB_THREADS * CEB_U;  // slots
    const i64 cols = p.cols;
    const A eps = (A)p.smooth;
    const A sub = eps / (A)cols, hit = A(1) - eps;
    const A scale = p.scale ? *reinterpret_cast<const A*>(p.scale) : A(1);
    for (i64 row = blockIdx.x; row < p.rows; row += gridDim.x) {
        const i64 t = load_target<T>(p, row);
        const bool ignored = t == p.ignore_index;
        const bool fill = ignored || t < 0 || t >= cols;
        A g = (A)p.eps;
        if (p.loss)
            g = (p.flags & 8) ? (A)to_acc(*row_ptr<const T>(p.loss, p, 3, row))
                              : *row_ptr<const A>(p.loss, p, 3, row);
        g *= scale;
        const A lse = reinterpret_cast<const A*>(p.st0)[row];
        const T* x = row_ptr<const T>(p.in0, p, 0, row);
        T* y = row_ptr<T>(p.out0, p, 2, row);
        const T fv = from_acc<T>(ignored ? A(0) : quiet_nan<A>());
        const bool vec = p.cs[0] == 1 && p.cs[2] == 1 && row_head(x) == row_head(y);
        if (vec) {
            const int head = row_head(x);
            const T* xa = x - head;
            T* ya = y - head;
            const i64 nslots = (cols + head + V - 1) / V;
            for (i64 s0 = (i64)blockIdx.y * TILE; s0 < nslots; s0 += (i64)gridDim.y * TILE) {
                Vec<T, V> v[CEB_U];
                if (!fill) {
#pragma unroll
                    for (int u = 0; u < CEB_U; ++u) {  // every load in flight before the math
                        const i64 s = s0 + u * CEB_THREADS + threadIdx.x;
                        const i64 e0 = s * V - head;
                        if (s >= nslots) continue;
                        if (e0 >= 0 && e0 + V <= cols) {
                            v[u] = *reinterpret_cast<const Vec<T, V>*>(xa + s * V);
                        } else {
#pragma unroll
                            for (int k = 0; k < V; ++k)
                                v[u].v[k] = (e0 + k >= 0 && e0 + k < cols) ? xa[s * V + k] : T();
                        }
                    }
                }
#pragma unroll
                for (int u = 0; u < CEB_U; ++u) {
                    const i64 s = s0 + u * CEB_THREADS + threadIdx.x;
                    const i64 e0 = s * V - head;
                    if (s >= nslots) continue;
                    if (fill) {
#pragma unroll
                        for (int k = 0; k < V; ++k) v[u].v[k] = fv;
                    } else {
                        A f[V];
                        unpack<T, V>(v[u], f);
#pragma unroll
                        for (int k = 0; k < V; ++k) {
                            A d = exp_row<T>(f[k] - lse) - sub;
                            if (e0 + k == t) d -= hit;
                            f[k] = d * g;
                        }
                        pack<T, V>(f, v[u]);
                    }
                    if (e0 >= 0 && e0 + V <= cols) {
                        *reinterpret_cast<Vec<T, V>*>(ya + s * V) = v[u];
                    } else {
#pragma unroll
                        for (int k = 0; k < V; ++k)
                            if (e0 + k >= 0 && e0 + k < cols) ya[s * V + k] = v[u].v[k];
                    }
                }
            }
        } else {
            for (i64 c = (i64)blockIdx.y * CEB_THREADS + threadIdx.x; c < cols;
                 c += (i64)gridDim.y * CEB_THREADS) {
                T r = fv;
                if (!fill) {
                    A d = exp_row<T>((A)to_acc(x[c * p.cs[0]]) - lse) - sub;
                    if (c == t) d -= hit;
                    r = from_acc<T>(d * g);
                }
                y[c * p.cs[2]] = r;
            }
        }
    }
}

}  // namespace cl
