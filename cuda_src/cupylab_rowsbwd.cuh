// The 16-bit softmax backwards' kernel (row_sbwd_kernel), included by rowwise.cu: both rows of
// a row group staged in shared memory with cp.async and read back at each pass (see
// _rowcore.SBWD16_LADDER for the classes that take it).
#pragma once
#include "cupylab_rowwise.cuh"

namespace cl {

// 16-bit softmax_backward and log_softmax_backward with their rows in shared memory: each
// thread copies its slots of dy (and softmax_backward's y) there with cp.async at once and
// reads them back at each pass, so no row is held in registers across the reduction: 29-32
// registers and 2,048 threads an SM. log_softmax_backward's sum needs only dy: its y is read
// from global memory after the reduction, as torch's kernel does (1.00-1.05x against staging
// it too). (The pipelined kernel holds both rows in registers, 56 of them, 1,024 threads an
// SM; the host keeps it for fewer rows than its grid holds at once, where it measured
// faster.) A row past the end stages nothing; its group reads no slot and stores nothing.
template <typename T, int OP, int THREADS, int TPR, int NV>
__global__ void __launch_bounds__(THREADS, 2048 / THREADS) row_sbwd_kernel(const RowArgs p) {
    typedef typename Acc<T>::type A;
    constexpr int V = 16 / sizeof(T);
    constexpr int RPB = THREADS / TPR;
    extern __shared__ __align__(16) unsigned char sbwd_buf[];
    // y's slots, then dy's (log_softmax_backward leaves y's half unused)
    Vec<T, V>* st = reinterpret_cast<Vec<T, V>*>(sbwd_buf);
    const int lane = threadIdx.x % TPR;
    const int group = threadIdx.x / TPR;
    const int cols = (int)p.cols;
    int it = 0;
    for (i64 unit = blockIdx.x; unit * RPB < p.rows; unit += gridDim.x, ++it) {
        const i64 row = unit * RPB + group;
        const bool active = row < p.rows;
        if constexpr (OP == OP_LOG_SOFTMAX_BWD)
            issue_row<T, V, NV, TPR, THREADS, 1>(st + NV * THREADS, p, row, lane, cols, T());
        else
            issue_stage<T, OP, V, NV, TPR, THREADS, true>(st, p, row, lane, cols);
        cp_async_commit();
        cp_async_wait<0>();
        A d = A(0);
        if (active) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                A g[V];
                unpack<T, V>(st[(NV + j) * THREADS + threadIdx.x], g);
                if constexpr (OP == OP_SOFTMAX_BWD) {
                    A f[V];
                    unpack<T, V>(st[j * THREADS + threadIdx.x], f);
#pragma unroll
                    for (int k = 0; k < V; ++k) d += f[k] * g[k];
                } else {
#pragma unroll
                    for (int k = 0; k < V; ++k) d += g[k];
                }
            }
        }
        d = group_reduce<TPR, 1, 0, THREADS>(d, SumOp(), it);
        if (active) {
            const T* y = row_ptr<const T>(p.in0, p, 0, row);
            const int head = row_head(y);
            T* dxal = row_ptr<T>(p.out0, p, 2, row) - head;
            Vec<T, V> yv[NV];  // log_softmax_backward: y, read only now
            if constexpr (OP == OP_LOG_SOFTMAX_BWD) {
#pragma unroll
                for (int j = 0; j < NV; ++j) {
                    const int s = lane + j * TPR;
                    load_slot<T, V>(yv[j], y - head, s, s * V - head, cols, true, T());
                }
            }
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                A f[V], g[V];
                if constexpr (OP == OP_LOG_SOFTMAX_BWD) unpack<T, V>(yv[j], f);
                else unpack<T, V>(st[j * THREADS + threadIdx.x], f);
                unpack<T, V>(st[(NV + j) * THREADS + threadIdx.x], g);
#pragma unroll
                for (int k = 0; k < V; ++k)
                    f[k] = OP == OP_SOFTMAX_BWD ? f[k] * (g[k] - d) : g[k] - exp_row<T>(f[k]) * d;
                Vec<T, V> o;
                pack<T, V>(f, o);
                const int s = lane + j * TPR;
                store_slot<T, V>(dxal, o, s, s * V - head, cols, true);
            }
        }
        // this thread's slots are copied again for its next row only after these reads
        asm volatile("" ::: "memory");
    }
}

}  // namespace cl
