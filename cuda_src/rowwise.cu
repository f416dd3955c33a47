// Row-wise fused operators over the last axis: softmax, log_softmax, rms_norm, layer_norm,
// add + rms_norm, cross-entropy (forward, with the gradient written in the same pass), and the
// backward of softmax, log_softmax, rms_norm, layer_norm and cross-entropy (the last from the
// forward's log-sum-exp, cupylab_ce_backward.cuh).
//
// Register kernels (row_kernel, row_cluster_kernel): the row is read from global memory once
// into registers as 16-byte vectors (NV per thread) and written once. A row belongs to TPR
// threads (several rows per block when TPR < THREADS, one when TPR == THREADS) and, in the
// cluster kernels (sm_90), to the C blocks of a thread-block cluster, whose partial results
// meet in distributed shared memory. Rows may start anywhere: a vector "slot" s covers the
// 16-byte word s of the row's aligned base (row start - head elements); partial words at the
// ends are loaded and stored element by element. The host guarantees that every row operand
// has the same head in each row, that the last axis is contiguous and that the row fits
// (C * THREADS * NV slots).
//
// row_sbwd_kernel (cupylab_rowsbwd.cuh): the 16-bit softmax backwards with their rows staged
// in shared memory.
//
// row_generic (cupylab_rowgeneric.cuh): any layout (column stride, mixed alignment) and any
// length; one block per row, reading the row two or three times (the fallback, and the path
// for rows longer than every class).
#include "cupylab_rowwise.cuh"
#include "cupylab_colsum.cuh"

