// Experimental kernel shapes for scripts/explore_launch.py (not part of the library): what
// makes a small or medium elementwise launch slower than torch's, and what the fp64 division and
// row-broadcast kernels need. Each variant computes out = OP(a, b) like cl::ew_contig does.
// (The "y_contig" variant of the logs became cl::ew_contig; the script now times that.)
#include "elementwise.cu"

namespace clx {
using namespace cl;

extern "C" __global__ void x_empty() {}

// VPT 16-byte vectors per thread, block-strided (coalesced), one pass (no grid-stride loop),
// no head/tail peel and no scalar operands: the leanest possible vector kernel.
template <typename T, int OP, int VPT, typename I>
__global__ void __launch_bounds__(512)
x_vec(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, I nvec) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const I base = (I)blockIdx.x * (I)blockDim.x * VPT + (I)threadIdx.x;
    VT ra[VPT], rb[VPT];
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
        const I j = base + (I)u * (I)blockDim.x;
        if (j < nvec) {
            ra[u] = reinterpret_cast<const VT*>(a)[j];
            rb[u] = reinterpret_cast<const VT*>(b)[j];
        }
    }
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
        const I j = base + (I)u * (I)blockDim.x;
        if (j < nvec) {
            VT r;
#pragma unroll
            for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra[u].v[k], rb[u].v[k], ra[u].v[k]);
            reinterpret_cast<VT*>(out)[j] = r;
        }
    }
}

// x_vec<.., 1, long long> with ew_contig's nine parameters (the extra ones unused): does the
// size of the parameter block cost anything?
template <typename T, int OP>
__global__ void __launch_bounds__(256)
x_vec_pad(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
          const T* __restrict__ c, T sa, T sb, T sc, long long nvec, long long head) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < nvec) {
        const VT ra = reinterpret_cast<const VT*>(a)[j], rb = reinterpret_cast<const VT*>(b)[j];
        VT r;
#pragma unroll
        for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra.v[k], rb.v[k], ra.v[k]);
        reinterpret_cast<VT*>(out)[j] = r;
    }
}

// Row broadcast out[r, :] = OP(a[r, :], b[:]) with the row operand kept in registers across
// the rows a thread visits (grid.y < rows), ROWS rows' loads in flight per step.
template <typename T, int OP, int ROWS>
__global__ void __launch_bounds__(256)
x_rowbcast(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, long long rows,
           long long cvec) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cvec) return;
    const VT rb = reinterpret_cast<const VT*>(b)[j];
    for (long long r0 = (long long)blockIdx.y * ROWS; r0 < rows; r0 += (long long)gridDim.y * ROWS) {
        VT ra[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
            if (r0 + u < rows) ra[u] = reinterpret_cast<const VT*>(a)[(r0 + u) * cvec + j];
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
            if (r0 + u < rows) {
                VT o;
#pragma unroll
                for (int k = 0; k < V; ++k) o.v[k] = apply<T, OP>(ra[u].v[k], rb.v[k], ra[u].v[k]);
                reinterpret_cast<VT*>(out)[(r0 + u) * cvec + j] = o;
            }
        }
    }
}


// Cache-policy variants of the one-vector-per-thread kernel (why 16-bit types sit ~1 % behind
// torch at n >= 2^24). LD: 0 const __restrict__ (the compiler's LDG.E.128.CONSTANT, as
// ew_contig), 1 plain ld.global (torch's kernels have no __restrict__), 2 ld.global.cs,
// 3 ld.global.nc.L1::no_allocate, 4 ld.global.L2::cache_hint with an L2 evict_first policy.
// ST: 0 st.global, 1 st.global.cs, 2 st.global.L2::cache_hint evict_first.
template <int LD>
__device__ __forceinline__ uint4 ld16(const uint4* __restrict__ p, unsigned long long pol) {
    uint4 r;
    if (LD == 0) {
        r = *p;
    } else if (LD == 1) {
        asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else if (LD == 2) {
        asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else if (LD == 3) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    } else {
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
    }
    return r;
}

template <int ST>
__device__ __forceinline__ void st16(uint4* p, uint4 v, unsigned long long pol) {
    if (ST == 0) {
        *p = v;
    } else if (ST == 1) {
        asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    } else {
        asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1,%2,%3,%4}, %5;"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol) : "memory");
    }
}

template <typename T, int OP, int LD, int ST>
__global__ void __launch_bounds__(256)
x_hint(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, long long nvec) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= nvec) return;
    unsigned long long pol = 0;
    if (LD == 4 || ST == 2) asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    union U { uint4 u; VT v; };
    U ua, ub, r;
    ua.u = ld16<LD>(reinterpret_cast<const uint4*>(a) + t, pol);
    ub.u = ld16<LD>(reinterpret_cast<const uint4*>(b) + t, pol);
#pragma unroll
    for (int k = 0; k < V; ++k) r.v.v[k] = apply<T, OP>(ua.v.v[k], ub.v.v[k], ua.v.v[k]);
    st16<ST>(reinterpret_cast<uint4*>(out) + t, r.u, pol);
}

// Hot-L2 experiment (why torch's fp64 add at 2^21 beats every one-pass shape when the 48 MB of
// operands stay in the 60 MB L2). x_gs: a grid-stride loop over 16-byte vectors, U vectors in
// flight per step, launched as one wave (grid = SMs x blocks per SM). Block b works on chunk
// (b + shift) mod gridDim.x, so the host can keep every chunk on the same block from call to
// call (shift 0) or move it (shift changing per call, 0 <= shift < gridDim.x) without changing
// the traffic. LEAN wraps once instead of a 64-bit `%` (which costs ~0.4 us before the first
// load: the hot2 section's x_gs, named x_gs<T, OP, U> in explore_hot2.log, is LEAN = false;
// hot3's x_gsl is LEAN = true).
template <typename T, int OP, int U, bool LEAN>
__global__ void __launch_bounds__(256)
x_gs(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, long long nvec,
     unsigned shift) {
    constexpr int V = 16 / sizeof(T);
    typedef Vec<T, V> VT;
    long long chunk;
    if (LEAN) {
        unsigned c = blockIdx.x + shift;
        chunk = c >= gridDim.x ? c - gridDim.x : c;
    } else {
        chunk = ((long long)blockIdx.x + shift) % gridDim.x;
    }
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long j = chunk * blockDim.x + threadIdx.x;
    for (; j + (U - 1) * stride < nvec; j += U * stride) {
        VT ra[U], rb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            ra[u] = reinterpret_cast<const VT*>(a)[j + u * stride];
            rb[u] = reinterpret_cast<const VT*>(b)[j + u * stride];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            VT r;
#pragma unroll
            for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra[u].v[k], rb[u].v[k], ra[u].v[k]);
            reinterpret_cast<VT*>(out)[j + u * stride] = r;
        }
    }
    if (U > 1 || !LEAN) {  // the last partial step (none when U == 1)
        for (; j < nvec; j += stride) {
            const VT ra = reinterpret_cast<const VT*>(a)[j];
            const VT rb = reinterpret_cast<const VT*>(b)[j];
            VT r;
#pragma unroll
            for (int k = 0; k < V; ++k) r.v[k] = apply<T, OP>(ra.v[k], rb.v[k], ra.v[k]);
            reinterpret_cast<VT*>(out)[j] = r;
        }
    }
}

}  // namespace clx
