"""Bring your own kernel on the GPU: launches with each framework's arrays, streams, scalar
packing end to end, structs, 2-D grids, large shared memory, ElementwiseKernel, graph capture,
and the examples in scripts/examples (run as a user would run them)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupylab
from cupylab import CompileError, _launch
from cupylab import kernels as K
from cupylab.kernels import ElementwiseKernel, load_kernels

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "scripts" / "examples"
N = 100_003  # odd: no grid divides it


# ---------------------------------------------------------------------------------------------
# fixtures
@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def torch():
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return t


@pytest.fixture(scope="module")
def jax():
    j = pytest.importorskip("jax")
    try:
        if j.devices()[0].platform != "gpu":
            pytest.skip(f"JAX runs on {j.devices()[0].platform}, not the GPU")
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend ({e})")
    return j


@pytest.fixture(scope="module")
def numba_cuda():
    nc = pytest.importorskip("numba.cuda")
    if not nc.is_available():
        pytest.skip("numba.cuda sees no GPU")
    return nc


@pytest.fixture
def launches(monkeypatch):
    """Record every launch of a users' kernel where the driver is called: the full path
    (``Kernel.launch``) and the lean one (``cupylab._kfast`` binders) both end there.
    Each record: grid, block, stream and dynamic shared memory (x dimensions)."""
    rec = []
    real = _launch._launch_kernel()

    def spy(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        rec.append({"grid": gx, "block": bx, "stream": stream, "smem": smem})
        return real(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra)

    monkeypatch.setattr(_launch, "_driver_launch", spy)
    return rec


@pytest.fixture(scope="module")
def vadd():
    return load_kernels(EXAMPLES / "vector_add.cu")["vector_add"]


@pytest.fixture(scope="module")
def fused():
    return ElementwiseKernel(load_kernels(EXAMPLES / "fused.cu"), "fused_add_mul<{T}>")


def host(n=N, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 4).astype(dtype)


# ---------------------------------------------------------------------------------------------
# CuPy
@pytest.mark.parametrize("n", [1, 257, N])
def test_vector_add_cupy(cp, vadd, launches, n):
    a_h, b_h = host(n, seed=1), host(n, seed=2)
    a, b = cp.asarray(a_h), cp.asarray(b_h)
    c = cp.full(n, cp.nan, dtype=cp.float32)  # poison: unwritten elements show
    vadd.launch_1d(n, a, b, c, n)
    np.testing.assert_array_equal(cp.asnumpy(c), a_h + b_h)
    sm = cupylab._runtime.device_info(a.device.id).sm_count
    assert launches[-1]["grid"] == min(-(-n // 256), sm * K.BLOCKS_PER_SM_1D)
    assert launches[-1]["stream"] == cp.cuda.get_current_stream().ptr
    c2 = cp.full(n, cp.nan, dtype=cp.float32)
    vadd(a, b, c2, n, grid=(n + 127) // 128, block=128)
    np.testing.assert_array_equal(cp.asnumpy(c2), a_h + b_h)


def test_cupy_current_and_given_streams(cp, vadd, launches):
    a = cp.asarray(host())
    c = cp.empty_like(a)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        vadd.launch_1d(N, a, a, c, N)
    assert launches[-1]["stream"] == s.ptr
    s2 = cp.cuda.Stream(non_blocking=True)
    vadd.launch_1d(N, a, a, c, N, stream=s2)
    assert launches[-1]["stream"] == s2.ptr
    vadd.launch_1d(N, a, a, c, N, stream=s2.ptr)
    assert launches[-1]["stream"] == s2.ptr
    s2.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(c), cp.asnumpy(a) * 2)


def test_views_pass_their_data_pointer(cp):
    k = load_kernels(source=r'''
    extern "C" __global__ void first(const float* x, float* out) { out[0] = x[0]; }''')["first"]
    a = cp.arange(10, dtype=cp.float32)
    out = cp.zeros(1, cp.float32)
    k(a[3:], out, grid=1, block=1)
    assert float(out[0]) == 3.0  # the offset view's pointer, not the base allocation's


# ---------------------------------------------------------------------------------------------
# torch
def test_vector_add_torch_on_torch_current_stream(torch, vadd, launches):
    a_h, b_h = host(seed=3), host(seed=4)
    a, b = torch.from_numpy(a_h).cuda(), torch.from_numpy(b_h).cuda()
    c = torch.full_like(a, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        vadd.launch_1d(N, a, b, c, N)
    assert launches[-1]["stream"] == s.cuda_stream
    s.synchronize()
    np.testing.assert_array_equal(c.cpu().numpy(), a_h + b_h)
    vadd.launch_1d(N, a, b, c, N, stream=s)  # a torch stream object as stream=
    assert launches[-1]["stream"] == s.cuda_stream


# ---------------------------------------------------------------------------------------------
# JAX, Numba, generic CAI / DLPack
def test_jax_inputs_are_read_only(jax, cp, vadd, launches):
    jnp = jax.numpy
    a_h, b_h = host(seed=6), host(seed=7)
    a, b = jnp.asarray(a_h), jnp.asarray(b_h)
    c = cp.full(N, cp.nan, dtype=cp.float32)
    vadd.launch_1d(N, a, b, c, N)  # const float* inputs: fine
    np.testing.assert_array_equal(cp.asnumpy(c), a_h + b_h)
    n_before = len(launches)
    with pytest.raises(ValueError, match=r"'c' \(float\* c\) is a non-const pointer.*read-only "
                                         r"jax array"):
        vadd.launch_1d(N, c, c, a, N)
    assert len(launches) == n_before  # nothing launched


def test_numba_arrays(numba_cuda, vadd):
    a_h, b_h = host(seed=8), host(seed=9)
    s = numba_cuda.stream()
    a = numba_cuda.to_device(a_h, stream=s)  # CAI v3 with a stream: waited on, not synced
    b = numba_cuda.to_device(b_h, stream=s)
    c = numba_cuda.device_array(N, np.float32, stream=s)
    vadd.launch_1d(N, a, b, c, N, stream=s)  # numba's stream object (a ctypes handle)
    got = c.copy_to_host(stream=s)
    s.synchronize()
    np.testing.assert_array_equal(got, a_h + b_h)
    c2 = numba_cuda.device_array(N, np.float32)
    vadd.launch_1d(N, a, b, c2, N)
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(c2.copy_to_host(), a_h + b_h)


class _OnlyCAI:
    def __init__(self, a):
        self._a = a
        self.__cuda_array_interface__ = a.__cuda_array_interface__


class _OnlyDLPack:
    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_generic_cai_and_dlpack_objects(cp, vadd):
    a_h, b_h = host(seed=10), host(seed=11)
    a, b = cp.asarray(a_h), cp.asarray(b_h)
    c = cp.full(N, cp.nan, dtype=cp.float32)
    vadd.launch_1d(N, _OnlyCAI(a), _OnlyDLPack(b), _OnlyCAI(c), N)
    np.testing.assert_array_equal(cp.asnumpy(c), a_h + b_h)
    c2 = cp.full(N, cp.nan, dtype=cp.float32)
    vadd.launch_1d(N, a.data.ptr, b.data.ptr, c2.data.ptr, N)  # raw device addresses
    np.testing.assert_array_equal(cp.asnumpy(c2), a_h + b_h)


# ---------------------------------------------------------------------------------------------
# scalars, structs, configurations
def test_scalar_packing_end_to_end(cp):
    k = load_kernels(source=r'''
    extern "C" __global__ void echo(int a, double b, long long c, unsigned char u, float f,
                                    bool flag, unsigned int ui, short sh, size_t sz, char ch,
                                    double* out) {
        out[0] = a; out[1] = b; out[2] = (double)c; out[3] = u; out[4] = f; out[5] = flag;
        out[6] = ui; out[7] = sh; out[8] = (double)sz; out[9] = ch;
    }''')["echo"]
    out = cp.full(10, cp.nan, dtype=cp.float64)
    k(-7, 2.5, -(2**40), 200, np.float32(0.25), True, 2**32 - 1, -300, 2**40 + 1,
      np.int8(-5), out, grid=1, block=1)
    np.testing.assert_array_equal(
        cp.asnumpy(out),
        [-7, 2.5, -(2**40), 200, 0.25, 1, 2**32 - 1, -300, 2**40 + 1, -5])


def test_16bit_float_scalars(cp):
    # cupylab's own 16-bit storage types (cuda_src/cupylab_common.cuh spells them the same):
    # the scalar arrives as its IEEE bit pattern, 2 bytes wide, without CUDA's headers.
    k = load_kernels(source=r'''
    namespace cl { struct __align__(2) half_t { unsigned short bits; };
                   struct __align__(2) bf16_t { unsigned short bits; }; }
    extern "C" __global__ void echo16(cl::half_t h, int pad, cl::bf16_t b, int* out) {
        out[0] = h.bits; out[1] = pad; out[2] = b.bits;
    }''')["echo16"]
    assert k.signature.formats == ("H", "i", "H", "Q")
    out = cp.zeros(3, cp.int32)
    k(1.5, 7, -2.75, out, grid=1, block=1)
    np.testing.assert_array_equal(cp.asnumpy(out), [0x3E00, 7, 0xC030])


def test_cuda_fp16_header_scalars(cp):
    if K.cuda_include_dir() is None:
        pytest.skip("no CUDA toolkit headers (cuda_fp16.h) found")
    k = load_kernels(source=r'''
    #include <cuda_fp16.h>
    extern "C" __global__ void h(__half s, __half* x, long long n) {
        for (long long i = 0; i < n; ++i) x[i] = __hmul(x[i], s);
    }''')["h"]
    x = cp.arange(4, dtype=cp.float16)
    k(np.float16(2), x, 4, grid=1, block=1)
    np.testing.assert_array_equal(cp.asnumpy(x), np.arange(4, dtype=np.float16) * 2)


def test_struct_and_vector_by_value(cp):
    src = r'''
    struct Params { float a; int b; double c; };
    extern "C" __global__ void st(Params p, float4 v, int2 w, double* out) {
        out[0] = p.a; out[1] = p.b; out[2] = p.c;
        out[3] = v.x + 10 * v.y + 100 * v.z + 1000 * v.w; out[4] = w.x - w.y;
    }'''
    k = load_kernels(source=src, struct_formats={"Params": "fid"})["st"]
    out = cp.zeros(5, cp.float64)
    k((1.5, -3, 0.125), (1, 2, 3, 4), (10, 4), out, grid=1, block=1)
    np.testing.assert_array_equal(cp.asnumpy(out), [1.5, -3, 0.125, 4321, 6])


def test_2d_grid_and_block(cp):
    k = load_kernels(source=r'''
    extern "C" __global__ void idx2d(int* out, int w, int h) {
        int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
        if (x < w && y < h) out[y * w + x] = y * 1000 + x;
    }''')["idx2d"]
    h, w = 37, 45
    out = cp.full((h, w), -1, dtype=cp.int32)
    k(out, w, h, grid=(-(-w // 16), -(-h // 8)), block=(16, 8))
    yy, xx = np.mgrid[:h, :w]
    np.testing.assert_array_equal(cp.asnumpy(out), yy * 1000 + xx)


def test_large_dynamic_shared_memory(cp, launches):
    k = load_kernels(source=r'''
    extern "C" __global__ void smem_sum(const float* x, float* out, int n) {
        extern __shared__ float buf[];
        for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = x[i];
        __syncthreads();
        if (threadIdx.x == 0) { float s = 0; for (int i = 0; i < n; ++i) s += buf[i]; out[0] = s; }
    }''')["smem_sum"]
    n = 20000  # 80 000 bytes: above the 48 KiB default, needs the opt-in attribute
    x = cp.ones(n, cp.float32)
    out = cp.zeros(1, cp.float32)
    k(x, out, n, grid=1, block=256, shared_mem=n * 4)
    assert float(out[0]) == n
    assert launches[-1]["smem"] == n * 4


def test_template_instances_compiled_on_demand(cp):
    m = load_kernels(source=r'''
    template <typename T, int K>
    __global__ void scale(T* x, T s, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = x[i] * s + K; }''',
        name_expressions=["scale<float, 1>"])
    x = cp.arange(5, dtype=cp.float32)
    m["scale<float, 1>"](x, 2.0, 5, grid=1, block=32)
    np.testing.assert_array_equal(cp.asnumpy(x), np.arange(5) * 2 + 1)
    y = cp.arange(5, dtype=cp.int64)
    m["scale<long long, 0>"](y, 3, 5, grid=1, block=32)  # not listed: its own program
    np.testing.assert_array_equal(cp.asnumpy(y), np.arange(5) * 3)
    with pytest.raises(TypeError, match="needs int64 data but got a int32"):
        m["scale<long long, 0>"](cp.zeros(5, cp.int32), 3, 5, grid=1)


def test_compile_error_on_first_launch(cp, launches):
    m = load_kernels(source='extern "C" __global__ void k(float* x) {\n  x[0] = nope;\n}\n',
                     filename="user_kernel.cu")
    with pytest.raises(CompileError, match=r"user_kernel\.cu\(2\): error"):
        m["k"](cp.zeros(1, cp.float32), grid=1, block=1)


def test_graph_capture(cp, vadd):
    a = cp.asarray(host(seed=12))
    c = cp.zeros_like(a)
    s = cp.cuda.Stream(non_blocking=True)
    vadd.launch_1d(N, a, a, c, N, stream=s)  # compile/load outside the capture
    s.synchronize()
    c.fill(0)  # on the null stream, which s (non-blocking) does not wait for
    cp.cuda.Device().synchronize()
    s.begin_capture()
    vadd.launch_1d(N, a, a, c, N, stream=s)
    g = s.end_capture()
    g.launch(stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(c), cp.asnumpy(a) * 2)


def test_cupylab_graph_captures_user_kernels(cp, vadd):
    if not hasattr(cupylab, "Graph"):
        pytest.skip("cupylab.Graph is not available")
    a = cp.asarray(host(seed=24))
    c = cp.zeros_like(a)
    vadd.launch_1d(N, a, a, c, N)  # compile and load before capturing
    cp.cuda.Device().synchronize()
    c.fill(0)
    g = cupylab.Graph()
    with g.capture():
        vadd.launch_1d(N, a, a, c, N)
    assert float(cp.abs(c).max()) == 0.0  # recorded, not run
    g.replay()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(c), cp.asnumpy(a) * 2)


# ---------------------------------------------------------------------------------------------
# ElementwiseKernel
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64"])
def test_elementwise_cupy(cp, fused, dtype):
    a_h = (host(seed=13) * 10).astype(dtype)
    b_h = (host(seed=14) * 10).astype(dtype)
    s = 3 if dtype.startswith("int") else 0.5
    a, b = cp.asarray(a_h), cp.asarray(b_h)
    d = fused(a, b, s)
    assert isinstance(d, cp.ndarray) and d.dtype == np.dtype(dtype) and d.shape == (N,)
    ref = (a_h + b_h) * np.asarray(s, dtype=dtype)
    np.testing.assert_array_equal(cp.asnumpy(d), ref)


def test_elementwise_torch_out_and_streams(torch, fused, launches):
    a_h, b_h = host(seed=15), host(seed=16)
    a, b = torch.from_numpy(a_h).cuda(), torch.from_numpy(b_h).cuda()
    d = fused(a, b, 2.0)
    assert isinstance(d, torch.Tensor) and d.dtype == torch.float32 and d.is_cuda
    np.testing.assert_array_equal(d.cpu().numpy(), (a_h + b_h) * np.float32(2))
    out = torch.full_like(a, float("nan"))
    r = fused(a, b, 2.0, out=out)
    assert r is out  # written in place, zero-copy
    np.testing.assert_array_equal(out.cpu().numpy(), (a_h + b_h) * np.float32(2))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        e = fused(a, b, 1.0)
    assert launches[-1]["stream"] == s.cuda_stream
    s.synchronize()
    np.testing.assert_array_equal(e.cpu().numpy(), a_h + b_h)
    r = fused(a, b, 1.0, out=a)  # exactly in place is allowed
    assert r is a
    np.testing.assert_array_equal(a.cpu().numpy(), a_h + b_h)


def test_elementwise_2d(cp, fused):
    # the refusals (transposed, broadcast, mixed dtypes, empty) are in test_kernels_lean.py
    a = cp.asarray(host(600, seed=17).reshape(20, 30))
    b = cp.asarray(host(600, seed=18).reshape(20, 30))
    d = fused(a, b, 2.0)
    assert d.shape == (20, 30)
    np.testing.assert_array_equal(cp.asnumpy(d), (cp.asnumpy(a) + cp.asnumpy(b)) * 2)


def test_elementwise_fixed_kernel_int_size_guard(cp, vadd):
    k = load_kernels(source=r'''
    extern "C" __global__ void add_i(const float* x, const float* y, float* out, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = x[i] + y[i]; }''')
    add = ElementwiseKernel(k["add_i"])  # one thread per element, no grid-stride loop
    a = cp.asarray(host(seed=19))
    np.testing.assert_array_equal(cp.asnumpy(add(a, a)), cp.asnumpy(a) * 2)
    with pytest.raises(TypeError, match="needs float32 arrays but the arrays are float64"):
        add(a.astype(cp.float64), a.astype(cp.float64))


def test_elementwise_jax_and_numba_results(jax, fused):
    jnp = jax.numpy
    a_h, b_h = host(seed=20), host(seed=21)
    d = fused(jnp.asarray(a_h), jnp.asarray(b_h), 2.0)
    assert isinstance(d, jax.Array)
    np.testing.assert_array_equal(np.asarray(d), (a_h + b_h) * np.float32(2))


def test_elementwise_numba_result(numba_cuda, fused):
    a_h, b_h = host(seed=22), host(seed=23)
    d = fused(numba_cuda.to_device(a_h), numba_cuda.to_device(b_h), 2.0)
    assert numba_cuda.is_cuda_array(d)
    import cupy

    cupy.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(d.copy_to_host(), (a_h + b_h) * np.float32(2))


# ---------------------------------------------------------------------------------------------
# the lean path (cupylab._kfast): the second launch of an argument pattern skips the checks
@pytest.fixture
def checked(monkeypatch):
    """Count launches that took the full, checked path (Kernel and ElementwiseKernel)."""
    from cupylab._ewkernel import ElementwiseKernel as EK
    from cupylab._kernel import Kernel

    count = [0]
    for cls, name in ((Kernel, "_launch_checked"), (EK, "_call_checked")):
        orig = getattr(cls, name)

        def spy(*a, _orig=orig, **kw):
            count[0] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(cls, name, spy)
    return count


def _lean_round(to_host, vadd, fused, make, n, checked):
    a_h, b_h = host(n, seed=n), host(n, seed=n + 1)
    a, b = make(a_h), make(b_h)
    for rep in range(3):
        c = make(np.full(n, np.nan, np.float32))
        vadd.launch_1d(n, a, b, c, n)
        np.testing.assert_array_equal(to_host(c), a_h + b_h)
        d = fused(a, b, 2.0)
        np.testing.assert_array_equal(to_host(d), (a_h + b_h) * np.float32(2))
        o = make(np.full(n, np.nan, np.float32))
        assert fused(a, b, 0.5, out=o) is o
        np.testing.assert_array_equal(to_host(o), (a_h + b_h) * np.float32(0.5))
        if rep == 0:
            first = checked[0]
    assert checked[0] == first  # the later rounds took the lean path


@pytest.mark.parametrize("n", [1, 257, N])
def test_lean_path_results_cupy(cp, vadd, fused, checked, n):
    _lean_round(cp.asnumpy, vadd, fused, cp.asarray, n, checked)


@pytest.mark.parametrize("n", [1, N])
def test_lean_path_results_torch(torch, vadd, fused, checked, n):
    _lean_round(lambda t: t.cpu().numpy(), vadd, fused,
                lambda h: torch.from_numpy(h).cuda(), n, checked)
    a = torch.ones(8, device="cuda")
    with pytest.raises(TypeError, match="requires grad"):  # a warmed pattern still checks
        vadd.launch_1d(8, a, a.clone().requires_grad_(), a, 8)


# ---------------------------------------------------------------------------------------------
# the examples, run as a user runs them
def test_byok_example_script(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUPYLAB_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(EXAMPLES / "byok_example.py")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "byok_example: all checks passed" in r.stdout
    assert "cupy: vector_add OK" in r.stdout or "torch: vector_add OK" in r.stdout
    try:
        import torch

        if torch.cuda.is_available():
            assert "torch: vector_add OK, fused_add_mul float32/float64 OK (returns " \
                   "torch.Tensor)" in r.stdout
    except ImportError:
        pass