namespace cl {

// ---- register kernels ------------------------------------------------------------------
template <typename T, int OP, int THREADS, int TPR, int NV, int C, bool PIPE = false,
          bool SROW = false, bool WST = false, bool FEW = false, bool FULL = false>
__device__ __forceinline__ void row_reg(const RowArgs& p) {
    typedef typename Acc<T>::type A;
    constexpr int V = 16 / sizeof(T);
    constexpr int RPB = THREADS / TPR;
    constexpr bool BWD_W = (OP == OP_RMS_BWD || OP == OP_LN_BWD);
    constexpr bool TWO_IN = (OP == OP_ADD_RMS || OP >= OP_SOFTMAX_BWD);
    constexpr int NA = BWD_W ? NV * V : 1;
    constexpr int NB = (OP == OP_LN_BWD) ? NV * V : 1;
    // FULL (row_few_kernel's exact fit, _rowcore.few_full): the host guarantees rows of exactly
    // THREADS * NV whole slots starting on 16-byte boundaries, one level of row addressing and
    // one row a block. Length, heads and bounds are then constants: no per-slot tests.
    static_assert(!FULL || (FEW && TPR == THREADS && C == 1), "exact fit: row_few_kernel only");
    const int lane = FULL ? (int)threadIdx.x : (int)(threadIdx.x % TPR);
    const int group = FULL ? 0 : (int)(threadIdx.x / TPR);
    const unsigned rank = C > 1 ? cluster_rank() : 0u;
    // the host keeps register-kernel rows below 2^31
    const int cols = FULL ? THREADS * NV * V : (int)p.cols;
    const int sbase = (int)rank * TPR * NV + lane;
    const A n_inv = A(1) / (A)cols;
    A dwa[NA], dba[NB];
#pragma unroll
    for (int i = 0; i < NA; ++i) dwa[i] = A(0);
#pragma unroll
    for (int i = 0; i < NB; ++i) dba[i] = A(0);
    const i64 nunits = C > 1 ? gridDim.x / C : gridDim.x;
    const i64 first = C > 1 ? blockIdx.x / C : blockIdx.x;
    // PIPE: PIPE_STAGES * NIN * NV * THREADS 16-byte words of dynamic shared memory, a stage
    // holding the row of each input (the backwards: y or x, then dy)
    constexpr int NIN = TWO_IN ? 2 : 1;
    constexpr int STAGE = NIN * NV * THREADS;
    extern __shared__ __align__(32) unsigned char pipe_buf[];  // 32: the staged weights
    Vec<T, V>* stages = reinterpret_cast<Vec<T, V>*>(pipe_buf);
    // WST (the forward norms' pipelined kernel, at decoding shapes: _rowcore.stages_weights): the
    // weight (and bias) copied into shared memory after the stages, with the first stage's
    // group, so that their loads overlap the row's instead of following its reduction.
    // wsrc / bsrc: where the weight and bias are read from (generic addresses: global memory,
    // or the staged copies; 0 for none), by the same loads either way.
    // (without WST they are p.w and p.b themselves: read from the parameters where used, not
    // held in registers across the kernel, which made layer_norm spill)
    u64 wsrc = 0, bsrc = 0;
    if constexpr (WST) {
        wsrc = p.w;
        bsrc = p.b;
        static_assert(PIPE && (OP == OP_RMS || OP == OP_ADD_RMS || OP == OP_LN),
                      "staged weights: the forward norms' pipelined kernel");
        unsigned char* sw = pipe_buf + PIPE_STAGES * STAGE * 16;
        const int nbytes = cols * weight_size<T>(p);
        if (p.w) {
            stage_array(sw, p.w, nbytes, THREADS);
            wsrc = reinterpret_cast<u64>(sw);
            sw += wstage_bytes<T>(cols, p);
        }
        if (OP == OP_LN && p.b) {
            stage_array(sw, p.b, nbytes, THREADS);
            bsrc = reinterpret_cast<u64>(sw);
        }
    }
    if constexpr (PIPE) {
#pragma unroll
        for (int q = 0; q < PIPE_STAGES - 1; ++q) {
            issue_stage<T, OP, V, NV, TPR, THREADS, TWO_IN>(
                stages + q * STAGE, p, (first + q * nunits) * RPB + group, sbase, cols);
            cp_async_commit();
        }
    }
    int it = 0;
    for (i64 unit = first; unit * RPB < p.rows; unit += nunits, ++it) {
        const i64 row = unit * RPB + group;
        const bool active = FULL || row < p.rows;  // FULL: one row a block, the loop's own
        const i64 rr = active ? row : 0;
        const T* x = row_ptr<const T, FULL>(p.in0, p, 0, rr);
        const int head = FULL ? 0 : row_head(x);
        const T* xal = x - head;
        // layer_norm's shift, the row's first element: loaded before the row's loads are
        // waited for, so that its round trip overlaps theirs instead of following them
        T x0v = T();
        if constexpr (OP == OP_LN) {
            if (active) x0v = x[0];
        }
        RowHold<T, V, NV, THREADS, SROW> a;
        Vec<T, V> b[TWO_IN ? NV : 1];
        if constexpr (SROW) {
            // the whole segment in flight at once; each thread reads back only its own slots
            a.base = stages + threadIdx.x;
            issue_row<T, V, NV, TPR, THREADS>(stages, p, row, sbase, cols, fill_value<T, OP>());
            cp_async_commit();
            cp_async_wait<0>();
        } else if constexpr (PIPE) {
            issue_stage<T, OP, V, NV, TPR, THREADS, TWO_IN>(
                stages + ((it + PIPE_STAGES - 1) % PIPE_STAGES) * STAGE, p,
                (unit + (PIPE_STAGES - 1) * nunits) * RPB + group, sbase, cols);
            cp_async_commit();
            cp_async_wait<PIPE_STAGES - 1>();
            // the staged weights were copied by the whole block: visible to all after a barrier
            // (the first row only; the condition is the same in every thread of the block)
            if constexpr (WST) {
                if (it == 0) __syncthreads();
            }
            const Vec<T, V>* cur = stages + (it % PIPE_STAGES) * STAGE;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                a[j] = cur[j * THREADS + threadIdx.x];
                if constexpr (TWO_IN) b[j] = cur[(NV + j) * THREADS + threadIdx.x];
                if constexpr (BWD_W) {
                    // a row past the end was never staged: its slots hold an earlier row, which
                    // the weight- and bias-gradient sums must not see (zeros, as load_slot gives)
                    if (!active) {
#pragma unroll
                        for (int k = 0; k < V; ++k) a[j].v[k] = b[j].v[k] = T();
                    }
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int s = sbase + j * TPR;
                load_slot<T, V, FULL>(a[j], xal, s, s * V - head, cols, active,
                                      fill_value<T, OP>());
            }
        }
        if constexpr (TWO_IN && !PIPE) {
            const T* bal = row_ptr<const T, FULL>(p.in1, p, 1, rr) - head;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int s = sbase + j * TPR;
                load_slot<T, V, FULL>(b[j], bal, s, s * V - head, cols, active, T());
            }
        }
        // FEW (the forward norms): the weight and bias of this thread's columns loaded here,
        // beside the row's loads, instead of after the reduction (held in registers as read,
        // converted where used: the kernel is compiled for one block an SM)
        constexpr bool WPRE = FEW && (OP == OP_RMS || OP == OP_ADD_RMS || OP == OP_LN);
        WRaw<T, V> wpre[WPRE ? NV : 1], bpre[WPRE && OP == OP_LN ? NV : 1];
        if constexpr (WPRE) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int e0 = (sbase + j * TPR) * V - head;
                wslot_read<T, V, FULL>(wpre[j], p, p.w, e0, cols);
                if constexpr (OP == OP_LN) wslot_read<T, V, FULL>(bpre[j], p, p.b, e0, cols);
            }
        }
        T* yal = row_ptr<T, FULL>(p.out0, p, 2, rr) - head;
        const bool stat_thread = active && lane == 0 && rank == 0;
