// The seed's vector_add, done the cupylab way: just the kernel. No header, no host launcher,
// no Python C-API module, no setup.py — cupylab.load_kernels() compiles it with NVRTC, caches
// the binary, and launches it on torch/CuPy/JAX/Numba arrays (see byok_example.py).
//
// Grid-stride loop: correct for any grid size, so Kernel.launch_1d may cap the grid at a few
// waves per SM and let each thread loop.
extern "C" {

__global__ void vector_add(
    const float* __restrict__ a,
    const float* __restrict__ b,
    float* __restrict__ c,
    long long n
) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        c[i] = a[i] + b[i];
    }
}

}
