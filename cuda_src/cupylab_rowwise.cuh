// Row-wise kernels' shared pieces (cuda_src/rowwise.cu): the operator codes, the one
// parameter block RowArgs, row addressing, 16-byte vector load/store of a row's slots with
// partial words at the ends, weight and target reads, and the cp.async staging of a row into
// shared memory for the pipelined kernels.
#pragma once
#include "cupylab_reduce.cuh"

namespace cl {

enum {
    OP_SOFTMAX = 0, OP_LOG_SOFTMAX = 1, OP_RMS = 2, OP_LN = 3, OP_ADD_RMS = 4, OP_CE = 5,
    OP_SOFTMAX_BWD = 10, OP_LOG_SOFTMAX_BWD = 11, OP_RMS_BWD = 12, OP_LN_BWD = 13
};

// One parameter block for every kernel (all 8-byte fields: the host packs "13Q5q12q2d").
// Operand k of so/si/cs: 0 in0, 1 in1 (or the target for OP_CE), 2 out0, 3 out1.
struct RowArgs {
    u64 out0, out1, in0, in1, w, b, st0, st1, part0, part1, target, loss, scale;
    i64 rows, cols, n1, ignore_index, flags;  // flags: 1 = int32 target, 2 = mean reduction
    i64 so[4], si[4], cs[4];  // row strides (outer, inner leading dim), column strides
    double eps, smooth;
};

// ONE: the host guarantees one level (n1 >= rows): no test either (row_few_kernel's exact fit)
template <typename P, bool ONE = false>
__device__ __forceinline__ P* row_ptr(u64 base, const RowArgs& p, int k, i64 row) {
    if (ONE || p.n1 >= p.rows) return reinterpret_cast<P*>(base) + row * p.si[k];  // one level: no division
    i64 ro = row / p.n1, ri = row - ro * p.n1;
    return reinterpret_cast<P*>(base) + ro * p.so[k] + ri * p.si[k];
}

// The elements before the first 16-byte boundary at or below p: a row's "head", where its
// first 16-byte slot starts (the host gives every row operand the same head in a row).
template <typename T>
__device__ __forceinline__ int row_head(const T* p) {
    return (int)(((u64)p & 15) / sizeof(T));
}

// exp in the row kernels: for 16-bit data one ex2.approx.ftz of x * log2(e) (an error far
// below their rounding; results below 2^-126, under 1e-38 of the row's largest term, flush to
// 0), the accurate one for float32 / float64. __expf is the same ex2 without ftz, which costs
// a compare and two predicated multiplies an element around it (SASS, sm_90).
__device__ __forceinline__ float exp_fast(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
    return r;
}
template <typename T> __device__ __forceinline__ float exp_row(float x) { return expf(x); }
template <> __device__ __forceinline__ float exp_row<half_t>(float x) { return exp_fast(x); }
template <> __device__ __forceinline__ float exp_row<bf16_t>(float x) { return exp_fast(x); }
template <typename T> __device__ __forceinline__ double exp_row(double x) { return exp(x); }

// Weights and biases are T, or float32 with 16-bit T (flags & 4).
template <typename T, typename A>
__device__ __forceinline__ A load_w(const RowArgs& p, u64 w, i64 col, A dflt) {
    if (!w) return dflt;
    if (p.flags & 4) return (A)reinterpret_cast<const float*>(w)[col];
    return (A)to_acc(reinterpret_cast<const T*>(w)[col]);
}

// V elements of a 16-byte slot to the accumulator type and back. bfloat16 pairs are split and
// packed as 32-bit words (two instructions per pair); float16 pairs use cvt.rn.f16x2.
template <typename T, int V, typename A>
__device__ __forceinline__ void unpack(const Vec<T, V>& v, A (&f)[V]) {
#pragma unroll
    for (int k = 0; k < V; ++k) f[k] = to_acc(v.v[k]);
}
template <>
__device__ __forceinline__ void unpack<bf16_t, 8, float>(const Vec<bf16_t, 8>& v, float (&f)[8]) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
template <>
__device__ __forceinline__ void unpack<half_t, 8, float>(const Vec<half_t, 8>& v, float (&f)[8]) {
    // per 32-bit word: the row stays two halves a register (converting element by element
    // split it into one 16-bit value a register, and float16 add_rms_norm spilled)
    const unsigned* w = reinterpret_cast<const unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm("{ .reg .b16 lo, hi;\n\t"
            "mov.b32 {lo, hi}, %2;\n\t"
            "cvt.f32.f16 %0, lo;\n\t"
            "cvt.f32.f16 %1, hi; }" : "=f"(f[2 * i]), "=f"(f[2 * i + 1]) : "r"(w[i]));
}
// The maximum of a 16-bit slot's eight values, as a float: max.bf16x2 / max.f16x2 on the packed
// words (exact: no rounding; NaN ignored as fmaxf does), then the two halves of the result.
// Half the registers and instructions of unpacking every value first.
template <typename T>
__device__ __forceinline__ unsigned max2_packed(unsigned a, unsigned b) {
    unsigned d;
    if constexpr (IsSame<T, bf16_t>::value) asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    else asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
template <typename T>
__device__ __forceinline__ unsigned neg_inf_packed() {
    return IsSame<T, bf16_t>::value ? 0xff80ff80u : 0xfc00fc00u;
}
template <typename T>
__device__ __forceinline__ float max_of_packed(unsigned w) {
    T lo, hi;
    lo.bits = (unsigned short)(w & 0xffffu);
    hi.bits = (unsigned short)(w >> 16);
    return fmaxf(to_acc(lo), to_acc(hi));
}
// An empty asm that claims to change the 32-bit words of v: values the compiler unpacked from
// v in an earlier pass cannot be reused, so it does not keep them live (in registers, or
// spilled) across a reduction; each pass unpacks again (one instruction an element).
template <typename T, int V>
__device__ __forceinline__ void launder(Vec<T, V>& v) {
    unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(Vec<T, V>) / 4); ++i) asm volatile("" : "+r"(w[i]));
}
// ... every vector of a thread's row
template <typename T, int V, int NV>
__device__ __forceinline__ void launder(Vec<T, V> (&a)[NV]) {
#pragma unroll
    for (int j = 0; j < NV; ++j) launder(a[j]);
}

