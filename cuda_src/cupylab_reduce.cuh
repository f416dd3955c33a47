// cupylab row reductions in levels: warp shuffle -> block (shared memory) -> thread-block
// cluster (distributed shared memory, sm_90+). A row is owned by a group of TPR threads
// (TPR <= 32: part of one warp; TPR > 32: whole warps, THREADS / TPR groups a block) and, for
// cluster kernels (one group a block), by the C blocks of one cluster. group_reduce skips the
// levels a row does not need.
//
// Every thread of the group gets the same result, computed in the same order (deterministic).
// Cluster primitives are inline PTX so that NVRTC needs no CUDA headers.
#pragma once
#include "cupylab_common.cuh"

namespace cl {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CL_HAS_CLUSTER 1
#else
#define CL_HAS_CLUSTER 0
#endif

// (running max, sum of exp(x - max)): the online softmax pair.
template <typename A> struct MaxSum { A m; A s; };
// two sums reduced together (layer-norm backward: sum(g), sum(g * xhat)).
template <typename A> struct Sum2 { A a; A b; };

__device__ __forceinline__ float shfl_xor(float v, int o) {
    return __shfl_xor_sync(0xffffffffu, v, o);
}
__device__ __forceinline__ double shfl_xor(double v, int o) {
    return __shfl_xor_sync(0xffffffffu, v, o);
}
template <typename A>
__device__ __forceinline__ MaxSum<A> shfl_xor(MaxSum<A> v, int o) {
    MaxSum<A> r;
    r.m = shfl_xor(v.m, o);
    r.s = shfl_xor(v.s, o);
    return r;
}
template <typename A>
__device__ __forceinline__ Sum2<A> shfl_xor(Sum2<A> v, int o) {
    Sum2<A> r;
    r.a = shfl_xor(v.a, o);
    r.b = shfl_xor(v.b, o);
    return r;
}

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
__device__ __forceinline__ float log1p_acc(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_acc(double x) { return log1p(x); }
__device__ __forceinline__ float rsqrt_acc(float x) { return rsqrtf(x); }
__device__ __forceinline__ double rsqrt_acc(double x) { return rsqrt(x); }
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }
template <typename A> __device__ __forceinline__ A neg_inf() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() {
    return -__longlong_as_double(0x7ff0000000000000LL);
}
template <typename A> __device__ __forceinline__ A quiet_nan() { return __int_as_float(0x7fc00000); }
template <> __device__ __forceinline__ double quiet_nan<double>() {
    return __longlong_as_double(0x7ff8000000000000LL);
}

struct SumOp {
    template <typename A>
    __device__ __forceinline__ A operator()(A x, A y) const { return x + y; }
    template <typename A>
    __device__ __forceinline__ Sum2<A> operator()(Sum2<A> x, Sum2<A> y) const {
        Sum2<A> r;
        r.a = x.a + y.a;
        r.b = x.b + y.b;
        return r;
    }
};

struct MaxOp {
    template <typename A>
    __device__ __forceinline__ A operator()(A x, A y) const { return max_acc(x, y); }
};

// Combine two (max, sum) pairs. A side whose max equals the new max keeps its sum unscaled,
// so two all -inf sides give (-inf, 0) (not NaN) and stay neutral for finite ones; NaN sums
// (a NaN or +inf in the row) propagate.
struct MaxSumOp {
    template <typename A>
    __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> x, MaxSum<A> y) const {
        MaxSum<A> r;
        r.m = max_acc(x.m, y.m);
        A fx = (x.m == r.m) ? A(1) : exp_acc(x.m - r.m);
        A fy = (y.m == r.m) ? A(1) : exp_acc(y.m - r.m);
        r.s = x.s * fx + y.s * fy;
        return r;
    }
};

// ---- cluster primitives (sm_90) ---------------------------------------------------------
__device__ __forceinline__ void cluster_sync() {
#if CL_HAS_CLUSTER
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#if CL_HAS_CLUSTER
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}