#define CL_FOR_ELEMS                                                        \
    _Pragma("unroll") for (int j = 0; j < NV; ++j)                          \
    _Pragma("unroll") for (int k = 0; k < V; ++k)
#define CL_E(j, k) ((sbase + (j) * TPR) * V - head + (k))
#define CL_VALID(j, k) (active && (unsigned)CL_E(j, k) < (unsigned)cols)

        // Invalid elements (outside the row) were loaded as the op's neutral value (-inf for
        // the softmax family, 0 otherwise), so the hot loops need no per-element masks.
        if constexpr (OP == OP_SOFTMAX || OP == OP_LOG_SOFTMAX || OP == OP_CE) {
            A m = neg_inf<A>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
            if constexpr (SROW && sizeof(T) == 2 && V == 8) {
                // rows in shared memory: the max on packed pairs (unpacking every value here
                // made ptxas batch the reads and spill the halves)
                unsigned pm = neg_inf_packed<T>();
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const unsigned* w = reinterpret_cast<const unsigned*>(&a[j]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) pm = max2_packed<T>(pm, w[i]);
                }
                m = max_of_packed<T>(pm);
            } else
#endif
            {
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    A f[V];
                    unpack<T, V>(a[j], f);
#pragma unroll
                    for (int k = 0; k < V; ++k) m = max_acc(m, f[k]);
                }
            }
            // cross-entropy: the target logit is read before the reduction's barriers, so that
            // with grad_out == logits no thread has overwritten it yet
            // cross-entropy: the target's offset from this thread's first element (-1: no
            // target in the row: ignored or out of range), its logit read by every thread
            int tt = -1;
            bool ignored = false, bad = false;
            A xt = A(0);
            if constexpr (OP == OP_CE) {
                const i64 t = active ? load_target<T>(p, rr) : 0;
                ignored = t == p.ignore_index;
                bad = !ignored && (t < 0 || t >= cols);
                if (active && !ignored && !bad) {
                    xt = to_acc(x[t]);
                    tt = (int)(t - ((i64)sbase * V - head));
                }
            }
            // Within a block, the maximum first, then the sum of exp(x - max): two plain
            // reductions are cheaper than combining (max, sum) pairs (two exps per combine).
            // Across a cluster, each block does the same with its own maximum, and the blocks'
            // (max, sum) pairs are combined in one step: one cluster barrier a row instead of
            // two. An all -inf row sums exp(-inf - 0) = 0 and gives NaN below (like torch);
            // NaN or +inf in a row make the sum NaN.
            // Cross-entropy leaves the target's own term out of the sum and adds it after the
            // reduction: when the target is the max, the loss log(sum) - (xt - max) is then
            // log1p(others), which keeps its digits for a confident row (the others' sum
            // ~1e-7 is lost when added to the target's 1 in float32). A loss can only be
            // that small when the target is the max.
            m = group_reduce<TPR, 1, 0, THREADS, !FEW>(m, MaxOp(), it);  // in a cluster, the block's
            const A mz = (m == neg_inf<A>()) ? A(0) : m;
            // cross-entropy keeps more values live (target, loss terms) than the softmaxes:
            // for 16-bit rows the unpacked halves kept from the first pass spilled (ptxas)
            if constexpr (OP == OP_CE && sizeof(T) == 2) launder(a);
            // softmax keeps each exp(x - mz) for the output pass instead of computing the
            // accurate exp twice: float32 / float64 rows in the row's own registers (the same
            // type: nothing is rounded), 16-bit rows in float registers of their own (the
            // packed halves would round it; 16-bit rows held in shared memory keep none and
            // compute them again from the row maximum). Across a cluster mz is the block's own
            // maximum: the output scales the kept exps by exp(mz - row maximum).
            constexpr bool KEEP_EXP = OP == OP_SOFTMAX && IsSame<T, A>::value;
            constexpr bool KEEP_EXP_F = OP == OP_SOFTMAX && !IsSame<T, A>::value && !SROW;
            // cross-entropy on float32 rows keeps them too when the gradient is written
            // without label smoothing (the only later use of x): one exp an element, not two
            constexpr bool CE_KEEP = OP == OP_CE && IsSame<T, float>::value;
            const bool keep = CE_KEEP && p.out0 && !((A)p.smooth > A(0));
            A ek[KEEP_EXP_F ? NV : 1][KEEP_EXP_F ? V : 1];
            A s = A(0);
            // cross-entropy: whether this thread holds the target. In the shared-memory rows
            // only that thread compares element indices with the target's (a compare and a
            // select an element); the register kernels keep one loop (two made ptxas spill).
            const bool own = OP == OP_CE && (!SROW || (tt >= 0 && tt < NV * TPR * V &&
                                                       tt % (TPR * V) < V));
