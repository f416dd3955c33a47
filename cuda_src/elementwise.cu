// Elementwise arithmetic: out = OP(a, b[, c]) for add, sub, mul, div and the fused (a + b) * c.
//
// One template per access pattern, instantiated per (dtype, op) through NVRTC name expressions
// (cupylab/ops/elementwise.py builds the names):
//   ew_contig<T, OP, V>    all operands contiguous 1-D. V elements per access: V * sizeof(T) == 16
//                          for the vectorised path (head and tail peeled so the body is aligned),
//                          V == 1 when the operands' alignments differ.
//   ew_rows<T, OP>         2-D: rows of 16-byte vectors, each operand a row slice, a row
//                          broadcast or a column broadcast (NumPy's bias-add shapes)
//   ew_strided<T, OP, I>   any strides (negative, zero = broadcast), up to MAXD dims after the
//                          host has merged what it can; I = int or long long index arithmetic.
// An input pointer of nullptr means "this operand is the scalar sX" (a Python number).
#include "cupylab_common.cuh"

namespace cl {

enum Op { OP_ADD = 0, OP_SUB = 1, OP_MUL = 2, OP_DIV = 3, OP_ADD_MUL = 4 };

// 16-byte vectors per thread per grid-stride step on the vectorised path: all of a step's loads
// are issued before the first use, so UNROLL x 16 B per operand are in flight per thread.
// The host passes the values it sizes the grid with (-D options from ops/elementwise.py, which
// also says why they are what they are); these defaults match.
#ifndef CL_UNROLL16
#define CL_UNROLL16 1
#endif
#ifndef CL_UNROLL
#define CL_UNROLL 1
#endif
#ifndef CL_MIN_BLOCKS
#define CL_MIN_BLOCKS 1
#endif
template <typename T> struct Unroll {
    static constexpr int value = sizeof(T) == 2 ? CL_UNROLL16 : CL_UNROLL;
};
#define CL_MAXD 8

template <typename T, int OP, bool INT = IsInt<T>::value>
struct Apply;

// Floating point (float, double, and 16-bit types through float).
template <typename T, int OP>
struct Apply<T, OP, false> {
    typedef typename Acc<T>::type A;
    static __device__ __forceinline__ A run(A a, A b, A c) {
        if (OP == OP_ADD) return a + b;
        if (OP == OP_SUB) return a - b;
        if (OP == OP_MUL) return a * b;
        if (OP == OP_DIV) return a / b;
        return (a + b) * c;
    }
};

// Integers: wrap-around add/sub/mul; div is floor division (Python //, numpy.floor_divide)
// with x // 0 == 0 (NumPy's result) and MIN // -1 == MIN (wraps, as in NumPy).
template <typename T, int OP>
struct Apply<T, OP, true> {
    typedef typename Unsigned<T>::type U;
    static __device__ __forceinline__ T run(T a, T b, T c) {
        if (OP == OP_ADD) return (T)((U)a + (U)b);
        if (OP == OP_SUB) return (T)((U)a - (U)b);
        if (OP == OP_MUL) return (T)((U)a * (U)b);
        if (OP == OP_DIV) {
            if (b == 0) return (T)0;
            if (b == (T)-1) return (T)((U)0 - (U)a);
            T q = a / b;
            if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
            return q;
        }
        return (T)(((U)a + (U)b) * (U)c);
    }
};

template <typename T, int OP>
__device__ __forceinline__ T apply(T a, T b, T c) {
    typedef typename Acc<T>::type A;
    return from_acc<T>(Apply<T, OP>::run(to_acc<T>(a), to_acc<T>(b), to_acc<T>(c)));
}

template <typename T>
__device__ __forceinline__ T operand(const T* p, long long i, T s) {
    return p ? p[i] : s;
}

// At least CL_MIN_BLOCKS blocks per SM: every variant then fits without spills (docs/perf.md
// has the compiler's resource report; scripts/tune_elementwise.py times the alternatives).
template <typename T, int OP, int V>
__global__ void __launch_bounds__(256, CL_MIN_BLOCKS)
ew_contig(T* out, const T* a, const T* b, const T* c, T sa, T sb, T sc, long long n, long long head) {
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    // Head: the first `head` elements, before the first 16-byte boundary of every operand.
    if (tid < head) {
        out[tid] = apply<T, OP>(operand(a, tid, sa), operand(b, tid, sb), operand(c, tid, sc));
    }
    const long long nvec = (n - head) / V;
    const long long tail = head + nvec * V;
    // Tail: what is left after the last whole vector (fewer than V elements).
    if (tid < n - tail) {
        const long long i = tail + tid;
        out[i] = apply<T, OP>(operand(a, i, sa), operand(b, i, sb), operand(c, i, sc));
    }
    typedef Vec<T, V> VT;
    const VT* va = reinterpret_cast<const VT*>(a + head);
    const VT* vb = reinterpret_cast<const VT*>(b + head);
    const VT* vc = reinterpret_cast<const VT*>(c + head);
    VT* vo = reinterpret_cast<VT*>(out + head);
    constexpr int U = Unroll<T>::value;
    const long long step = (long long)gridDim.x * blockDim.x * U;
    for (long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x; base < nvec;
         base += step) {
        VT ra[U], rb[U], rc[U];
        // All loads first, so U * (inputs) 16-byte requests are in flight at once.
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < nvec) {
                if (a) ra[u] = va[j]; else { for (int k = 0; k < V; ++k) ra[u].v[k] = sa; }
                if (b) rb[u] = vb[j]; else { for (int k = 0; k < V; ++k) rb[u].v[k] = sb; }
                if (OP == OP_ADD_MUL) {
                    if (c) rc[u] = vc[j]; else { for (int k = 0; k < V; ++k) rc[u].v[k] = sc; }
                } else {
                    rc[u] = ra[u];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long j = base + (long long)u * blockDim.x;
            if (j < nvec) {
                VT r;
#pragma unroll
                for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra[u].v[k], rb[u].v[k], rc[u].v[k]);
                vo[j] = r;
            }
        }
    }
}