// Read a POD value of the shared-memory variable `p` as held by cluster block `rank`.
template <typename R>
__device__ __forceinline__ R dsmem_load(const R* p, unsigned rank) {
    R out;
#if CL_HAS_CLUSTER
    unsigned a, ra;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(a) : "l"(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    unsigned* o = reinterpret_cast<unsigned*>(&out);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(R) / 4); ++i)
        asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(o[i]) : "r"(ra + 4u * i) : "memory");
#else
    out = *p;
#endif
    return out;
}

// The cluster level of group_reduce alone: v is this block's partial (the same in every
// thread of the block); every thread of the C blocks gets the combined value. One cluster
// barrier a call; ``phase`` alternates between consecutive calls of a site (as group_reduce).
// SLOT, as group_reduce's, gives each call site of a kernel its own shared partials (an
// instantiation of its own).
template <int C, int SLOT, typename R, typename Op>
__device__ __forceinline__ R cluster_reduce(R v, Op op, int phase) {
    __shared__ R cpart[2];
    R* buf = cpart + (phase & 1);
    if (threadIdx.x == 0) *buf = v;
    cluster_sync();
    // Lane q of each group of C lanes reads block q's partial: one load a lane, the C
    // loads in flight at once. The group combines them by shuffles. The ops are
    // commutative, so every lane of every block ends with the same value, in a fixed
    // order. The shuffle loop stays rolled: unrolled (or every thread reading all C
    // partials, as before) kept the row's registers spilling around this reduction
    // (ptxas, sm_90, 16-bit cross-entropy 92-112 bytes, layer_norm 24-40; now 0-68).
    static_assert((C & (C - 1)) == 0 && C <= 32, "C is a power of two up to 32");
    R acc = dsmem_load(buf, (unsigned)(threadIdx.x & (C - 1)));
#pragma unroll 1
    for (int o = 1; o < C; o <<= 1) acc = op(acc, shfl_xor(acc, o));
    return acc;
}

// Reduce v over the TPR threads of a row group (and the C blocks of a cluster). SLOT tells
// the call sites of one kernel apart (each has its own shared memory). Must be called by
// every thread of the block (all lanes take part in the shuffles).
//
// Cluster level (C > 1): one cluster barrier a call. Each block's partial goes to one of two
// shared-memory buffers chosen by ``phase``, which must alternate between consecutive calls
// of the same site (the kernels pass their row counter): a buffer is written again two calls
// later, after the next call's barrier, which every peer reaches only once it has read the
// buffer. A block must therefore not exit while a peer may still read its last partial: a
// cluster kernel ends with cluster_sync().
//
// TAIL: the barrier after the block level, which lets the next call of the same site (the
// next row) write the partials again. A kernel that gives each block one row (row_few_kernel)
// leaves it out, and puts one barrier before a second row instead.
template <int TPR, int C, int SLOT, int THREADS = TPR, bool TAIL = true, typename R, typename Op>
__device__ __forceinline__ R group_reduce(R v, Op op, int phase) {
    static_assert(TPR <= 32 || THREADS % TPR == 0, "a block holds whole groups");
    static_assert(C == 1 || TPR == THREADS, "a cluster reduces one row a block");
    constexpr int W = TPR < 32 ? TPR : 32;
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) v = op(v, shfl_xor(v, o));
    if constexpr (TPR > 32) {
        constexpr int NW = TPR / 32;  // warps of one group; the block's groups side by side
        __shared__ R part[THREADS / 32];
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
        __syncthreads();
        const R* mine = part + (threadIdx.x / TPR) * NW;
        v = mine[0];
#pragma unroll
        for (int i = 1; i < NW; ++i) v = op(v, mine[i]);
        if constexpr (TAIL) __syncthreads();
    }
    if constexpr (C > 1) v = cluster_reduce<C, SLOT>(v, op, phase);
    return v;
}

// Without a phase: for one-block groups only (a cluster call must pass its row counter).
template <int TPR, int C, int SLOT, int THREADS = TPR, typename R, typename Op>
__device__ __forceinline__ R group_reduce(R v, Op op) {
    static_assert(C == 1, "a cluster group_reduce passes its phase");
    return group_reduce<TPR, C, SLOT, THREADS>(v, op, 0);
}

}  // namespace cl