#define CL_EXP_PASS(SEL)                                                                \
    _Pragma("unroll") for (int j = 0; j < NV; ++j) {                                    \
        A f[V];                                                                         \
        unpack<T, V>(a[j], f);                                                          \
        _Pragma("unroll") for (int k = 0; k < V; ++k) {                                 \
            const A e = exp_row<T>(f[k] - mz);                                          \
            s += ((SEL) && j * TPR * V + k == tt) ? A(0) : e;                           \
            if constexpr (KEEP_EXP) a[j].v[k] = e;                                      \
            if constexpr (CE_KEEP) {                                                    \
                if (keep) a[j].v[k] = e;                                                \
            }                                                                           \
            if constexpr (KEEP_EXP_F) ek[j][k] = e;                                     \
        }                                                                               \
    }
            if (own) {
                CL_EXP_PASS(true)
            } else {
                CL_EXP_PASS(false)
            }
#undef CL_EXP_PASS
            MaxSum<A> ms;
            ms.m = m;
            ms.s = group_reduce<TPR, 1, 1, THREADS, !FEW>(s, SumOp(), it);
            if constexpr (C > 1) ms = cluster_reduce<C, 1>(ms, MaxSumOp(), it);
            // the row maximum (across a cluster mz is the block's own), 0 for a row of -inf
            const A gz = (ms.m == neg_inf<A>()) ? A(0) : ms.m;
            // The kept exps are exp(x - mz). In one block mz is the row maximum, except for a
            // row of -inf, where they are 0 and 0 * (1 / 0) gives NaN, as torch. Across a
            // cluster mz is the block's own maximum: they are scaled by exp(mz - gz) <= 1,
            // and by 0 for a block whose elements are all -inf (exp(0 - gz) could
            // overflow); a row of -inf still gives 0 * (0 * (1 / 0)) = NaN.
            A kscale = A(1);
            if constexpr (C > 1 && (KEEP_EXP || KEEP_EXP_F || CE_KEEP))
                kscale = m == neg_inf<A>() ? A(0) : exp_row<T>(mz - gz);
            A et = A(0);  // cross-entropy: the target's term (0 without a target)
            if constexpr (OP == OP_CE) {
                if (!ignored && !bad) et = exp_row<T>(xt - gz);
                s = ms.s;  // the others' sum
                ms.s += et;
            }
            if constexpr (TPR <= 32 && OP == OP_CE) __syncwarp();
            if constexpr (OP == OP_SOFTMAX) {
                const A mul = kscale * (A(1) / ms.s);
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    A f[V];
                    if constexpr (KEEP_EXP_F) {
#pragma unroll
                        for (int k = 0; k < V; ++k) f[k] = ek[j][k] * mul;
                    } else if constexpr (!KEEP_EXP) {  // SROW 16-bit: the exps again, taken
                        unpack<T, V>(a[j], f);           // from the row maximum (kscale is 1)
#pragma unroll
                        for (int k = 0; k < V; ++k) f[k] = exp_row<T>(f[k] - gz) * mul;
                    } else {  // KEEP_EXP: the exps are the row's registers
                        unpack<T, V>(a[j], f);
#pragma unroll
                        for (int k = 0; k < V; ++k) f[k] *= mul;
                    }
                    pack<T, V>(f, a[j]);
                }
            } else if constexpr (OP == OP_LOG_SOFTMAX) {
                const A ls = log_acc(ms.s);
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    A f[V];
                    unpack<T, V>(a[j], f);
#pragma unroll
                    for (int k = 0; k < V; ++k) f[k] = (f[k] - ms.m) - ls;
                    pack<T, V>(f, a[j]);
                }
            } else {  // cross-entropy
                const A eps = (A)p.smooth;
                A sx = A(0);  // sum of x - max (label smoothing): masked, rarely used
                if (eps > A(0)) {
#pragma unroll
                    for (int j = 0; j < NV; ++j) {
                        A f[V];
                        unpack<T, V>(a[j], f);
#pragma unroll
                        for (int k = 0; k < V; ++k)
                            if (CL_VALID(j, k)) sx += f[k] - ms.m;
                    }
                    sx = group_reduce<TPR, C, 2, THREADS, !FEW>(sx, SumOp(), it);
                }
                // not from the rounded lse: a confident row's loss (below half an ulp of max)
                // would round to 0
                if (stat_thread)
                    ce_store_loss(p, row, ignored, bad, eps, et, s, ms.s, xt - gz, sx * n_inv,
                                  ms.m);
                if (p.out0) {
                    // (across a cluster the row is reloaded after the reduction: laundering
                    // it again there made bfloat16 spill)
                    if constexpr (sizeof(T) == 2 && C == 1) launder(a);
                    const A scale = p.scale ? *reinterpret_cast<const A*>(p.scale) : A(1);
// the gradient of a row: (e * MUL - SUB, less HIT at the target where SEL) * SCALE, with the
// ignored (0) and bad (NaN) rows' values selected where MASK
#define CL_GRAD_PASS(SEL, MUL, SUB, HIT, SCALE, MASK)                                   \
    _Pragma("unroll") for (int j = 0; j < NV; ++j) {                                    \
        A f[V], e[V];                                                                   \
        unpack<T, V>(a[j], f);                                                          \
        if (keep) {                                                                     \
            _Pragma("unroll") for (int k = 0; k < V; ++k) e[k] = f[k] * kscale;         \
        } else {                                                                        \
            _Pragma("unroll") for (int k = 0; k < V; ++k) e[k] = exp_row<T>(f[k] - ms.m); \
        }                                                                               \
        _Pragma("unroll") for (int k = 0; k < V; ++k) {                                 \
            A g = e[k] * (MUL) - (SUB);                                                 \
            if ((SEL) && j * TPR * V + k == tt) g -= (HIT);                             \
            f[k] = g * (SCALE);                                                         \
            if (MASK) {                                                                 \
                if (ignored) f[k] = A(0);                                               \
                if (bad) f[k] = quiet_nan<A>();                                         \
            }                                                                           \
        }                                                                               \
        pack<T, V>(f, a[j]);                                                            \
    }
                    if constexpr (SROW) {
                        // scale * (e / sum - eps / n), less scale * (1 - eps) at the target:
                        // one FMA an element, the target's subtraction in its own thread only,
                        // and an ignored or bad row filled apart (the register kernels keep the
                        // selects: this form made their float64 instances spill)
                        const A mul = scale * (A(1) / ms.s);
                        const A sm = scale * (eps * n_inv);
                        const A hit = scale * (A(1) - eps);
                        if (ignored || bad) {  // the whole row: 0 (ignored) or NaN (bad target)
                            A f[V];
#pragma unroll
                            for (int k = 0; k < V; ++k) f[k] = ignored ? A(0) : quiet_nan<A>();
#pragma unroll
                            for (int j = 0; j < NV; ++j) pack<T, V>(f, a[j]);
                        } else if (own) {
                            CL_GRAD_PASS(true, mul, sm, hit, A(1), false)
                        } else {
                            CL_GRAD_PASS(false, mul, sm, hit, A(1), false)
                        }
                    } else {
                        const A inv = A(1) / ms.s;
                        const A sm = eps * n_inv;
                        const A hit = A(1) - eps;
                        CL_GRAD_PASS(true, inv, sm, hit, scale, true)
                    }
#undef CL_GRAD_PASS
                }
            }
        } else if constexpr (OP == OP_RMS || OP == OP_ADD_RMS || OP == OP_LN) {
            if constexpr (OP == OP_ADD_RMS) {
                T* hal = row_ptr<T, FULL>(p.out1, p, 3, rr) - head;
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    A f[V], g[V];
                    unpack<T, V>(a[j], f);
                    unpack<T, V>(b[j], g);
#pragma unroll
                    for (int k = 0; k < V; ++k) f[k] += g[k];
                    pack<T, V>(f, a[j]);
                    const int s = sbase + j * TPR;
                    store_slot<T, V, FULL>(hal, a[j], s, s * V - head, cols, active);
                }
            }
            A mean = A(0);
            if constexpr (OP == OP_LN) {
                // a first mean shifted by the row's first element: a constant row's is exact,
                // so x - mean is 0 there and y the bias, as torch's mean gives; the variance
                // pass below corrects it by the mean of x - mean (an outlier first element
                // would otherwise cost the shifted sum its accuracy)
                const A x0 = to_acc(x0v);  // 0 for an inactive row
                A s1 = A(0);
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    A f[V];
                    unpack<T, V>(a[j], f);
                    const int e0 = (sbase + j * TPR) * V - head;
                    if (FULL || (e0 >= 0 && e0 + V <= cols)) {
#pragma unroll
                        for (int k = 0; k < V; ++k) s1 += f[k] - x0;
                    } else {
#pragma unroll
                        for (int k = 0; k < V; ++k)
                            s1 += ((unsigned)(e0 + k) < (unsigned)cols) ? f[k] - x0 : A(0);
                    }
                }
                mean = x0 + group_reduce<TPR, C, 0, THREADS, !FEW>(s1, SumOp(), it) / (A)cols;
            }
            A s2 = A(0), sd = A(0);  // sums of d * d and (layer_norm) of d
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                A f[V];
                unpack<T, V>(a[j], f);
                const int e0 = (sbase + j * TPR) * V - head;
                if (OP != OP_LN || FULL || (e0 >= 0 && e0 + V <= cols)) {
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        A d = f[k] - mean;
                        s2 += d * d;
                        if constexpr (OP == OP_LN) sd += d;
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        A d = ((unsigned)(e0 + k) < (unsigned)cols) ? f[k] - mean : A(0);
                        s2 += d * d;
                        sd += d;
                    }
                }
            }
            if constexpr (OP == OP_LN) {  // one reduction of both sums (no extra barrier)
                Sum2<A> acc;
                acc.a = sd;
                acc.b = s2;
                acc = group_reduce<TPR, C, 1, THREADS, !FEW>(acc, SumOp(), it);
                const A dm = acc.a * n_inv;
                mean += dm;
                s2 = acc.b - acc.a * dm;  // sum of (x - mean)^2 about the new mean
                if (s2 < A(0)) s2 = A(0);  // rounding; a NaN stays NaN
            } else {
                s2 = group_reduce<TPR, C, 1, THREADS, !FEW>(s2, SumOp(), it);
            }
            const A rstd = rsqrt_acc(s2 * n_inv + (A)p.eps);
            if (stat_thread) {
                if (p.st0) reinterpret_cast<A*>(p.st0)[row] = mean;
                if (p.st1) reinterpret_cast<A*>(p.st1)[row] = rstd;
            }
            // each slot is stored as soon as it is computed, with a compiler barrier between
            // slots: the weight loads of later slots are not hoisted (fewer live registers)
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int e0 = (sbase + j * TPR) * V - head;
                A wv[V], f[V];
                unpack<T, V>(a[j], f);
                if constexpr (OP == OP_LN) {  // the rms norms have no bias
                    A bv[V];  // no bias: -0, which adds nothing (a -0 result stays -0, as torch)
                    if constexpr (WPRE) {
                        wslot_values<T, V>(wv, wpre[j], p, p.w, A(1));
                        wslot_values<T, V>(bv, bpre[j], p, p.b, -A(0));
                    } else {
                        load_wslot<T, V>(wv, p, WST ? wsrc : p.w, e0, cols, A(1));
                        load_wslot<T, V>(bv, p, WST ? bsrc : p.b, e0, cols, -A(0));
                    }
#pragma unroll
                    for (int k = 0; k < V; ++k) f[k] = (f[k] - mean) * rstd * wv[k] + bv[k];
                } else {
#pragma unroll
                    for (int k = 0; k < V; ++k) f[k] *= rstd;
                    if (p.w) {  // no neutral fill and multiply by 1 without a weight
                        if constexpr (WPRE) {
                            wslot_values<T, V>(wv, wpre[j], p, p.w, A(1));
                        } else {
                            load_wslot<T, V>(wv, p, WST ? wsrc : p.w, e0, cols, A(1));
                        }
#pragma unroll
                        for (int k = 0; k < V; ++k) f[k] *= wv[k];
                    }
                }
                pack<T, V>(f, a[j]);
                store_slot<T, V, FULL>(yal, a[j], sbase + j * TPR, e0, cols, active);
                asm volatile("" ::: "memory");
            }
        } else if constexpr (OP == OP_SOFTMAX_BWD || OP == OP_LOG_SOFTMAX_BWD) {
            A d = A(0);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                A f[V], g[V];
                unpack<T, V>(a[j], f);
                unpack<T, V>(b[j], g);
#pragma unroll
                for (int k = 0; k < V; ++k) d += (OP == OP_SOFTMAX_BWD ? f[k] : A(1)) * g[k];
            }
            d = group_reduce<TPR, C, 0, THREADS, !FEW>(d, SumOp(), it);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                A f[V], g[V];
                unpack<T, V>(a[j], f);
                unpack<T, V>(b[j], g);
