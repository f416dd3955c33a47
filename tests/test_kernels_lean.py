"""The lean launch path of users' kernels (cupylab._kfast), without a GPU.

Fake ``torch`` and ``cupy`` modules (tensors and arrays that expose the attributes both paths
read, never dereferenced) go through a simulated runtime (``sim`` in conftest.py): the first
launch of an argument pattern takes the full, checked path and leaves a binder; later launches
of the pattern use it. These tests show that the binder launches exactly what the full path
launches (same packed bytes, grid, stream, device), that a different dtype, type or
const-ness takes the full path again, and that every documented error is still raised, with
nothing launched.
"""
import contextlib
import sys
import threading
import types

import numpy as np
import pytest

from cupylab import (_arrays, _dtypes, _elementwise_core, _kfast, _kmodule, _launch,
                     _runtime)
from cupylab.kernels import ElementwiseKernel, Kernel, load_kernels

from conftest import FakeCAI

SRC = r'''
extern "C" __global__ void vadd(const float* x, const float* y, float* out, int n) {}
extern "C" __global__ void mix(const void* raw, double* d, long long a, float f, __half h,
                               bool b, unsigned char u, int* p) {}
template <typename T>
__global__ void fam(T* out, const T* a, const T* b, T s, long long n) {}
extern "C" __global__ void addf(const float* x, const float* y, float* z, int n) {}
template <typename T>
__global__ void cpy(T* out, const T* a, long long n) {}
'''
TORCH_STREAM, CUPY_STREAM = 0x7000, 0x8000


class FW:
    """The fake frameworks of one test: ``FW.t(...)`` makes a tensor, ``FW.c(...)`` an
    array; ``FW.allocs`` counts allocations, ``FW.recorded`` the streams made current for an
    allocation."""