// Rows: a 2-D view (rows x cols) in which every array operand's inner stride is 1 (a row slice)
// or 0 (one value per row: a column broadcast), rows at any outer stride (0: a row broadcast).
// cols is a multiple of V and every row start is 16-byte aligned, so the inner dimension uses
// 16-byte vectors; a 2-D grid (x over the row, y over rows) needs no index division.
// `inner` has bit k set when operand k (a, b, c) has inner stride 1.
template <typename T>
__device__ __forceinline__ void load_row_vec(Vec<T, 16 / sizeof(T)>& r, const T* p, long long row,
                                             long long stride, long long col, bool inner, T s) {
    constexpr int V = 16 / sizeof(T);
    if (!p) {
        for (int k = 0; k < V; ++k) r.v[k] = s;
    } else if (inner) {
        r = *reinterpret_cast<const Vec<T, V>*>(p + row * stride + col);
    } else {
        const T x = p[row * stride];
        for (int k = 0; k < V; ++k) r.v[k] = x;
    }
}

template <typename T, int OP>
__global__ void __launch_bounds__(256)
ew_rows(T* out, const T* a, const T* b, const T* c, T sa, T sb, T sc, long long rows,
        long long cols, long long so, long long s_a, long long s_b, long long s_c, int inner) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const long long cvec = cols / V;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < cvec;
             j += (long long)gridDim.x * blockDim.x) {
            VT ra, rb, rc, ro;
            load_row_vec(ra, a, r, s_a, j * V, inner & 1, sa);
            load_row_vec(rb, b, r, s_b, j * V, inner & 2, sb);
            if (OP == OP_ADD_MUL) load_row_vec(rc, c, r, s_c, j * V, inner & 4, sc);
            else rc = ra;
#pragma unroll
            for (int k = 0; k < V; ++k) ro.v[k] = apply<T, OP>(ra.v[k], rb.v[k], rc.v[k]);
            *reinterpret_cast<VT*>(out + r * so + j * V) = ro;
        }
    }
}

template <typename I>
struct Dims { I v[CL_MAXD]; };

template <typename T, int OP, typename I>
__global__ void __launch_bounds__(256)
ew_strided(T* out, const T* a, const T* b, const T* c, T sa, T sb, T sc, I n, int ndim,
           Dims<I> shape, Dims<I> so, Dims<I> s_a, Dims<I> s_b, Dims<I> s_c) {
    const I step = (I)gridDim.x * (I)blockDim.x;
    for (I i = (I)blockIdx.x * (I)blockDim.x + (I)threadIdx.x; i < n; i += step) {
        I rem = i, oo = 0, oa = 0, ob = 0, oc = 0;
#pragma unroll
        for (int d = CL_MAXD - 1; d >= 0; --d) {
            if (d < ndim) {
                const I coord = rem % shape.v[d];
                rem /= shape.v[d];
                oo += coord * so.v[d];
                oa += coord * s_a.v[d];
                ob += coord * s_b.v[d];
                oc += coord * s_c.v[d];
            }
        }
        out[oo] = apply<T, OP>(a ? a[oa] : sa, b ? b[ob] : sb, c ? c[oc] : sc);
    }
}

}  // namespace cl