#pragma unroll
                for (int k = 0; k < V; ++k)
                    f[k] = OP == OP_SOFTMAX_BWD ? f[k] * (g[k] - d) : g[k] - exp_row<T>(f[k]) * d;
                pack<T, V>(f, a[j]);
            }
        } else {  // OP_RMS_BWD, OP_LN_BWD: in0 = x, in1 = dy (invalid elements hold 0: dy = 0)
            const A mean = (OP == OP_LN_BWD && active) ? reinterpret_cast<const A*>(p.st0)[rr] : A(0);
            const A rstd = active ? reinterpret_cast<const A*>(p.st1)[rr] : A(0);
            Sum2<A> acc;
            acc.a = A(0);
            acc.b = A(0);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int e0 = (sbase + j * TPR) * V - head;
                A wv[V], f[V], g[V];
                load_wslot<T, V>(wv, p, p.w, e0, cols, A(1));
                unpack<T, V>(a[j], f);
                unpack<T, V>(b[j], g);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    A xh = (f[k] - mean) * rstd;
                    A gw = g[k] * wv[k];
                    acc.a += gw;
                    acc.b += gw * xh;
                    dwa[j * V + k] += g[k] * xh;
                    if constexpr (OP == OP_LN_BWD) dba[j * V + k] += g[k];
                }
            }
            acc = group_reduce<TPR, C, 0, THREADS, !FEW>(acc, SumOp(), it);
            const A c1 = OP == OP_LN_BWD ? acc.a * n_inv : A(0), c2 = acc.b * n_inv;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int e0 = (sbase + j * TPR) * V - head;
                A wv[V], f[V], g[V];
                load_wslot<T, V>(wv, p, p.w, e0, cols, A(1));
                unpack<T, V>(a[j], f);
                unpack<T, V>(b[j], g);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    A xh = (f[k] - mean) * rstd;
                    f[k] = rstd * (g[k] * wv[k] - c1 - xh * c2);
                }
                pack<T, V>(f, a[j]);
            }
        }
        if ((OP != OP_CE || p.out0) && OP != OP_RMS && OP != OP_LN && OP != OP_ADD_RMS) {
            int sb = sbase, hd = head;
            if constexpr (SROW) asm volatile("" : "+r"(sb), "+r"(hd));
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int s = sb + j * TPR;
                store_slot<T, V, FULL>(yal, a[j], s, s * V - hd, cols, active);
            }
        }