@pytest.fixture
def fw(monkeypatch, sim):
    torch = types.ModuleType("torch")
    cupy = types.ModuleType("cupy")
    f = FW()
    f.allocs = 0
    f.recorded = []
    next_ptr = [0x7E0000000000]

    def new_ptr(nbytes):
        p = next_ptr[0]
        next_ptr[0] += max(nbytes, 1) + 4096
        f.allocs += 1
        return p

    class DType:
        def __init__(self, name, itemsize):
            self.name, self.itemsize = name, itemsize

        def __repr__(self):
            return f"torch.{self.name}"

    for d in _dtypes.DTYPES.values():
        setattr(torch, d.name, DType(d.name, d.itemsize))
    torch.float8_e4m3fn = DType("float8_e4m3fn", 1)
    torch.strided, torch.sparse_coo = object(), object()

    class Tensor:
        def __init__(self, shape=(8,), dtype="float32", ptr=None, device=0, requires_grad=False,
                     layout=None, neg=False, conj=False, strides=None):
            self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            self.shape = tuple(shape)
            self._n = int(np.prod(self.shape))
            self._ptr = new_ptr(self._n * self.dtype.itemsize) if ptr is None else ptr
            self._device, self.requires_grad = device, requires_grad
            self.layout = torch.strided if layout is None else layout
            self._neg, self._conj = neg, conj
            c = tuple(_elementwise_core.c_strides(self.shape))
            self._strides = c if strides is None else tuple(strides)
            self._contig = self._strides == c

        is_cuda = property(lambda self: self._device >= 0)

        def get_device(self):
            return self._device

        def data_ptr(self):
            if self.layout is not torch.strided:
                raise RuntimeError("no storage")
            return self._ptr

        def stride(self):
            return self._strides

        def is_contiguous(self):
            return self._contig

        def is_neg(self):
            return self._neg

        def is_conj(self):
            return self._conj

        def __array__(self):  # as torch's: host data is named as such in messages
            raise AssertionError("never converted")

        def record_stream(self, s):
            f.recorded.append(("record", s))

        def numel(self):
            return self._n

        def element_size(self):
            return self.dtype.itemsize

    Tensor.__module__ = "torch"
    torch.Tensor = Tensor
    torch.device = lambda kind, index: ("device", kind, index)
    torch.empty = lambda shape, dtype, device: Tensor(shape, dtype, device=device[2])
    torch.empty_like = lambda x: Tensor(x.shape, x.dtype, device=x.get_device())
    @contextlib.contextmanager
    def torch_stream(ext):  # allocations inside come from that stream's free list
        f.recorded.append(ext)
        yield

    torch.cuda = types.SimpleNamespace(ExternalStream=lambda s, device: ("ext", s, device),
                                       stream=torch_stream)
    monkeypatch.setattr(_launch, "_torch_streams", {})

    class Mem:
        def __init__(self, ptr, device_id):
            self.ptr, self.device_id = ptr, device_id

    class ndarray:
        def __init__(self, shape=(8,), dtype="float32", ptr=None, device=0, strides=None):
            self.dtype = np.dtype(dtype)
            self.shape = tuple(shape)
            self.size = int(np.prod(self.shape))
            isz = self.dtype.itemsize
            c = tuple(s * isz for s in _elementwise_core.c_strides(self.shape))
            self.strides = c if strides is None else tuple(strides)
            self._c_contiguous = self.strides == c
            self.data = Mem(new_ptr(self.size * isz) if ptr is None else ptr, device)
            self.device = types.SimpleNamespace(id=device)

    ndarray.__module__ = "cupy"
    cupy.ndarray = ndarray
    cupy.empty = lambda shape, dtype: ndarray(shape, dtype)
    cupy.cuda = types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=CUPY_STREAM),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=lambda d: contextlib.nullcontext())

    @contextlib.contextmanager
    def cupy_stream(ptr, device):  # allocations inside come from that stream's pool
        f.recorded.append(("cupy", ptr, device))
        yield

    monkeypatch.setattr(_launch, "cupy_stream", cupy_stream)

    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_kmodule, "_modules", {})  # fresh kernels: no binders of other tests
    monkeypatch.setattr(_arrays, "_ADAPTERS", {})
    monkeypatch.setattr(_arrays, "_torch_dtypes", {})
    monkeypatch.setattr(_arrays, "_torch_strided", None)
    monkeypatch.setattr(_elementwise_core, "_torch_dt", {})
    monkeypatch.setattr(_elementwise_core, "_torch_dev", {})
    monkeypatch.setattr(_runtime, "cupy", lambda: cupy)
    monkeypatch.setattr(_kfast, "_torch_empty_like", torch.empty_like)
    monkeypatch.setattr(_kfast, "_cupy_ndarray", ndarray)
    monkeypatch.setattr(_launch, "current_stream",
                        lambda kind, d: (TORCH_STREAM if kind == "torch" else CUPY_STREAM) + d)
    f.torch, f.cupy, f.t, f.c, f.launches = torch, cupy, Tensor, ndarray, sim["launches"]
    f.full = 0

    def counting(orig):
        def wrapper(*a, **k):
            f.full += 1
            return orig(*a, **k)
        return wrapper

    monkeypatch.setattr(Kernel, "_launch_checked", counting(Kernel._launch_checked))
    monkeypatch.setattr(ElementwiseKernel, "_call_checked",
                        counting(ElementwiseKernel._call_checked))
    return f


def mod():
    return load_kernels(source=SRC)


def packed(k, launch):
    return k._k._struct.pack(*launch["args"])


def twice(fw, call):
    """Run ``call`` twice: the second launch takes the lean path (the first one too when the
    pattern is known already)."""
    call()
    first, full = fw.launches[-1], fw.full
    call()
    assert fw.full == full, "the second launch did not take the lean path"
    return first, fw.launches[-1]


