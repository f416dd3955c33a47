// Elementwise arithmetic with NumPy's semantics: out = OP(a, b[, c]) for add, subtract, multiply,
// true_divide, floor_divide, the fused (a + b) * c, and copy (out = a, a cast).
//
// Every operand is read in its own dtype and converted in registers to the computation dtype
// CT (the dtype NumPy's type resolution chose); the result is computed in CT (16-bit floats in
// float, rounded once to CT) and converted to the output's dtype TO when it differs (NumPy's
// "compute, then cast into out"). A scalar operand is passed already converted to CT, with its
// pointer nullptr and its type parameter CT.
//
// One template per access pattern; cupylab/ops/elementwise.py compiles each instance it needs
// as a program of its own (NVRTC name expressions) and passes the operator codes and CL_MAXD as
// -D options, so Python holds the one definition of both:
//   ew_contig<TO, TA, TB, TC, CT, OP, V, ARR>  all operands contiguous 1-D; V elements per
//       thread, V * the largest item size == 16 (16-byte accesses for the widest operand, V *
//       itemsize bytes for the narrower ones); V == 1 when the alignments differ; ARR when no
//       operand is a scalar.
//   ew_rows<TO, TA, TB, TC, CT, OP, V>  2-D: each operand a row slice, a row broadcast or a
//       column broadcast (NumPy's bias-add shapes), V elements per access along the row.
//   ew_strided<TO, TA, TB, TC, CT, OP, I>  any strides (negative, zero = broadcast), up to
//       CL_MAXD dims after the host has merged what it can; I = int or long long indices.
#include "cupylab_common.cuh"

#if !defined(CL_MAXD) || !defined(CL_OP_ADD)
#error "elementwise.cu is compiled by cupylab.ops.elementwise, which defines CL_MAXD and CL_OP_*"
#endif

