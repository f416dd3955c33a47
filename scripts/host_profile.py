"""Where does the host time of one small cupylab call go? Times each piece of the lean path
back to back (wall clock, µs per call) beside torch.add, then the GPU time of a few layouts
(offset views, row broadcast, scalar operands) at 2^26 beside torch. docs/architecture.md cites
its output. Needs a GPU, torch and CuPy: ``python scripts/host_profile.py``."""
import time

import torch

import cupylab
from cupylab.bench._timing import torch_events_ms
from cupylab.ops import _fast, elementwise as ew

N = 3000


def bench(label, f, n=N):
    for _ in range(300):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t) / n * 1e6
    print(f"{label:44s} {us:7.3f} us")
    return us


def gpu_us(f, reps=9, inner=20):
    """Median GPU time of one call of ``f`` in µs: ``reps`` batches of ``inner`` calls timed
    with CUDA events on torch's current stream, after one warm-up call."""
    return torch_events_ms(torch, f, inner, reps) * 1e3


x = torch.randn(1024, device="cuda")
y = torch.randn(1024, device="cuda")
z = torch.empty_like(x)
cupylab.add(x, y, out=z)
dt = ew._dtypes.DTYPES["float32"]
k = ew._kernel(0, dt, "vec_arrays")
f = k.function(0)
from cupy_backends.cuda.api import driver  # noqa: E402

buf, _, params = k._buffers()
args = (z.data_ptr(), x.data_ptr(), y.data_ptr(), 0, 0.0, 0.0, 0.0, 256, 0, 0)
raw = torch._C._cuda_getCurrentRawStream

bench("torch.add(x, y, out=z)", lambda: torch.add(x, y, out=z))
bench("x + y", lambda: x + y)
bench("cupylab.add(x, y, out=z)", lambda: cupylab.add(x, y, out=z))
bench("cupylab.add(x, y)", lambda: cupylab.add(x, y))
lean = _fast.handler(type(x))
bench("lean handler(0, x, y, ABSENT, z)", lambda: lean(0, x, y, _fast.ABSENT, z, None))
bench("cupy driver.launchKernel (raw)", lambda: driver.launchKernel(f, 1, 1, 1, 256, 1, 1, 0, 0, params, 0))
bench("Kernel.launch (pack + launch)", lambda: k.launch(0, 1, 256, 0, args))
bench("struct pack_into", lambda: k._struct.pack_into(buf, 0, *args))
bench("contiguous_plan", lambda: ew.contiguous_plan(0, dt, 1024, [1, 2, 3, 0]))
bench("raw stream lookup", lambda: raw(0))
bench("x.data_ptr()", lambda: x.data_ptr())
bench("x.get_device()", lambda: x.get_device())
bench("x.is_contiguous()", lambda: x.is_contiguous())
bench("x.requires_grad", lambda: x.requires_grad)
bench("x.is_neg()", lambda: x.is_neg())
bench("x.shape != x.shape", lambda: x.shape != y.shape)
bench("x.numel()", lambda: x.numel())
bench("x.dtype", lambda: x.dtype)
bench("x.new_empty(shape)", lambda: x.new_empty(x.shape))
bench("torch.empty_like(x)", lambda: torch.empty_like(x))
from cupy.cuda.runtime import getDevice as cupy_get_device  # noqa: E402

bench("cupy getDevice", cupy_get_device)
call = cupylab.prepare(cupylab.add, x, y, out=z)
bench("prepared call()", call)
import cupy as cp  # noqa: E402

cx, cy = cp.asarray(x), cp.asarray(y)
cz = cp.empty_like(cx)
bench("cupy.add(out=)", lambda: cp.add(cx, cy, out=cz))
bench("cupy a + b", lambda: cx + cy)
bench("cupylab.add cupy out=", lambda: cupylab.add(cx, cy, out=cz))
bench("cupylab.add cupy", lambda: cupylab.add(cx, cy))
bench("cupy get_current_stream().ptr", lambda: cp.cuda.get_current_stream().ptr)
bench("cupy a.flags.c_contiguous", lambda: cx.flags.c_contiguous)
bench("cupy a.data.ptr", lambda: cx.data.ptr)
bench("cupy.empty", lambda: cp.empty((1024,), cp.float32))