# =============================================================================================
# Kernel
@pytest.mark.parametrize("kind", ["torch", "cupy", "mixed"])
def test_binder_launches_what_the_full_path_launches(fw, kind):
    k = mod()["vadd"]
    mk = {"torch": [fw.t] * 3, "cupy": [fw.c] * 3, "mixed": [fw.c, fw.t, fw.c]}[kind]
    x, y, o = (m() for m in mk)
    first, second = twice(fw, lambda: k.launch_1d(8, x, y, o, 8))
    assert first == second and fw.full == 1  # the full path, then the binder
    assert packed(k, second) == k.pack(x, y, o, 8)
    assert second["stream"] == (CUPY_STREAM if kind == "cupy" else TORCH_STREAM)
    assert second["grid"] == (1, 1, 1) and second["block"] == (256, 1, 1)
    # new values, same pattern: still the binder, still the full path's bytes
    x2, o2 = mk[0](), mk[2]()
    k(x2, y, o2, 5, grid=(3, 2), block=(64, 2), stream=0x42)
    assert fw.full == 1
    last = fw.launches[-1]
    assert packed(k, last) == k.pack(x2, y, o2, 5)
    assert last["grid"] == (3, 2, 1) and last["block"] == (64, 2, 1) and last["stream"] == 0x42
    k.launch_1d(10**8, x, y, o, 8, block=128, stream=types.SimpleNamespace(ptr=0x43))
    assert fw.launches[-1]["grid"] == (132 * 32, 1, 1) and fw.launches[-1]["stream"] == 0x43
    assert fw.full == 1
    assert len(k._binders) == 1


def test_the_lean_launch_calls_the_driver_itself(fw, sim, monkeypatch):
    # after the first launch of a pattern, the binder's launcher packs the kernel's parameter
    # buffer and calls cuLaunchKernel in the same function (Kernel.launch is not called)
    k = mod()["vadd"]
    x, y, o = fw.c(), fw.c(), fw.t()
    k.launch_1d(8, x, y, o, 8)
    assert sim["direct"] == 0 and fw.full == 1
    k.launch_1d(8, x, y, o, 8)
    k(x, y, o, 8, grid=2, block=32)
    assert sim["direct"] == 2 and fw.full == 1
    assert fw.launches[-1]["grid"] == (2, 1, 1) and fw.launches[-1]["block"] == (32, 1, 1)
    assert packed(k, fw.launches[-1]) == k.pack(x, y, o, 8)

    # a driver error is the caller's: raised, not taken for a miss of the lean path
    def refuse(*a):
        raise RuntimeError("CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES")

    monkeypatch.setattr(_launch, "_driver_launch", refuse)
    n = len(fw.launches)
    with pytest.raises(RuntimeError, match="OUT_OF_RESOURCES"):
        k.launch_1d(8, x, y, o, 8)
    assert fw.full == 1 and len(fw.launches) == n


def test_a_new_thread_takes_the_binder_once_to_make_its_parameter_buffer(fw, sim):
    k = mod()["vadd"]
    x, y, o = fw.t(), fw.t(), fw.t()
    twice(fw, lambda: k.launch_1d(8, x, y, o, 8))
    direct, n = sim["direct"], len(fw.launches)
    t = threading.Thread(target=lambda: [k.launch_1d(8, x, y, o, 8) for _ in range(2)])
    t.start()
    t.join()
    # the thread's first launch had no buffer: Kernel.launch made it; its second was direct
    assert len(fw.launches) == n + 2 and sim["direct"] == direct + 1 and fw.full == 1
    assert fw.launches[-2] == fw.launches[-1]