// A thread's row: NV vectors in registers, or (SROW) in shared memory, vector j of thread t at
// base[j * THREADS] with base = buffer + t, read again at every pass
template <typename T, int V, int NV, int THREADS, bool SROW>
struct RowHold {
    Vec<T, V> v[NV];
    __device__ __forceinline__ Vec<T, V>& operator[](int j) { return v[j]; }
};
template <typename T, int V, int NV, int THREADS>
struct RowHold<T, V, NV, THREADS, true> {
    Vec<T, V>* base;
    __device__ __forceinline__ Vec<T, V>& operator[](int j) {
        asm volatile("" ::: "memory");
        return base[j * THREADS];
    }
};
template <typename T, int V, int NV, int THREADS>
__device__ __forceinline__ void launder(RowHold<T, V, NV, THREADS, false>& a) {
    launder(a.v);
}
// (a row in shared memory needs no laundering: every access above is already a compiler
// barrier, so nothing read in one pass is reused in the next)
template <typename T, int V, int NV, int THREADS>
__device__ __forceinline__ void launder(RowHold<T, V, NV, THREADS, true>&) {}
template <typename T, int V, typename A>
__device__ __forceinline__ void pack(const A (&f)[V], Vec<T, V>& v) {
#pragma unroll
    for (int k = 0; k < V; ++k) v.v[k] = from_acc<T>(f[k]);
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
template <>
__device__ __forceinline__ void pack<bf16_t, 8, float>(const float (&f)[8], Vec<bf16_t, 8>& v) {
    unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
}
template <>
__device__ __forceinline__ void pack<half_t, 8, float>(const float (&f)[8], Vec<half_t, 8>& v) {
    unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
}
#endif

// What elements outside the row are loaded as: -inf for the softmax family (neutral for the
// max and, as exp(-inf) = 0, for the sum), 0 for everything else (neutral for sums).
template <typename T> __device__ __forceinline__ T neg_inf_t() { return (T)neg_inf<typename Acc<T>::type>(); }
template <> __device__ __forceinline__ half_t neg_inf_t<half_t>() { half_t h; h.bits = 0xfc00; return h; }
template <> __device__ __forceinline__ bf16_t neg_inf_t<bf16_t>() { bf16_t h; h.bits = 0xff80; return h; }
template <typename T, int OP>
__device__ __forceinline__ T fill_value() {
    return (OP == OP_SOFTMAX || OP == OP_LOG_SOFTMAX || OP == OP_CE) ? neg_inf_t<T>() : T();
}

// FULL: the host guarantees a whole slot of an active row (row_few_kernel's exact fit): no test
template <typename T, int V, bool FULL = false>
__device__ __forceinline__ void load_slot(Vec<T, V>& v, const T* al, int s, int e0, int cols,
                                          bool active, T fill) {
    if (FULL || (active && e0 >= 0 && e0 + V <= cols)) {
        v = *reinterpret_cast<const Vec<T, V>*>(al + s * V);
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k)
            v.v[k] = (active && (unsigned)(e0 + k) < (unsigned)cols) ? al[s * V + k] : fill;
    }
}

