// Elementwise arithmetic: out = OP(a, b[, c]) for add, sub, mul, div and the fused (a + b) * c.
//
// One template per access pattern, instantiated per (dtype, op) through NVRTC name expressions
// (cupylab/ops/elementwise.py builds the names):
//   ew_contig<T, OP, V, ARR>  all operands contiguous 1-D. V elements per access:
//                          V * sizeof(T) == 16 for the vectorised path (head and tail peeled so
//                          the body is aligned), V == 1 when the operands' alignments differ;
//                          ARR when no operand is a scalar.
//   ew_rows<T, OP>         2-D: rows of 16-byte vectors, each operand a row slice, a row
//                          broadcast or a column broadcast (NumPy's bias-add shapes)
//   ew_strided<T, OP, I>   any strides (negative, zero = broadcast), up to MAXD dims after the
//                          host has merged what it can; I = int or long long index arithmetic.
// An input pointer of nullptr means "this operand is the scalar sX" (a Python number).
#include "cupylab_common.cuh"

namespace cl {

enum Op { OP_ADD = 0, OP_SUB = 1, OP_MUL = 2, OP_DIV = 3, OP_ADD_MUL = 4 };

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

template <typename T, int V>
__device__ __forceinline__ void splat(Vec<T, V>& r, T s) {
#pragma unroll
    for (int k = 0; k < V; ++k) r.v[k] = s;
}

// One thread per V-element vector and no loop. The host passes the operands' pointers to the
// aligned body (base + head elements; nullptr for a scalar operand), the body's vector count
// and how many elements precede (head) and follow (tail) it. Thread t < nvec computes vector t;
// the next head + tail threads compute one peeled element each, at offsets -head .. -1 and
// nvec * V .. nvec * V + tail - 1 from the body. ARR: every operand is an array (no scalar
// checks). Lean on purpose: small and medium launches are bound by their latency, and an
// earlier grid-stride version (632 SASS instructions with a 64-bit trip-count division)
// ran 5-10 % behind torch there (docs/perf.md, "The vectorised kernel").
template <typename T, int OP, int V, bool ARR>
__global__ void __launch_bounds__(256)
ew_contig(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
          const T* __restrict__ c, T sa, T sb, T sc, long long nvec, long long head,
          long long tail) {
    typedef Vec<T, V> VT;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < nvec) {
        VT ra, rb, rc, r;
        if (ARR || a) ra = reinterpret_cast<const VT*>(a)[t]; else splat(ra, sa);
        if (ARR || b) rb = reinterpret_cast<const VT*>(b)[t]; else splat(rb, sb);
        if (OP == OP_ADD_MUL) {
            if (ARR || c) rc = reinterpret_cast<const VT*>(c)[t]; else splat(rc, sc);
        } else {
            rc = ra;
        }
#pragma unroll
        for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra.v[k], rb.v[k], rc.v[k]);
        reinterpret_cast<VT*>(out)[t] = r;
        return;
    }
    long long i = t - nvec - head;  // relative to the body: -head .. -1, then past its end
    if (i >= 0) {
        if (i >= tail) return;
        i += nvec * V;
    }
    out[i] = apply<T, OP>(operand(a, i, sa), operand(b, i, sb), operand(c, i, sc));
}

// Rows: a 2-D view (rows x cols) in which every array operand's inner stride is 1 (a row slice)
// or 0 (one value per row: a column broadcast), rows at any outer stride (0: a row broadcast).
// cols is a multiple of V and every row start is 16-byte aligned, so the inner dimension uses
// 16-byte vectors. One thread per vector and no loop, like ew_contig: x runs along the row,
// row = blockIdx.z * gridDim.y + blockIdx.y (gridDim.y is at most 65535).
// `inner` has bit k set when operand k (a, b, c) has inner stride 1.
template <typename T>
__device__ __forceinline__ void load_row_vec(Vec<T, 16 / sizeof(T)>& r, const T* __restrict__ p,
                                             long long row, long long stride, long long col,
                                             bool inner, T s) {
    constexpr int V = 16 / sizeof(T);
    if (!p) {
        splat(r, s);
    } else if (inner) {
        r = *reinterpret_cast<const Vec<T, V>*>(p + row * stride + col);
    } else {
        splat(r, p[row * stride]);
    }
}

template <typename T, int OP>
__global__ void __launch_bounds__(256)
ew_rows(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
        const T* __restrict__ c, T sa, T sb, T sc, long long rows, long long cols, long long so,
        long long s_a, long long s_b, long long s_c, int inner) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const long long r = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || j >= cols / V) return;
    VT ra, rb, rc, ro;
    load_row_vec(ra, a, r, s_a, j * V, inner & 1, sa);
    load_row_vec(rb, b, r, s_b, j * V, inner & 2, sb);
    if (OP == OP_ADD_MUL) load_row_vec(rc, c, r, s_c, j * V, inner & 4, sc);
    else rc = ra;
#pragma unroll
    for (int k = 0; k < V; ++k) ro.v[k] = apply<T, OP>(ra.v[k], rb.v[k], rc.v[k]);
    *reinterpret_cast<VT*>(out + r * so + j * V) = ro;
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