def test_the_installed_launch_1d_takes_every_other_call_to_the_method(fw, sim):
    # a bound pattern installs its one-frame launch_1d on the kernel: it launches directly,
    # and passes any call it does not take to the method, which checks and explains
    import inspect

    k = mod()["vadd"]
    sig = inspect.signature(k.launch_1d)
    x, y, o = fw.c(), fw.c(), fw.c()
    tx, ty, to = fw.t(), fw.t(), fw.t()
    k.launch_1d(8, x, y, o, 8)
    assert "launch_1d" in vars(k) and fw.full == 1
    assert inspect.signature(k.launch_1d) == sig
    assert k.launch_1d.__doc__ == Kernel.launch_1d.__doc__
    direct = sim["direct"]
    for a in ((x, y, o), (tx, ty, to), (x, y, o), (tx, ty, to)):  # alternating patterns
        k.launch_1d(16, *a, 16, block=64)
        assert packed(k, fw.launches[-1]) == k.pack(*a, 16)
        assert fw.launches[-1]["grid"] == (1, 1, 1) and fw.launches[-1]["block"] == (64, 1, 1)
    # the first call went directly; each switch of pattern through the method's bound path
    assert fw.full == 2 and sim["direct"] == direct + 1
    k.launch_1d(16, tx, ty, to, 16, block=64, shared_mem=1024)  # the pattern installed last
    assert fw.launches[-1]["smem"] == 1024 and sim["direct"] == direct + 2
    x, y, o = tx, ty, to
    n = len(fw.launches)
    for bad, exc, match in [((8, x, y, o), TypeError, r"takes 4 arguments \(got 3\)"),
                            ((8, x, y, o, 8, 9), TypeError, r"takes 4 arguments \(got 5\)"),
                            ((-1, x, y, o, 8), ValueError, "non-negative"),
                            ((True, x, y, o, 8), ValueError, "non-negative"),
                            ((8.0, x, y, o, 8), ValueError, "non-negative")]:
        with pytest.raises(exc, match=match):
            k.launch_1d(*bad)
    with pytest.raises(TypeError, match="blok"):
        k.launch_1d(8, x, y, o, 8, blok=64)
    with pytest.raises(ValueError, match="1-D block"):
        k.launch_1d(8, x, y, o, 8, block=(32, 2))
    with pytest.raises(ValueError, match="block dimensions"):
        k.launch_1d(8, x, y, o, 8, block=0)
    assert len(fw.launches) == n  # nothing launched
    k.launch_1d(0, x, y, o, 0)  # nothing to do: the method's path, nothing launched
    full, direct = fw.full, sim["direct"]
    k.launch_1d(8, x, y, o, 8, block=1024)  # the largest block, on the installed path
    assert len(fw.launches) == n + 1 and fw.launches[-1]["block"] == (1024, 1, 1)
    Kernel.launch_1d(k, 8, x, y, o, 8)  # the method itself still works
    assert len(fw.launches) == n + 2 and fw.full == full and sim["direct"] == direct + 2


def test_binder_scalars_untyped_pointers_and_addresses(fw):
    k = mod()["mix"]
    raw, d = fw.t(dtype="int32"), fw.t(dtype="float64")
    args = (raw, d, -(2**40), 0.1, 1.5, True, 200, None)
    first, second = twice(fw, lambda: k(*args, grid=1))
    assert first == second and packed(k, second) == k.pack(*args)
    # void* takes any supported dtype on the binder; the int* parameter takes an address
    args = (fw.t(dtype="float16"), d, 2**62, -3.4e38, -2.75, False, 0, 0x7F0000000040)
    k(*args, grid=1)
    assert packed(k, fw.launches[-1]) == k.pack(*args)
    assert fw.full == 2  # int instead of None for p: a new pattern, full path once
    k(fw.t(dtype="int8"), d, 5, 2.0, 0.5, True, 1, 0x7F0000000080, grid=1)
    assert fw.full == 2
    k(fw.t(dtype="complex64"), d, 5, 2.0, 0.5, True, 1, 0, grid=1)  # void*: any dtype
    n = len(fw.launches)
    with pytest.raises(TypeError, match="unsupported dtype"):
        k(fw.t(dtype=fw.torch.float8_e4m3fn), d, 5, 2.0, 0.5, True, 1, 0, grid=1)
    with pytest.raises(TypeError, match="lazy conj/neg"):
        k(fw.t(dtype="complex64", conj=True), d, 5, 2.0, 0.5, True, 1, 0, grid=1)
    with pytest.raises(OverflowError, match="64-bit pointer"):
        k(raw, d, 5, 2.0, 0.5, True, 1, -1, grid=1)
    with pytest.raises(OverflowError, match="round to inf"):
        k(raw, d, 5, 1e39, 0.5, True, 1, 0, grid=1)
    with pytest.raises(OverflowError, match="round to inf"):
        k(raw, d, 5, 2.0, 70000.0, True, 1, 0, grid=1)
    with pytest.raises(OverflowError, match="unsigned char"):
        k(raw, d, 5, 2.0, 0.5, True, 256, 0, grid=1)
    with pytest.raises(TypeError, match="bool parameter"):
        k(raw, d, 5, 2.0, 0.5, 2, 1, 0, grid=1)  # int for bool: another pattern, full path
    assert len(fw.launches) == n