template <typename T, int V, bool FULL = false>
__device__ __forceinline__ void store_slot(T* al, const Vec<T, V>& v, int s, int e0, int cols,
                                           bool active) {
    if (!active) return;
    if (FULL || (e0 >= 0 && e0 + V <= cols)) {
        *reinterpret_cast<Vec<T, V>*>(al + s * V) = v;
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k)
            if ((unsigned)(e0 + k) < (unsigned)cols) al[s * V + k] = v.v[k];
    }
}

// V weights for columns e0 .. e0+V-1 (dflt where there is no weight or outside the row).
template <typename W, int V, typename A>
__device__ __forceinline__ void load_wslot_t(A (&o)[V], u64 w, int e0, int cols, A dflt) {
    const W* wp = reinterpret_cast<const W*>(w);
    if (e0 >= 0 && e0 + V <= cols && ((w + e0 * sizeof(W)) % (sizeof(W) * V)) == 0) {
        const Vec<W, V> t = *reinterpret_cast<const Vec<W, V>*>(wp + e0);
        unpack<W, V, A>(t, o);  // bfloat16: the two-instructions-a-pair split
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            int e = e0 + k;
            o[k] = (e >= 0 && e < cols) ? (A)to_acc(wp[e]) : dflt;
        }
    }
}

template <typename T, int V, typename A>
__device__ __forceinline__ void load_wslot(A (&o)[V], const RowArgs& p, u64 w, int e0, int cols,
                                           A dflt) {
    if (!w) {
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] = dflt;
    } else if (p.flags & 4) {
        load_wslot_t<float, V>(o, w, e0, cols, dflt);
    } else {
        load_wslot_t<T, V>(o, w, e0, cols, dflt);
    }
}

// Weights read ahead (row_few_kernel): a slot's V weights as loaded, T or float32 (flags & 4),
// converted only where used (wslot_values), so that every slot's weight and bias loads are in
// flight together. Converting each slot as it arrived made every load wait for the one before
// (the conversion sits in the load's branch), one L2 round trip after another.
template <typename T, int V>
union WRaw {
    Vec<T, V> t;
    Vec<float, V> f;
};

// FULL: the columns are inside the row (row_few_kernel's exact fit); the weight's own alignment
// is still tested (a weight may start anywhere). Columns outside the row read as 0 (their
// results are never stored).
template <typename W, int V, bool FULL>
__device__ __forceinline__ void wslot_read_t(Vec<W, V>& r, u64 w, int e0, int cols) {
    const W* wp = reinterpret_cast<const W*>(w);
    if ((FULL || (e0 >= 0 && e0 + V <= cols)) && ((w + e0 * sizeof(W)) % (sizeof(W) * V)) == 0) {
        r = *reinterpret_cast<const Vec<W, V>*>(wp + e0);
    } else {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            const int e = e0 + k;
            r.v[k] = (FULL || (e >= 0 && e < cols)) ? wp[e] : W();
        }
    }
}

template <typename T, int V, bool FULL>
__device__ __forceinline__ void wslot_read(WRaw<T, V>& r, const RowArgs& p, u64 w, int e0,
                                           int cols) {
    if (!w) return;  // wslot_values gives the default
    if (p.flags & 4) wslot_read_t<float, V, FULL>(r.f, w, e0, cols);
    else wslot_read_t<T, V, FULL>(r.t, w, e0, cols);
}

// A slot read by wslot_read as V accumulator values (dflt for every column without a weight).
template <typename T, int V, typename A>
__device__ __forceinline__ void wslot_values(A (&o)[V], const WRaw<T, V>& r, const RowArgs& p,
                                             u64 w, A dflt) {
    if (!w) {
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] = dflt;
    } else if (p.flags & 4) {
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] = (A)r.f.v[k];
    } else {
        unpack<T, V, A>(r.t, o);
    }
}

template <typename T>
__device__ __forceinline__ i64 load_target(const RowArgs& p, i64 row) {
    if (p.flags & 1) return (i64)*row_ptr<const int>(p.target, p, 1, row);
    return *row_ptr<const i64>(p.target, p, 1, row);
}