# the launch floor: empty kernels with 0, 1 and 9 parameters, params array vs one packed buffer
import ctypes  # noqa: E402

m = cp.RawModule(code=r"""
extern "C" __global__ void e0() {}
extern "C" __global__ void e1(long long a) {}
extern "C" __global__ void e9(long long a, long long b, long long c, long long d, float e,
                              float f, float g, long long h, long long i) {}
""")
fe = {k: m.get_function(k).kernel.ptr if hasattr(m.get_function(k), "kernel") else m.get_function(k).ptr
      for k in ("e0", "e1", "e9")}
pbuf = ctypes.create_string_buffer(64)
base = ctypes.addressof(pbuf)
p1 = (ctypes.c_void_p * 1)(base)
offs = [0, 8, 16, 24, 32, 36, 40, 48, 56]
p9 = (ctypes.c_void_p * 9)(*[base + o for o in offs])
size = ctypes.c_size_t(64)
extra = (ctypes.c_void_p * 5)(1, base, 2, ctypes.addressof(size), 0)
bench("launch e0 (0 params)", lambda: driver.launchKernel(fe["e0"], 1, 1, 1, 32, 1, 1, 0, 0, 0, 0))
bench("launch e1 (1 param)", lambda: driver.launchKernel(fe["e1"], 1, 1, 1, 32, 1, 1, 0, 0,
                                                          ctypes.addressof(p1), 0))
bench("launch e9 (9 params)", lambda: driver.launchKernel(fe["e9"], 1, 1, 1, 32, 1, 1, 0, 0,
                                                           ctypes.addressof(p9), 0))
bench("launch e9 (extra buffer)", lambda: driver.launchKernel(fe["e9"], 1, 1, 1, 32, 1, 1, 0, 0, 0,
                                                               ctypes.addressof(extra)))
bench("torch.cuda._sleep(0) (torch C++ launch)", lambda: torch.cuda._sleep(0))


# -- GPU time (CUDA events, median of 9 x 20 calls) at 2^26: a first look at bandwidth -------
n = 1 << 26
big = torch.empty(1 << 28, device="cuda")
big2 = torch.empty_like(big)
cop = gpu_us(lambda: big2.copy_(big))
print(f"ceiling: torch copy_ 1 GiB: {2 * big.numel() * 4 / cop / 1e3:8.0f} GB/s")
del big, big2
for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    a, b, s = (torch.randn(n, device="cuda").to(dt) for _ in range(3))
    d = torch.empty_like(a)
    isz = a.element_size()
    rows = [("vector_add", 3, lambda: cupylab.vector_add(a, b, out=d), lambda: torch.add(a, b, out=d)),
            ("fused_add_mul", 4, lambda: cupylab.fused_add_mul(a, b, s, out=d), lambda: torch.mul(torch.add(a, b), s, out=d)),
            ("fused s=scalar", 3, lambda: cupylab.fused_add_mul(a, b, 0.5, out=d), lambda: torch.mul(torch.add(a, b), 0.5, out=d)),
            ("add odd 2^26+3", 3, None, None)]
    a3, b3 = torch.randn(n + 3, device="cuda").to(dt), torch.randn(n + 3, device="cuda").to(dt)
    d3 = torch.empty_like(a3)
    rows[3] = ("add offset view", 3, lambda: cupylab.add(a3[1:-2], b3[1:-2], out=d3[1:-2]),
               lambda: torch.add(a3[1:-2], b3[1:-2], out=d3[1:-2]))
    M = 8192
    ra = torch.randn(M, n // M, device="cuda").to(dt)
    rb = torch.randn(n // M, device="cuda").to(dt)
    rd = torch.empty_like(ra)
    rows.append(("add row-broadcast", 2, lambda: cupylab.add(ra, rb, out=rd), lambda: torch.add(ra, rb, out=rd)))
    for name, nbytes_per, f_cl, f_t in rows:
        tc, tt = gpu_us(f_cl), gpu_us(f_t)
        gb = nbytes_per * n * isz / tc / 1e3
        print(f"{name:18s} {str(dt):15s} cupylab {tc:8.1f} us {gb:7.0f} GB/s | torch {tt:8.1f} us | torch/cupylab {tt / tc:5.2f}")
