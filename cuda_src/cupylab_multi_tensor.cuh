// The multi-tensor launcher's device side: one kernel template, `mt_apply<Op, U>`, walks
// lists of tensors through a device-side table that the host builds once per list and reuses.
//
// Table (int64 words, built by cupylab/ops/_mt_plan.py):
//   tensor t: Op::NL data pointers (0 for a list slot the op does not use), then
//             n | ALIGNED_BIT when every used pointer allows 4-element vector access.
//   block map (int2 per block): (tensor index, chunk index). Chunks are `chunk` elements
//             (a multiple of 4); the last chunk of a tensor is shorter; empty tensors have
//             none. Element offsets are 64-bit, so a tensor may hold more than 2^31 elements.
//
// An Op is a small struct:
//   typedef L0..L4      element type of each list slot (unused slots: float)
//   typedef C           compute type (float, or double for float64 lists)
//   NL, READ, WRITE     list count, bit masks of the slots read / written
//   bool prepare(const Args&)   per thread, once: read scalars (device pointers included);
//                               false skips the block (found_inf set)
//   void operator()(C (&v)[5])  one element of every list, updated in place
//   void finish(const Args&)    per thread, after the loop (flags)
#pragma once
#include "cupylab_common.cuh"

namespace cl {
namespace mt {

constexpr int BLOCK = 256;
constexpr long long ALIGNED_BIT = 1LL << 62;

// Scalars of one launch, by value: doubles, and device pointers (0 = absent).
struct Args {
    double s[8];
    u64 p[4];
};

template <typename T> struct Comp { typedef float type; };
template <> struct Comp<double> { typedef double type; };

template <typename T, typename C>
__device__ __forceinline__ C ld1(const char* b, long long i) {
    return (C)to_acc<T>(reinterpret_cast<const T*>(b)[i]);
}

// A value of the computation type C stored as T, rounded once (a double goes to a 16-bit
// type directly, not through float: that rounded twice).
template <typename T, typename C>
__device__ __forceinline__ T store_as(C v) {
    if constexpr (IsSame<C, double>::value) {
        return Narrow<T>::run(v);
    } else {
        return from_acc<T>((typename Acc<T>::type)v);
    }
}

template <typename T, typename C>
__device__ __forceinline__ void st1(char* b, long long i, C v) {
    reinterpret_cast<T*>(b)[i] = store_as<T, C>(v);
}

template <typename T, typename C>
__device__ __forceinline__ void ld4(const char* b, long long i, C* out) {
    const Vec<T, 4> w = *reinterpret_cast<const Vec<T, 4>*>(reinterpret_cast<const T*>(b) + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = (C)to_acc<T>(w.v[j]);
}

template <typename T, typename C>
__device__ __forceinline__ void st4(char* b, long long i, const C* in) {
    Vec<T, 4> w;
#pragma unroll
    for (int j = 0; j < 4; ++j) w.v[j] = store_as<T, C>(in[j]);
    *reinterpret_cast<Vec<T, 4>*>(reinterpret_cast<T*>(b) + i) = w;
}

// Defaults an op can inherit.
struct OpBase {
    typedef float L0;
    typedef float L1;
    typedef float L2;
    typedef float L3;
    typedef float L4;
    __device__ __forceinline__ void finish(const Args&) {}
};

#define CL_MT_LD4(K, I, D) if ((Op::READ >> K) & 1) ld4<typename Op::L##K, C>(base[K], I, D[K]);
#define CL_MT_ST4(K, I, D) if ((Op::WRITE >> K) & 1) st4<typename Op::L##K, C>(base[K], I, D[K]);
#define CL_MT_LD1(K) if ((Op::READ >> K) & 1) v[K] = ld1<typename Op::L##K, C>(base[K], i);
#define CL_MT_ST1(K) if ((Op::WRITE >> K) & 1) st1<typename Op::L##K, C>(base[K], i, v[K]);

// Where one block's chunk lies. Returns false for a block with nothing to do.
template <int NL>
__device__ __forceinline__ void locate(const long long* __restrict__ tab, const int2* __restrict__ map,
                                       long long chunk, char* (&base)[5], long long& start,
                                       int& len, bool& aligned) {
    const int2 m = map[blockIdx.x];
    const long long* e = tab + (long long)m.x * (NL + 1);
#pragma unroll
    for (int k = 0; k < 5; ++k) base[k] = k < NL ? reinterpret_cast<char*>(e[k]) : nullptr;
    const long long nf = e[NL];
    const long long n = nf & (ALIGNED_BIT - 1);
    aligned = (nf & ALIGNED_BIT) != 0;
    start = (long long)m.y * chunk;
    const long long rest = n - start;
    len = (int)(rest < chunk ? rest : chunk);
}

// One vector step: `x` holds 4 elements of every list slot.
template <class Op>
__device__ __forceinline__ void apply4(Op& op, typename Op::C (&x)[5][4]) {
    typedef typename Op::C C;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        C v[5] = {x[0][j], x[1][j], x[2][j], x[3][j], x[4][j]};
        op(v);
#pragma unroll
        for (int k = 0; k < 5; ++k) x[k][j] = v[k];
    }
}

// U: vectors in flight per thread (all loads of U vectors are issued before the first
// store, which the compiler cannot do by itself since the lists may alias as far as it knows).
template <class Op, int U>
__global__ void __launch_bounds__(BLOCK)
mt_apply(const long long* __restrict__ tab, const int2* __restrict__ map, long long chunk, Args a) {
    typedef typename Op::C C;
    Op op;
    if (!op.prepare(a)) return;
    char* base[5];
    long long start;
    int len;
    bool aligned;
    locate<Op::NL>(tab, map, chunk, base, start, len, aligned);
    int done = 0;
    if (aligned) {
        const int nv = len >> 2;
        int q = threadIdx.x;
        for (; q + (U - 1) * BLOCK < nv; q += U * BLOCK) {
            C x[U][5][4] = {};
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long i = start + 4LL * (q + u * BLOCK);
                CL_MT_LD4(0, i, x[u]) CL_MT_LD4(1, i, x[u]) CL_MT_LD4(2, i, x[u])
                CL_MT_LD4(3, i, x[u]) CL_MT_LD4(4, i, x[u])
            }
#pragma unroll
            for (int u = 0; u < U; ++u) apply4(op, x[u]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const long long i = start + 4LL * (q + u * BLOCK);
                CL_MT_ST4(0, i, x[u]) CL_MT_ST4(1, i, x[u]) CL_MT_ST4(2, i, x[u])
                CL_MT_ST4(3, i, x[u]) CL_MT_ST4(4, i, x[u])
            }
        }
        for (; q < nv; q += BLOCK) {
            const long long i = start + 4LL * q;
            C x[5][4] = {};
            CL_MT_LD4(0, i, x) CL_MT_LD4(1, i, x) CL_MT_LD4(2, i, x) CL_MT_LD4(3, i, x)
            CL_MT_LD4(4, i, x)
            apply4(op, x);
            CL_MT_ST4(0, i, x) CL_MT_ST4(1, i, x) CL_MT_ST4(2, i, x) CL_MT_ST4(3, i, x)
            CL_MT_ST4(4, i, x)
        }
        done = nv << 2;
    }
    for (int r = done + threadIdx.x; r < len; r += BLOCK) {
        const long long i = start + r;
        C v[5] = {C(0), C(0), C(0), C(0), C(0)};
        CL_MT_LD1(0) CL_MT_LD1(1) CL_MT_LD1(2) CL_MT_LD1(3) CL_MT_LD1(4)
        op(v);
        CL_MT_ST1(0) CL_MT_ST1(1) CL_MT_ST1(2) CL_MT_ST1(3) CL_MT_ST1(4)
    }
    op.finish(a);
}

// Block-wide sum, the same order every time (deterministic). `red` holds BLOCK / 32 values.
template <typename A>
__device__ __forceinline__ A block_sum(A s, A* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) red[w] = s;
    __syncthreads();
    A t = A(0);
    if (threadIdx.x == 0) {
        for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += red[k];
    }
    return t;  // valid in thread 0
}

}  // namespace mt
}  // namespace cl