// A cross-entropy row's loss and log-sum-exp, stored by its statistics thread (row_reg and
// row_generic): 0 for an ignored row, NaN for a bad target, else (1 - eps) * -log p(target)
// plus eps * the mean of -log p. so: the sum of the others' exps, s: with the target's term
// et added; xz: the target's logit less the maximum et was taken from; mx: the mean of x less
// the row maximum m (used only with eps > 0). When et is 1 (the target is the maximum) the
// loss is log1p(so), which keeps the digits of a confident row.
template <typename A>
__device__ __forceinline__ void ce_store_loss(const RowArgs& p, i64 row, bool ignored, bool bad,
                                              A eps, A et, A so, A s, A xz, A mx, A m) {
    const A ls = log_acc(s);
    A loss;
    if (ignored) loss = A(0);
    else if (bad) loss = quiet_nan<A>();
    else {
        loss = (A(1) - eps) * (et == A(1) ? log1p_acc(so) : ls - xz);
        if (eps > A(0)) loss += eps * (ls - mx);
    }
    reinterpret_cast<A*>(p.loss)[row] = loss;
    if (p.st0) reinterpret_cast<A*>(p.st0)[row] = m + ls;
}

// ---- cp.async pipeline (row_pipe_kernel) -------------------------------------------------
// Each thread copies its own 16-byte slots of upcoming rows into shared memory (cp.async,
// sm_80+) and later reads back only those slots, so the pipeline needs no block barrier: the
// loads of the next rows are in flight while the current row is reduced and written.
constexpr int PIPE_STAGES = 3;

// Below sm_80 (no cp.async) the pipelined kernels still compile, with plain synchronous
// copies, so that one program serves every architecture; the host never launches them there
// (pipe_plan).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned a;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(a) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
#else
    *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Start copying this thread's slots of `row` (operand in0, or in1 when IN == 1) into `stage`
// (NV x THREADS vectors, slot j of thread t at j * THREADS + t). Slots that are not whole
// 16-byte words of the row are filled element by element (`fill` outside the row).
template <typename T, int V, int NV, int TPR, int THREADS, int IN = 0>
__device__ __forceinline__ void issue_row(Vec<T, V>* stage, const RowArgs& p, i64 row, int sbase,
                                          int cols, T fill) {
    if (row >= p.rows) return;
    const T* x = row_ptr<const T>(IN ? p.in1 : p.in0, p, IN, row);
    const int head = row_head(x);
    const T* xal = x - head;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int s = sbase + j * TPR, e0 = s * V - head;
        Vec<T, V>* dst = stage + j * THREADS + threadIdx.x;
        if (e0 >= 0 && e0 + V <= cols) {
            cp_async16(dst, xal + s * V);
        } else {
            Vec<T, V> v;
#pragma unroll
            for (int k = 0; k < V; ++k)
                v.v[k] = ((unsigned)(e0 + k) < (unsigned)cols) ? xal[s * V + k] : fill;
            *dst = v;
        }
    }
}

// Stage `row` of every input into `stage` (in0's slots, then in1's for the two-input ops).
template <typename T, int OP, int V, int NV, int TPR, int THREADS, bool TWO_IN>
__device__ __forceinline__ void issue_stage(Vec<T, V>* stage, const RowArgs& p, i64 row,
                                            int sbase, int cols) {
    issue_row<T, V, NV, TPR, THREADS>(stage, p, row, sbase, cols, fill_value<T, OP>());
    if constexpr (TWO_IN)
        issue_row<T, V, NV, TPR, THREADS, 1>(stage + NV * THREADS, p, row, sbase, cols, T());
}

// ---- weights staged in shared memory (row_pipe_kernel of the forward norms) ---------------
// The weight (and layer_norm's bias) of the whole row is copied into shared memory once per
// block, in the prologue of the pipeline, beside the first rows: its loads overlap theirs
// instead of following the row's reduction (row_reg with WST, at decoding shapes).
//
// Bytes of a weight element: T, or float32 with 16-bit T (flags & 4).
template <typename T>
__device__ __forceinline__ int weight_size(const RowArgs& p) {
    return (p.flags & 4) ? 4 : (int)sizeof(T);
}
// Bytes of one staged array: its elements rounded up to 32, so that every staged array starts
// where load_wslot_t's widest word (eight float32) may
template <typename T>
__device__ __forceinline__ int wstage_bytes(int cols, const RowArgs& p) {
    return (cols * weight_size<T>(p) + 31) & ~31;
}
// Copy `bytes` bytes of global array w into shared memory at dst, the block's threads side by
// side: whole 16-byte words by cp.async when w is 16-byte aligned, the rest (and everything of
// an unaligned w) byte-exact by plain loads, so that nothing past the array is read.
__device__ __forceinline__ void stage_array(unsigned char* dst, u64 w, int bytes, int threads) {
    const int words = (w & 15) == 0 ? bytes / 16 : 0;
    for (int i = threadIdx.x; i < words; i += threads)
        cp_async16(dst + 16 * i, reinterpret_cast<const void*>(w + 16 * i));
    for (int i = 16 * words + threadIdx.x; i < bytes; i += threads)
        dst[i] = reinterpret_cast<const unsigned char*>(w)[i];
}

}  // namespace cl
