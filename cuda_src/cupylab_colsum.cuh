// The weight gradients' second stage, shared by the row-wise norm backwards (rowwise.cu)
// and the residual-stream norm (resnorm.cu).
#pragma once
#include "cupylab_common.cuh"

namespace cl {

// out[c] = sum over parts i of part[i * cols + c], and in blocks with blockIdx.y == 1 the
// same of part1 into out1 (layer_norm_backward's weight and bias gradients in one launch). A
// block of 32 x ny threads (ny = blockDim.x / 32, at most 32, chosen from nparts alone) takes
// 32 columns: thread row j sums parts j, j + ny, j + 2 ny, ... in order, then thread row 0
// adds the ny partial sums in order: a fixed order, so the result is deterministic, and ny
// loads in flight per column (one thread per column summing hundreds of parts one after
// another is latency-bound: ~60 us for 1056 parts x 512 columns on an H200); a few parts
// (one row's block) take a block of as many thread rows.
constexpr int CS_W = 32;
template <typename A, typename W>
__global__ void __launch_bounds__(CS_W * CS_W) col_sum(const A* part, const A* part1,
                                                       i64 nparts, i64 cols, W* out, W* out1) {
    __shared__ A acc[CS_W][CS_W + 1];
    if (blockIdx.y) {
        part = part1;
        out = out1;
    }
    const int tx = threadIdx.x % CS_W, ty = threadIdx.x / CS_W, ny = blockDim.x / CS_W;
    const i64 c = (i64)blockIdx.x * CS_W + tx;
    A s = A(0);
    if (c < cols)
        for (i64 i = ty; i < nparts; i += ny) s += part[i * cols + c];
    acc[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < cols) {
        A t = A(0);
        for (int j = 0; j < ny; ++j) t += acc[j][tx];
        out[c] = from_acc<W>(t);
    }
}

}  // namespace cl