#undef CL_FOR_ELEMS
#undef CL_E
#undef CL_VALID
        // FEW: the reductions keep no barrier after reading their partials; one here before a
        // block's next row (the host gives each block one row: never taken there)
        if constexpr (FEW) {
            if ((unit + nunits) * RPB < p.rows) __syncthreads();
        }
    }
    // the peers may still be reading this block's last partial (group_reduce)
    if constexpr (C > 1) cluster_sync();
    if constexpr (BWD_W) {
        // this group's partial column sums: row blockIdx.x * RPB + group of part0 / part1
        const T* x0 = row_ptr<const T>(p.in0, p, 0, 0);
        const int head = row_head(x0);
        A* pw = reinterpret_cast<A*>(p.part0) + ((i64)blockIdx.x * RPB + group) * cols;
        A* pb = reinterpret_cast<A*>(p.part1) + ((i64)blockIdx.x * RPB + group) * cols;
        constexpr int AW = 16 / sizeof(A);  // partial sums a 16-byte word holds
        static_assert(V % AW == 0, "a vector of T holds whole words of partial sums");
        if (head == 0 && cols % AW == 0) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                const int e0 = (sbase + j * TPR) * V;
#pragma unroll
                for (int q = 0; q < V / AW; ++q) {
                    Vec<A, AW> vw, vb;
#pragma unroll
                    for (int k = 0; k < AW; ++k) {
                        vw.v[k] = dwa[j * V + q * AW + k];
                        if constexpr (OP == OP_LN_BWD) vb.v[k] = dba[j * V + q * AW + k];
                    }
                    if (e0 + q * AW >= cols) continue;  // cols % AW == 0: whole words
                    if (p.part0) *reinterpret_cast<Vec<A, AW>*>(pw + e0 + q * AW) = vw;
                    if (OP == OP_LN_BWD && p.part1)
                        *reinterpret_cast<Vec<A, AW>*>(pb + e0 + q * AW) = vb;
                }
            }
        } else
