"""Helpers for GPU tests: move host data (in any cupylab dtype) to and from CuPy and torch,
and poison values. Imported only by GPU tests."""
import numpy as np

from cupylab import _launch

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - the GPU image has it
    BF16 = None

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int32", "int64")
DTYPES = FLOATS + INTS


def np_dtype(name):
    return BF16 if name == "bfloat16" else np.dtype(name)


def host_data(rng, shape, dtype, kind="normal"):
    """Random host data already rounded to ``dtype`` (never zeros). ``kind='divisor'`` keeps
    magnitudes in [0.5, 2] (floats) or nonzero (ints)."""
    if dtype in INTS:
        if kind == "divisor":
            v = rng.integers(1, 50, size=shape) * rng.choice([-1, 1], size=shape)
        else:
            v = rng.integers(-1000, 1000, size=shape)
        return np.asarray(v, dtype=dtype)
    if kind == "divisor":
        v = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    else:
        v = rng.standard_normal(size=shape) * 4
    return np.asarray(v).astype(np_dtype(dtype))


def to_f64(a):
    a = np.asarray(a)
    return a.astype(np.int64) if a.dtype.kind == "i" else a.astype(np.float64)


def poison_value(dtype):
    return float("nan") if dtype in FLOATS else -0x5A5A5A5A


# -- CuPy ------------------------------------------------------------------------------------
def cupy_from_host(h):
    import cupy as cp

    if BF16 is not None and h.dtype == BF16:
        return cp.asarray(h.view(np.uint16)).view(BF16)
    return cp.asarray(h)


def cupy_to_host(a):
    import cupy as cp

    if BF16 is not None and a.dtype == BF16:
        return cp.asnumpy(a.view(cp.uint16)).view(BF16)
    return cp.asnumpy(a)


# -- torch -----------------------------------------------------------------------------------
def torch_from_host(h):
    import torch

    if BF16 is not None and h.dtype == BF16:
        return torch.from_numpy(np.require(h, requirements='C').view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.require(h, requirements='C')).cuda()


def torch_to_host(t):
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(BF16)
    return t.cpu().numpy()


def from_host(fw, h):
    return cupy_from_host(h) if fw == "cupy" else torch_from_host(h)


def to_host(a):
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        return torch_to_host(a)
    if mod == "cupy":
        return cupy_to_host(a)
    return np.asarray(a)


def empty_poisoned(fw, shape, dtype):
    h = np.full(shape, poison_value(dtype)).astype(np_dtype(dtype))
    return from_host(fw, h)


# -- holding a stream ------------------------------------------------------------------------
_HOLD_SRC = r"""
extern "C" __global__ void hold(const volatile int* flag, long long max_cycles) {
    long long t0 = clock64();
    while (*flag == 0 && clock64() - t0 < max_cycles) {
        __nanosleep(2000);
    }
}
"""


class hold:
    """Context manager: a one-thread kernel queued on the raw CUDA stream ``stream_ptr`` spins
    until the ``with`` block ends (the host then sets a flag in mapped pinned memory), so that
    what is queued behind it stays pending for as long as the test looks, however slowly the
    host runs (under compute-sanitizer too). A bail-out of ``max_seconds`` of GPU clock keeps a
    test that never leaves the block from hanging the GPU."""

    def __init__(self, stream_ptr, max_seconds=20.0):
        self.stream_ptr, self.max_seconds = int(stream_ptr), max_seconds

    _kernel = None  # compiled on first use, shared

    def __enter__(self):
        import cupy as cp

        if hold._kernel is None:
            hold._kernel = cp.RawKernel(_HOLD_SRC, "hold")
        mem = cp.cuda.alloc_pinned_memory(4)
        self.flag = np.frombuffer(mem, dtype=np.int32, count=1)
        self.flag[0] = 0
        self._mem = mem  # kept alive until the kernel has seen the flag
        cycles = np.int64(self.max_seconds * 2e9)  # at most ~2 GHz: at least max_seconds
        # cupylab's wrapper of a raw handle (CuPy 14 deprecates cupy.cuda.ExternalStream)
        self._stream = _launch.cupy_stream(self.stream_ptr, -1)
        with self._stream:
            hold._kernel((1,), (1,), (np.intp(mem.ptr), cycles))
        return self

    def __exit__(self, *exc):
        self.flag[0] = 1
        self._stream.synchronize()  # the flag outlives the kernel
        return False