def test_different_dtype_type_or_constness_takes_the_full_path(fw):
    k = mod()["vadd"]
    x, o = fw.t(), fw.t()
    k.launch_1d(8, x, x, o, 8)
    n = len(fw.launches)
    with pytest.raises(TypeError, match=r"'y' \(const float\* y\) needs float32 data but got a "
                                        r"float64 torch array"):
        k.launch_1d(8, x, fw.t(dtype="float64"), o, 8)
    assert len(fw.launches) == n
    k.launch_1d(8, x, fw.c(), o, 8)  # another type: the full path, then its own binder
    assert len(k._binders) == 2
    ro = FakeCAI((8,), "<f4", ptr=0x9000, readonly=True)
    k.launch_1d(8, ro, x, o, 8)  # const float* x: a read-only array is fine
    assert k._binders[(FakeCAI, fw.t, fw.t, int)] is None  # CAI: never bound, always checked
    with pytest.raises(ValueError, match=r"'out' \(float\* out\) is a non-const pointer.*"
                                         "read-only cai array"):
        k.launch_1d(8, x, x, ro, 8)
    full = fw.full
    k.launch_1d(8, ro, x, o, 8)
    assert fw.full == full + 1


@pytest.mark.parametrize("change, exc, match", [
    (dict(y=dict(requires_grad=True)), TypeError, "requires grad"),
    (dict(y=dict(device=-1)), TypeError, "host data"),
    (dict(y=dict(neg=True)), TypeError, "lazy conj/neg"),
    (dict(y=dict(layout="sparse")), TypeError, "only strided"),
    (dict(y=dict(dtype="int32")), TypeError, "needs float32 data but got a int32 torch array"),
    (dict(y=dict(device=1)), ValueError, "different GPUs"),
    (dict(n=2**31), OverflowError, r"2147483648 does not fit the C type int"),
    (dict(n=8.0), TypeError, "integer parameter"),
    (dict(n=np.float32(1)), TypeError, "integer parameter"),
    (dict(stream="s"), TypeError, "stream must be"),
    (dict(args=3), TypeError, r"takes 4 arguments \(got 3\)"),
])
def test_every_error_still_raised_after_warm_up(fw, change, exc, match):
    k = mod()["vadd"]
    x, y, o = fw.t(), fw.t(), fw.t()
    twice(fw, lambda: k.launch_1d(8, x, y, o, 8))
    n = len(fw.launches)
    ykw = dict(change.get("y", {}))
    if ykw.get("layout") == "sparse":
        ykw["layout"] = fw.torch.sparse_coo
    y2 = fw.t(**ykw) if ykw else y
    args = (x, y2, o, change.get("n", 8))[:change.get("args", 4)]
    with pytest.raises(exc, match=match):
        k.launch_1d(8, *args, stream=change.get("stream"))
    assert len(fw.launches) == n  # nothing launched


def test_cupy_strides_checked_on_the_binder(fw):
    k = mod()["mix"]
    d = fw.c(dtype="float64")
    k(fw.c(dtype="int32"), d, 1, 1.0, 1.0, True, 1, None, grid=1)
    ok = fw.c((4,), "int32", strides=(8,))  # a strided view: fine for void*
    k(ok, d, 1, 1.0, 1.0, True, 1, None, grid=1)
    assert fw.full == 1 and fw.launches[-1]["args"][0] == ok.data.ptr
    with pytest.raises(ValueError, match="not multiples of the item size"):
        k(fw.c((4,), "int32", strides=(6,)), d, 1, 1.0, 1.0, True, 1, None, grid=1)