#pragma unroll
        for (int j = 0; j < NV; ++j) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
                const int e = (sbase + j * TPR) * V - head + k;
                if ((unsigned)e < (unsigned)cols) {
                    if (p.part0) pw[e] = dwa[j * V + k];
                    if (OP == OP_LN_BWD && p.part1) pb[e] = dba[j * V + k];
                }
            }
        }
    }
}

template <typename T, int OP, int THREADS, int TPR, int NV>
__global__ void __launch_bounds__(THREADS, 1024 / THREADS) row_kernel(const RowArgs p) {
    row_reg<T, OP, THREADS, TPR, NV, 1>(p);
}

// One row a block at decoding shapes (the host launches it while the rows fit one block an SM,
// _rowcore.few_class): the row loaded straight into registers (no pipeline: a block has no next
// row to prefetch), the norms' weights loaded beside it, and one barrier a reduction.
// Compiled for one resident block an SM. FULL: the exact-fit form (rows of THREADS * NV whole
// 16-byte slots from 16-byte boundaries, one level of rows: _rowcore.few_full), with the row's
// length, head and bounds known at compile time.
template <typename T, int OP, int THREADS, int NV, bool FULL>
__global__ void __launch_bounds__(THREADS, 1) row_few_kernel(const RowArgs p) {
    static_assert(OP <= OP_ADD_RMS, "the forward softmaxes and norms");
    row_reg<T, OP, THREADS, THREADS, NV, 1, false, false, false, true, FULL>(p);
}

