"""This GPU's streaming ceiling and launch floor, measured in the running process.

Streaming bandwidth counts the bytes read plus the bytes written per second, over buffers of
1 GiB (less when the GPU has less free memory):

* a device-to-device ``cudaMemcpyAsync``;
* a float4 grid-stride copy kernel (4 vectors in flight per thread), at several grid sizes
  (multiples of the SM count, and one thread per 4 vectors without a loop).

The ceiling is the best of the two. The launch floor is the GPU time per launch of an empty
kernel back to back (CUDA events, behind a hold kernel) and the host time per launch of that
kernel through CuPy (wall clock over 3000 launches ending in a synchronize).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

__all__ = ["measure", "DEFAULT_BYTES"]

#: Buffer size for the bandwidth measurements.
DEFAULT_BYTES = 1 << 30

_SRC = r"""
extern "C" __global__ void __launch_bounds__(256)
cl_bench_copy4(const float4* __restrict__ src, float4* __restrict__ dst, long long n4) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n4; i += 4 * stride) {
        float4 a = src[i];
        float4 b = src[i + stride];
        float4 c = src[i + 2 * stride];
        float4 d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < n4; i += stride) dst[i] = src[i];
}

extern "C" __global__ void cl_bench_empty() {}
"""


def measure(session, nbytes: int = DEFAULT_BYTES, host_launches: int = 3000) -> dict:
    """Measure the streaming ceiling and the launch floor; sets ``session.ceiling_gbps``.

    Parameters
    ----------
    session : cupylab.bench._cases.Session
        Gives CuPy, the timer and the repetitions.
    nbytes : int
        Size of each of the two buffers.
    host_launches : int
        Back-to-back launches per host-time round.

    Returns
    -------
    dict
        ``gbps`` (the ceiling), ``source`` (``"memcpy"`` or ``"copy kernel"``),
        ``memcpy_gbps``, ``kernel_gbps``, ``kernel_grid``, ``kernel_block``, ``bytes``,
        ``launch_gpu_us``, ``launch_host_us``, ``method``.
    """
    cp, timer, reps = session.cp, session.timer, max(3, session.repeat)
    rt = cp.cuda.runtime
    free = int(rt.memGetInfo()[0])
    nbytes = int(min(nbytes, free // 3)) // (1 << 20) * (1 << 20)
    if nbytes < 1 << 20:
        raise MemoryError(f"cupylab-bench: only {free} bytes of GPU memory free; the ceiling "
                          "needs at least 3 MiB")
    mod = cp.RawModule(code=_SRC)
    memcpy_gbps, best_gbps, best_grid = _bandwidth(session, mod, nbytes, reps)
    cp.get_default_memory_pool().free_all_blocks()
    empty = mod.get_function("cl_bench_empty")

    def launch_empty():
        empty((1,), (1,), ())

    st = timer.events([launch_empty], reps, batch=1000)
    launch_gpu_us = st.median
    for _ in range(200):
        launch_empty()
    timer.sync()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(host_launches):
            launch_empty()
        timer.sync()
        rounds.append((time.perf_counter() - t0) * 1e6 / host_launches)
    launch_host_us = statistics.median(rounds)

    if memcpy_gbps >= best_gbps:
        gbps, source = memcpy_gbps, "memcpy"
    else:
        gbps, source = best_gbps, "copy kernel"
    session.ceiling_gbps = gbps
    return {
        "gbps": gbps, "source": source, "memcpy_gbps": memcpy_gbps, "kernel_gbps": best_gbps,
        "kernel_grid": best_grid, "kernel_block": 256, "bytes": nbytes,
        "launch_gpu_us": launch_gpu_us, "launch_host_us": launch_host_us,
        "method": (f"read+write bytes per second over {nbytes >> 20} MiB buffers, median of "
                   f"{reps} repetitions by CUDA events; best of cudaMemcpyAsync D2D and a float4 "
                   "grid-stride copy kernel; launch floor: empty kernel, GPU time back to back "
                   f"and host time over {host_launches} CuPy launches"),
    }


def _bandwidth(session, mod, nbytes, reps):
    """``(memcpy GB/s, best kernel GB/s, its grid)`` over two ``nbytes`` buffers."""
    cp, timer = session.cp, session.timer
    rt = cp.cuda.runtime
    src = cp.empty(nbytes, dtype=np.uint8)
    dst = cp.empty(nbytes, dtype=np.uint8)
    src.fill(1)
    dst.fill(0)
    timer.sync()
    moved = 2 * nbytes

    def memcpy():
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, rt.memcpyDeviceToDevice, 0)

    st = timer.events([memcpy], reps)
    memcpy_gbps = moved / (max(st.median, 1e-9) * 1e3)

    copy4 = mod.get_function("cl_bench_copy4")
    n4 = nbytes // 16
    sms = int(rt.getDeviceProperties(session.device)["multiProcessorCount"])
    grids = sorted({sms * m for m in (1, 2, 4, 8, 16, 32)} | {max(1, -(-n4 // (256 * 4)))})
    best_gbps, best_grid = 0.0, None
    n4_arg = np.int64(n4)
    for g in grids:
        def launch(g=g):
            copy4((g,), (256,), (src, dst, n4_arg))

        st = timer.events([launch], reps)
        gbps = moved / (max(st.median, 1e-9) * 1e3)
        if gbps > best_gbps:
            best_gbps, best_grid = gbps, g
    if not bool((dst[: 1 << 20] == 1).all()):
        raise RuntimeError("cupylab-bench: the ceiling's copy kernel did not copy")
    return memcpy_gbps, best_gbps, best_grid