namespace cl {

enum Op {
    OP_ADD = CL_OP_ADD, OP_SUB = CL_OP_SUBTRACT, OP_MUL = CL_OP_MULTIPLY,
    OP_DIV = CL_OP_TRUE_DIVIDE, OP_FLOORDIV = CL_OP_FLOOR_DIVIDE,
    OP_ADD_MUL = CL_OP_FUSED_ADD_MUL, OP_COPY = CL_OP_COPY
};

// NumPy's floor division of floats (npy_divmod): x // 0 is x / 0 (inf or nan), the quotient of
// (a - fmod(a, b)) / b corrected toward -inf, a signed zero when it is zero.
template <typename F>
__device__ __forceinline__ F floordiv_float(F a, F b) {
    if (b == (F)0) return a / b;
    const F mod = fmod(a, b);
    F div = (a - mod) / b;
    if (mod != (F)0 && ((b < (F)0) != (mod < (F)0))) div -= (F)1;
    if (div == (F)0) return copysign((F)0, a / b);
    F fl = floor(div);
    if (div - fl > (F)0.5) fl += (F)1;
    return fl;
}

// Complex division as NumPy computes it (Smith's method; 0 / 0 gives nan, x / 0 inf).
template <typename C>
__device__ __forceinline__ C cdiv(C a, C b) {
    typedef decltype(a.re) R;
    const R abr = b.re < 0 ? -b.re : b.re, abi = b.im < 0 ? -b.im : b.im;
    if (abr >= abi) {
        if (abr == (R)0 && abi == (R)0) return C{a.re / abr, a.im / abr};
        const R rat = b.im / b.re, scl = (R)1 / (b.re + b.im * rat);
        return C{(a.re + a.im * rat) * scl, (a.im - a.re * rat) * scl};
    }
    const R rat = b.re / b.im, scl = (R)1 / (b.im + b.re * rat);
    return C{(a.re * rat + a.im) * scl, (a.im * rat - a.re) * scl};
}

template <typename C>
__device__ __forceinline__ C cmul(C a, C b) {
    return C{a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re};
}

// The operator on values of the accumulator type A (Acc<CT>): wrap-around integers, NumPy's
// integer floor division (x // 0 == 0, MIN // -1 == MIN), bool add = or, multiply = and.
// Combinations NumPy refuses (bool subtract, complex floor division, integer true division)
// are refused by the host; they compile to something harmless so every instance builds.
template <typename A, int OP>
__device__ __forceinline__ A compute(A a, A b, A c) {
    if constexpr (OP == OP_COPY) {
        return a;
    } else if constexpr (IsComplex<A>::value) {
        if constexpr (OP == OP_ADD) return A{a.re + b.re, a.im + b.im};
        else if constexpr (OP == OP_SUB) return A{a.re - b.re, a.im - b.im};
        else if constexpr (OP == OP_MUL) return cmul(a, b);
        else if constexpr (OP == OP_DIV || OP == OP_FLOORDIV) return cdiv(a, b);
        else return cmul(A{a.re + b.re, a.im + b.im}, c);
    } else if constexpr (IsSame<A, bool>::value) {
        if constexpr (OP == OP_ADD) return a || b;
        else if constexpr (OP == OP_SUB) return a != b;
        else if constexpr (OP == OP_ADD_MUL) return (a || b) && c;
        else return a && b;
    } else if constexpr (IsInt<A>::value) {
        typedef typename Unsigned<A>::type U;
        if constexpr (OP == OP_ADD) return (A)((U)a + (U)b);
        else if constexpr (OP == OP_SUB) return (A)((U)a - (U)b);
        else if constexpr (OP == OP_MUL) return (A)((U)a * (U)b);
        else if constexpr (OP == OP_ADD_MUL) return (A)((U)((U)a + (U)b) * (U)c);
        else {
            if (b == (A)0) return (A)0;
            if constexpr (IsSigned<A>::value) {
                if (b == (A)-1) return (A)((U)0 - (U)a);
                A q = a / b;
                if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1;
                return q;
            } else {
                return a / b;
            }
        }
    } else {
        if constexpr (OP == OP_ADD) return a + b;
        else if constexpr (OP == OP_SUB) return a - b;
        else if constexpr (OP == OP_MUL) return a * b;
        else if constexpr (OP == OP_DIV) return a / b;
        else if constexpr (OP == OP_FLOORDIV) return floordiv_float(a, b);
        else return (a + b) * c;
    }
}

template <int OP> struct Reads { static constexpr int n = OP == OP_COPY ? 1 : (OP == OP_ADD_MUL ? 3 : 2); };

template <typename CT>
using AccT = typename Acc<CT>::type;

template <typename CT, typename T>
__device__ __forceinline__ AccT<CT> load(T v) {
    return to_acc<CT>(cvt<CT>(v));
}

template <typename TO, typename CT, int OP>
__device__ __forceinline__ TO result(AccT<CT> a, AccT<CT> b, AccT<CT> c) {
    return cvt<TO>(from_acc<CT>(compute<AccT<CT>, OP>(a, b, c)));
}

// V elements of operand p (vector t), converted; a splat of the scalar s when p is nullptr.
template <typename CT, typename T, int V, bool ARR>
__device__ __forceinline__ void load_vec(AccT<CT> (&x)[V], const T* __restrict__ p, long long t,
                                         CT s) {
    if (ARR || p) {
        const Vec<T, V> r = reinterpret_cast<const Vec<T, V>*>(p)[t];
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = load<CT>(r.v[k]);
    } else {
        const AccT<CT> v = to_acc<CT>(s);
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = v;
    }
}

template <typename CT, typename T>
__device__ __forceinline__ AccT<CT> load_one(const T* p, long long i, CT s) {
    return p ? load<CT>(p[i]) : to_acc<CT>(s);
}

// One thread per V-element vector and no loop. The host passes the operands' pointers to the
// aligned body (base + head elements; nullptr for a scalar operand), the body's vector count
// and how many elements precede (head) and follow (tail) it. Thread t < nvec computes vector t;
// the next head + tail threads compute one peeled element each, at offsets -head .. -1 and
// nvec * V .. nvec * V + tail - 1 from the body. Lean on purpose: small and medium launches are
// bound by their latency, and an earlier grid-stride version ran 5-10 % behind torch there
// (docs/perf.md, "The vectorised kernel").
template <typename TO, typename TA, typename TB, typename TC, typename CT, int OP, int V, bool ARR>
__global__ void __launch_bounds__(256)
ew_contig(TO* __restrict__ out, const TA* __restrict__ a, const TB* __restrict__ b,
          const TC* __restrict__ c, CT sa, CT sb, CT sc, long long nvec, long long head,
          long long tail) {
    constexpr int R = Reads<OP>::n;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < nvec) {
        AccT<CT> xa[V], xb[V], xc[V];
        load_vec<CT, TA, V, ARR>(xa, a, t, sa);
        if constexpr (R >= 2) load_vec<CT, TB, V, ARR>(xb, b, t, sb);
        if constexpr (R >= 3) load_vec<CT, TC, V, ARR>(xc, c, t, sc);
        Vec<TO, V> r;
#pragma unroll
        for (int k = 0; k < V; ++k) {
            r.v[k] = result<TO, CT, OP>(xa[k], R >= 2 ? xb[k] : xa[k], R >= 3 ? xc[k] : xa[k]);
        }
        reinterpret_cast<Vec<TO, V>*>(out)[t] = r;
        return;
    }
    long long i = t - nvec - head;  // relative to the body: -head .. -1, then past its end
    if (i >= 0) {
        if (i >= tail) return;
        i += nvec * V;
    }
    const AccT<CT> va = load_one(a, i, sa);
    const AccT<CT> vb = R >= 2 ? load_one(b, i, sb) : va;
    const AccT<CT> vc = R >= 3 ? load_one(c, i, sc) : va;
    out[i] = result<TO, CT, OP>(va, vb, vc);
}