def test_other_current_device_and_empty_launches_take_the_full_path(fw, monkeypatch):
    k = mod()["vadd"]
    x, y, o = (fw.t(device=1) for _ in range(3))
    monkeypatch.setattr(_runtime, "current_device", lambda: 1)
    twice(fw, lambda: k.launch_1d(8, x, y, o, 8))
    assert fw.launches[-1]["stream"] == TORCH_STREAM + 1
    monkeypatch.setattr(_runtime, "current_device", lambda: 0)
    entered = []
    monkeypatch.setattr(_launch, "ensure_device", lambda d: entered.append(d) or _Null())
    full = fw.full
    k.launch_1d(8, x, y, o, 8)
    assert fw.full == full + 1 and entered == [1]  # the full path makes cuda:1 current
    n = len(fw.launches)
    k.launch_1d(0, x, y, o, 0)
    k(x, y, o, 8, grid=(4, 0))
    assert len(fw.launches) == n and fw.full == full + 3


def test_empty_cupy_arrays_launch_nothing(fw):
    k = mod()["vadd"]
    z = fw.c((0,), ptr=0)
    k.launch_1d(0, z, z, z, 0)
    k(z, z, z, 0, grid=0)
    assert fw.launches == []


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# =============================================================================================
# ElementwiseKernel
@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_elementwise_lean_call_matches_the_full_path(fw, kind):
    e = ElementwiseKernel(mod(), "fam<{T}>", block=128)
    mk = fw.t if kind == "torch" else fw.c
    a, b, out = mk((4, 50)), mk((4, 50)), mk((4, 50))
    first, second = twice(fw, lambda: e(a, b, 0.5, out=out))
    assert first == second and fw.full == 1  # the full path, then the lean one
    assert second["name"] == "fam<float>" and second["grid"] == (2, 1, 1)
    ptr = (lambda v: v.data_ptr()) if kind == "torch" else (lambda v: v.data.ptr)
    assert second["args"][:3] == (ptr(out), ptr(a), ptr(b)) and second["args"][4] == 200
    assert second["stream"] == (TORCH_STREAM if kind == "torch" else CUPY_STREAM)
    r1 = e(a, b, 2)  # int scalar: another pattern (full path once), then lean
    r2 = e(a, b, 3)
    assert type(r1) is type(r2) is mk and r2.shape == (4, 50) and r2.dtype == a.dtype
    assert fw.launches[-1]["args"][1:] == (ptr(a), ptr(b), 3.0, 200)
    assert fw.launches[-1]["args"][0] == ptr(r2)
    full = fw.full
    d64 = [mk((4, 50), "float64") for _ in range(3)]
    e(d64[0], d64[1], 0.25, out=d64[2])  # a new dtype for the pattern: full path, learned
    e(d64[0], d64[1], 0.25, out=d64[2])
    assert fw.full == full + 1 and fw.launches[-1]["name"] == "fam<double>"
    assert e(a, b, 1.0, out=a) is a  # exactly in place
    assert fw.full == full + 1