// Persistent variant (blocks loop over rows): the next PIPE_STAGES - 1 rows of each input are
// copied into shared memory while the current one is processed.
// WST: the forward norms' weights staged in shared memory (row_reg), for grids of at most one
// block an SM: compiled for one resident block (no register cap below 64 a thread to keep
// several blocks an SM, so the staged layer_norm does not spill).
template <typename T, int OP, int THREADS, int TPR, int NV, bool WST = false>
__global__ void __launch_bounds__(THREADS, WST ? 1 : 1024 / THREADS) row_pipe_kernel(const RowArgs p) {
    row_reg<T, OP, THREADS, TPR, NV, 1, true, false, WST>(p);
}

#if CL_HAS_CLUSTER
#define CL_CLUSTER_DIMS(c) __cluster_dims__(c, 1, 1)
#else
#define CL_CLUSTER_DIMS(c)
#endif

// One row per cluster of C blocks (sm_90 and newer; an empty kernel when compiled for older
// GPUs, where the host never launches it).
template <typename T, int OP, int THREADS, int NV, int C>
__global__ void CL_CLUSTER_DIMS(C) __launch_bounds__(THREADS, 1024 / THREADS) row_cluster_kernel(const RowArgs p) {
#if CL_HAS_CLUSTER
    row_reg<T, OP, THREADS, THREADS, NV, C>(p);
#endif
}

// The cluster kernel with the row staged in shared memory (sm_90): each block copies its whole
// segment with cp.async (THREADS * NV 16-byte slots of dynamic shared memory) and reads it
// back at every pass; the cluster classes of _rowcore.SMEM_OPS on 16-bit and float32 rows.
// Blocks an SM it is compiled for (the register cap): as many as the segments' shared memory
// allows up to 6 for float32 (40 registers) and 5 for 16-bit rows (48 registers; their
// packed-word and conversion code needs more); a 16-vector segment (64 KiB) allows 3.
template <typename T, int NV>
__host__ __device__ constexpr int smem_min_blocks() {
    return NV >= 16 ? 3 : (sizeof(T) == 4 ? 6 : 5);
}

template <typename T, int OP, int THREADS, int NV, int C>
__global__ void CL_CLUSTER_DIMS(C) __launch_bounds__(THREADS, smem_min_blocks<T, NV>()) row_smem_kernel(const RowArgs p) {
#if CL_HAS_CLUSTER
    row_reg<T, OP, THREADS, THREADS, NV, C, false, true>(p);
#endif
}

}  // namespace cl

// ---- generic kernel: any strides, any length (cupylab_rowgeneric.cuh) ---------------------
#include "cupylab_rowgeneric.cuh"
// ---- 16-bit softmax backwards with their rows in shared memory (cupylab_rowsbwd.cuh) --------
#include "cupylab_rowsbwd.cuh"

namespace cl {

// ---- small second-stage kernels --------------------------------------------------------
// col_sum (the weight gradients' column sums): cupylab_colsum.cuh

// Cross-entropy bookkeeping in one block: counts the targets that are not ignored; writes
// p.scale[0] = 1 / count (0 when none) when p.scale is set (mean reduction with the
// gradient), and p.out0[0] = sum of p.loss (divided by count when flags & 2) when p.out0 is
// set. Sums in float64, in a fixed order.
template <typename A>
__global__ void __launch_bounds__(1024) ce_aux(const RowArgs p) {
    double cnt = 0, sum = 0;
    for (i64 r = threadIdx.x; r < p.rows; r += 1024) {
        if (p.scale || (p.flags & 2)) cnt += load_target<A>(p, r) != p.ignore_index ? 1.0 : 0.0;
        if (p.out0) sum += (double)reinterpret_cast<const A*>(p.loss)[r];
    }
    Sum2<double> v;
    v.a = cnt;
    v.b = sum;
    v = group_reduce<1024, 1, 0>(v, SumOp());
    if (threadIdx.x == 0) {
        if (p.scale) reinterpret_cast<A*>(p.scale)[0] = v.a > 0 ? (A)(1.0 / v.a) : A(0);
        if (p.out0) reinterpret_cast<A*>(p.out0)[0] = (A)((p.flags & 2) ? v.b / v.a : v.b);
    }
}

}  // namespace cl

#include "cupylab_ce_backward.cuh"  // ce_backward: the gradient from the log-sum-exp