// Rows: a 2-D view (rows x cols) in which every array operand's inner stride is 1 (a row slice)
// or 0 (one value per row: a column broadcast), rows at any outer stride (0: a row broadcast).
// cols is a multiple of V and every row start is aligned to V elements of its operand, so the
// inner dimension uses vectors. One thread per vector and no loop, like ew_contig: x runs along
// the row, row = blockIdx.z * gridDim.y + blockIdx.y (gridDim.y is at most 65535).
// `inner` has bit k set when operand k (a, b, c) has inner stride 1.
template <typename CT, typename T, int V>
__device__ __forceinline__ void load_row_vec(AccT<CT> (&x)[V], const T* __restrict__ p,
                                             long long row, long long stride, long long col,
                                             bool inner, CT s) {
    if (!p) {
        const AccT<CT> v = to_acc<CT>(s);
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = v;
    } else if (inner) {
        const Vec<T, V> r = *reinterpret_cast<const Vec<T, V>*>(p + row * stride + col);
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = load<CT>(r.v[k]);
    } else {
        const AccT<CT> v = load<CT>(p[row * stride]);
#pragma unroll
        for (int k = 0; k < V; ++k) x[k] = v;
    }
}

template <typename TO, typename TA, typename TB, typename TC, typename CT, int OP, int V>
__global__ void __launch_bounds__(256)
ew_rows(TO* __restrict__ out, const TA* __restrict__ a, const TB* __restrict__ b,
        const TC* __restrict__ c, CT sa, CT sb, CT sc, long long rows, long long cols,
        long long so, long long s_a, long long s_b, long long s_c, int inner) {
    constexpr int R = Reads<OP>::n;
    const long long r = (long long)blockIdx.z * gridDim.y + blockIdx.y;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows || j >= cols / V) return;
    AccT<CT> xa[V], xb[V], xc[V];
    load_row_vec<CT, TA, V>(xa, a, r, s_a, j * V, inner & 1, sa);
    if constexpr (R >= 2) load_row_vec<CT, TB, V>(xb, b, r, s_b, j * V, inner & 2, sb);
    if constexpr (R >= 3) load_row_vec<CT, TC, V>(xc, c, r, s_c, j * V, inner & 4, sc);
    Vec<TO, V> ro;
#pragma unroll
    for (int k = 0; k < V; ++k) {
        ro.v[k] = result<TO, CT, OP>(xa[k], R >= 2 ? xb[k] : xa[k], R >= 3 ? xc[k] : xa[k]);
    }
    *reinterpret_cast<Vec<TO, V>*>(out + r * so + j * V) = ro;
}

template <typename I>
struct Dims { I v[CL_MAXD]; };

template <typename TO, typename TA, typename TB, typename TC, typename CT, int OP, typename I>
__global__ void __launch_bounds__(256)
ew_strided(TO* out, const TA* a, const TB* b, const TC* c, CT sa, CT sb, CT sc, I n, int ndim,
           Dims<I> shape, Dims<I> so, Dims<I> s_a, Dims<I> s_b, Dims<I> s_c) {
    constexpr int R = Reads<OP>::n;
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
        const AccT<CT> va = a ? load<CT>(a[oa]) : to_acc<CT>(sa);
        const AccT<CT> vb = R >= 2 ? (b ? load<CT>(b[ob]) : to_acc<CT>(sb)) : va;
        const AccT<CT> vc = R >= 3 ? (c ? load<CT>(c[oc]) : to_acc<CT>(sc)) : va;
        out[oo] = result<TO, CT, OP>(va, vb, vc);
    }
}

}  // namespace cl