@pytest.mark.parametrize("kind", ["torch", "cupy"])
def test_elementwise_errors_after_warm_up(fw, kind):
    e = ElementwiseKernel(mod(), "fam<{T}>")
    mk = fw.t if kind == "torch" else fw.c
    a, b, out = mk((20, 30)), mk((20, 30)), mk((20, 30))
    twice(fw, lambda: e(a, b, 2.0, out=out))
    twice(fw, lambda: e(a, b, 2.0))
    n = len(fw.launches)
    shifted = mk((20, 30), ptr=(a.data_ptr() if kind == "torch" else a.data.ptr) + 4)
    with pytest.raises(ValueError, match="out overlaps a without being exactly the same view"):
        e(a, b, 2.0, out=shifted)
    with pytest.raises(ValueError, match="C-contiguous with the output's shape"):
        e(a, mk((30,)), 2.0)  # broadcasting would need a strided kernel
    with pytest.raises(TypeError, match="dtypes must match"):
        e(a, mk((20, 30), "float64"), 2.0)
    with pytest.raises(ValueError, match="shape"):
        e(a, b, 2.0, out=mk((30, 20)))
    with pytest.raises(TypeError, match="is a real parameter"):
        e(a, b, 2j)
    if kind == "torch":
        with pytest.raises(ValueError, match="C-contiguous with the output's shape"):
            e(a, fw.t((20, 30), strides=(1, 20)), 2.0)
        with pytest.raises(TypeError, match="requires grad"):
            e(a, fw.t((20, 30), requires_grad=True), 2.0)
        with pytest.raises(ValueError, match="different GPUs"):
            e(a, fw.t((20, 30), device=1), 2.0)
        cpu = fw.t((20, 30), device=-1)  # the lean path reads no is_cuda: device -1 misses
        for args, kw in (((a, cpu, 2.0), {}), ((cpu, b, 2.0), {}), ((a, b, 2.0), {"out": cpu})):
            with pytest.raises(TypeError, match="host"):
                e(*args, **kw)
    else:
        with pytest.raises(ValueError, match="C-contiguous with the output's shape"):
            e(a, fw.c((20, 30), strides=(4, 80)), 2.0)  # a transposed view
    assert len(fw.launches) == n
    if kind == "torch":  # a lazily conjugated tensor is refused, warm pattern or not
        cp = ElementwiseKernel(mod(), "cpy<{T}>", type_names={"complex64": "float2"})
        c = fw.t((5,), "complex64")
        twice(fw, lambda: cp(c))
        n = len(fw.launches)
        with pytest.raises(TypeError, match="conj"):
            cp(fw.t((5,), "complex64", conj=True))
        with pytest.raises(TypeError, match="conj"):
            cp(c, out=fw.t((5,), "complex64", conj=True))
        assert len(fw.launches) == n
    z = mk((0, 3))
    r = e(z, z, 1.0)
    assert r.shape == (0, 3) and len(fw.launches) == n


def test_elementwise_size_guard_and_streams(fw):
    addf = ElementwiseKernel(mod()["addf"])
    a = fw.t((8,))
    twice(fw, lambda: addf(a, a))
    big = fw.t((2**31,))
    with pytest.raises(OverflowError, match=r"'n' \(int n\): 2147483648 does not fit"):
        addf(big, big)
    full = fw.full
    r = addf(a, a, stream=0x42)  # allocating on another stream: the full path, from its free list
    assert fw.full == full + 1 and fw.recorded == [("ext", 0x42, 0),
                                                   ("record", ("ext", TORCH_STREAM, 0))]
    assert fw.launches[-1]["stream"] == 0x42 and type(r) is fw.t
    addf(a, a, out=a, stream=0x42)  # writing into out= on another stream: lean
    assert fw.full == full + 1 and fw.launches[-1]["stream"] == 0x42
    c = fw.c((8,))
    twice(fw, lambda: addf(c, c))
    full = fw.full
    addf(c, c, stream=CUPY_STREAM)  # CuPy's current stream given explicitly: lean
    assert fw.full == full and len(fw.recorded) == 2
    r = addf(c, c, stream=0x42)  # CuPy memory for another stream: the full path, from its pool
    assert fw.full == full + 1 and fw.recorded[2:] == [("cupy", 0x42, 0)]
    assert fw.launches[-1]["stream"] == 0x42 and type(r) is fw.c


