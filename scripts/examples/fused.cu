// A user's fused kernel: out = (a + b) * s in one pass (the seed's "kernel fusion" scenario,
// c = a + b; d = c * s), templated on the element type. Each dtype is one NVRTC name
// expression: cupylab instantiates fused_add_mul<float>, fused_add_mul<double>, ... on demand.
//
// Parameter order follows cupylab.ElementwiseKernel's convention: the output pointer, the
// inputs (arrays and scalars, in the order the Python function takes them), the element count.
// No __restrict__: out may be exactly one of the inputs (in place), which ElementwiseKernel
// allows because every element is read and written by the same thread.
template <typename T>
__global__ void fused_add_mul(T* out, const T* a, const T* b, T s, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = (a[i] + b[i]) * s;
    }
}