def test_equal_numpy_dtypes_need_not_be_the_same_object(fw):
    k = mod()["vadd"]
    e = ElementwiseKernel(mod()["addf"])
    x, o = fw.c(), fw.c()
    twice(fw, lambda: k.launch_1d(8, x, x, o, 8))
    twice(fw, lambda: e(x, x, out=o))
    full = fw.full
    y = fw.c()
    y.dtype = np.dtype("f4", metadata={"tag": 1})  # equal to float32, another object
    assert y.dtype is not x.dtype and y.dtype == x.dtype
    k.launch_1d(8, x, y, o, 8)
    assert fw.launches[-1]["args"][1] == y.data.ptr
    e(x, y, out=o)
    assert fw.launches[-1]["args"][1] == y.data.ptr
    assert fw.full == full


def test_cupy_dtype_checked_on_the_binder(fw):
    k = mod()["vadd"]
    x, o = fw.c(), fw.c()
    twice(fw, lambda: k.launch_1d(8, x, x, o, 8))
    n = len(fw.launches)
    with pytest.raises(TypeError, match=r"'y' \(const float\* y\) needs float32 data but got a "
                                        r"float64 cupy array"):
        k.launch_1d(8, x, fw.c(dtype="float64"), o, 8)
    with pytest.raises(ValueError, match="different GPUs"):
        k.launch_1d(8, x, fw.c(device=1), o, 8)
    assert len(fw.launches) == n


def test_misaligned_cupy_views_take_the_full_path_and_are_refused(fw):
    """A byte-offset .view() of another dtype (a float32 array starting 2 bytes into its
    buffer) is refused by the full path; the lean paths of users' kernels and elementwise
    kernels launched on it once a pattern was warm (the vector kernels would fault on the
    misaligned address)."""
    k = mod()["vadd"]
    x, y, o = fw.c(), fw.c(), fw.c()
    twice(fw, lambda: k.launch_1d(8, x, y, o, 8))
    bad = fw.c(ptr=x.data.ptr + 2)
    e = ElementwiseKernel(mod(), "fam<{T}>")
    a, b = fw.c((20, 30)), fw.c((20, 30))
    twice(fw, lambda: e(a, b, 2.0))
    twice(fw, lambda: e(a, b, 2.0, out=fw.c((20, 30))))
    n = len(fw.launches)
    shifted = fw.c((20, 30), ptr=a.data.ptr + 2)
    for call in (lambda: k.launch_1d(8, bad, y, o, 8), lambda: k.launch_1d(8, x, y, bad, 8),
                 lambda: e(shifted, b, 2.0), lambda: e(a, shifted, 2.0),
                 lambda: e(a, b, 2.0, out=shifted)):
        with pytest.raises(ValueError, match="not aligned to its item size"):
            call()
    assert len(fw.launches) == n


def test_the_operators_lean_path_misses_on_misaligned_cupy_views(fw, monkeypatch):
    """cupylab.add's lean CuPy handlers (one dtype, mixed dtypes) leave a misaligned operand
    or out to the general path, which refuses it; aligned ones still launch there."""
    from cupylab.ops import _fast

    launched = []
    monkeypatch.setattr(_fast, "_launch", lambda *a: launched.append(a))
    monkeypatch.setattr(_fast, "_launch_mixed", lambda *a: launched.append(a))
    monkeypatch.setattr(_fast, "_get_device", None)
    op = 0  # add
    x, y, o = fw.c(), fw.c(), fw.c()
    h16 = fw.c(dtype="float16")
    assert _fast._cupy(op, x, y, _fast.ABSENT, o, None) is o
    assert _fast._cupy_mixed(op, x, h16, _fast.ABSENT, o) is o
    assert len(launched) == 2
    bad = fw.c(ptr=x.data.ptr + 2)
    bad16 = fw.c(dtype="float16", ptr=h16.data.ptr + 1)
    for args in ((bad, y, o), (x, bad, o), (x, y, bad)):
        assert _fast._cupy(op, *args[:2], _fast.ABSENT, args[2], None) is _fast.MISS
    for args in ((bad, h16, o), (x, bad16, o), (x, h16, bad)):
        assert _fast._cupy_mixed(op, *args[:2], _fast.ABSENT, args[2]) is _fast.MISS
    assert len(launched) == 2
