"""GPU tests of the elementwise operators: every operator x dtype x shape against a float64
reference with poisoned outputs; zero-copy, streams, graph capture, threads, frameworks."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cupylab
from cupylab import reference
from cupylab._arrays import as_view

from gpu_util import DTYPES, FLOATS, INTS, empty_poisoned, from_host, host_data, to_f64, to_host

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent

OPS = {"add": 2, "subtract": 2, "multiply": 2, "divide": 2, "floor_divide": 2, "vector_add": 2,
       "fused_add_mul": 3}


def _base_and_view(case, n_in):
    """(base shapes per operand, a function making the views from the base arrays)."""
    if case == "empty":
        return [(0,)] * n_in, lambda xs: xs
    if case == "empty2d":
        return [(3, 0)] * n_in, lambda xs: xs
    if case == "zero_d":
        return [()] * n_in, lambda xs: xs
    if case == "one":
        return [(1,)] * n_in, lambda xs: xs
    if case == "odd_large":
        return [(2**20 + 3,)] * n_in, lambda xs: xs
    if case == "odd_small":
        return [(1001,)] * n_in, lambda xs: xs
    if case == "matrix":
        return [(37, 129)] * n_in, lambda xs: xs
    if case == "noncontig":
        return [(64, 130)] * n_in, lambda xs: [x[:, ::2] for x in xs]
    if case == "offset":  # same misalignment everywhere: vector path with a peeled head
        return [(4099,)] * n_in, lambda xs: [x[1:] for x in xs]
    if case == "mixed_offsets":  # different alignments: scalar contiguous path
        return [(4099,)] * n_in, lambda xs: [x[i % 3:4096 + i % 3] for i, x in enumerate(xs)]
    if case == "broadcast":
        shapes = [(65, 1, 7), (1, 33, 7), (33, 1)][:n_in]
        return shapes, lambda xs: xs
    if case == "row_broadcast":
        shapes = [(300, 257), (257,), (300, 1)][:n_in]
        return shapes, lambda xs: xs
    if case == "transposed":
        return [(8, 9, 10)] * n_in, lambda xs: [x.transpose(2, 0, 1) if hasattr(x, "transpose")
                                                and x.ndim == 3 else x for x in xs]
    if case == "rows_bias":  # vectorised row kernel: row and column broadcasts
        shapes = [(300, 256), (256,), (300, 1)][:n_in]
        return shapes, lambda xs: xs
    if case == "rows_slice":  # vectorised row kernel: row slices of a wider array
        return [(64, 160)] * n_in, lambda xs: [x[:, 8:136] for x in xs]
    if case == "bcast_one":  # a one-element array broadcast along a vector
        shapes = [(5000,), (1,), (5000,)][:n_in]
        return shapes, lambda xs: xs
    if case == "negative":
        return [(5001,)] * n_in, lambda xs: [x[::-1] for x in xs]
    raise KeyError(case)


CASES = ["empty", "empty2d", "zero_d", "one", "odd_large", "odd_small", "matrix", "noncontig",
         "offset", "mixed_offsets", "broadcast", "row_broadcast", "transposed", "negative",
         "rows_bias", "rows_slice", "bcast_one"]


def _run_case(fw, op, dtype, case, use_out, scalar_s=False):
    rng = np.random.default_rng()
    n_in = OPS[op]
    shapes, viewer = _base_and_view(case, n_in)
    hosts = []
    for i, sh in enumerate(shapes):
        kind = "divisor" if (op in ("divide", "floor_divide") and i == 1) else "normal"
        hosts.append(host_data(rng, sh, dtype, kind))
    dev = [from_host(fw, h) for h in hosts]
    if fw == "torch" and case == "transposed":
        views = [x.permute(2, 0, 1) for x in dev]
        hviews = [h.transpose(2, 0, 1) for h in hosts]
    else:
        views = viewer(dev)
        hviews = viewer(hosts)
    args = list(views)
    hargs = [to_f64(h) for h in hviews]
    if scalar_s:
        sval = 3 if dtype in INTS else 0.75
        args[-1] = sval
        hargs[-1] = np.float64(sval) if dtype in FLOATS else np.int64(sval)
    shape = np.broadcast_shapes(*[np.shape(h) for h in hargs])
    fn = getattr(cupylab, op)
    rdt = dtype
    if op == "divide" and dtype in INTS:  # true division of ints: NumPy float64, torch float32
        rdt = "float32" if fw == "torch" else "float64"
    if use_out:
        out = empty_poisoned(fw, shape, rdt)
        res = fn(*args, out=out)
        assert res is out
    else:
        res = fn(*args)
    assert type(res).__module__.split(".")[0] == fw
    got = to_f64(to_host(res))
    assert got.shape == tuple(shape)
    ref = reference.reference(op, *hargs, dtype=rdt if rdt in INTS else None)
    if rdt in FLOATS:
        # the reference rounded to the dtype, compared at the dtype's tolerance
        ref = np.asarray(ref, dtype=np.float64)
        assert not np.isnan(got).any(), "unwritten (poisoned) or NaN elements"
    rtol, atol = reference.tolerance(rdt)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_cupy_every_op_dtype_shape(op, dtype, case):
    _run_case("cupy", op, dtype, case, use_out=True)
    _run_case("cupy", op, dtype, case, use_out=False)


TORCH_CASES = ["empty", "zero_d", "one", "odd_large", "matrix", "noncontig", "offset",
               "mixed_offsets", "broadcast", "row_broadcast", "transposed", "rows_bias",
               "rows_slice", "bcast_one"]


@pytest.mark.parametrize("case", TORCH_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_torch_every_op_dtype_shape(op, dtype, case):
    pytest.importorskip("torch")
    _run_case("torch", op, dtype, case, use_out=True)
    _run_case("torch", op, dtype, case, use_out=False)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["odd_large", "noncontig", "offset", "zero_d"])
def test_fused_add_mul_scalar_s(fw, dtype, case):
    if fw == "torch":
        pytest.importorskip("torch")
    _run_case(fw, "fused_add_mul", dtype, case, use_out=True, scalar_s=True)
    _run_case(fw, "fused_add_mul", dtype, case, use_out=False, scalar_s=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalars_on_either_side(dtype):
    import cupy as cp

    h = host_data(np.random.default_rng(), (1003,), dtype, "divisor")
    x = from_host("cupy", h)
    s = 3 if dtype in INTS else 1.5
    for op, ref in (("add", lambda a: a + s), ("subtract", lambda a: s - a),
                    ("multiply", lambda a: a * s)):
        args = (x, s) if op != "subtract" else (s, x)
        got = to_f64(to_host(getattr(cupylab, op)(*args)))
        rtol, atol = reference.tolerance(dtype)
        np.testing.assert_allclose(got, ref(to_f64(h)), rtol=rtol, atol=atol)
    assert isinstance(cupylab.div(s, x), cp.ndarray)


def test_integer_semantics_wrap_and_floor_division():
    import cupy as cp

    for dt in (cp.int32, cp.int64):
        info = np.iinfo(dt)
        x = cp.asarray([info.max, info.min, 7, -7, 7, -7, 5, info.min], dtype=dt)
        y = cp.asarray([1, -1, 2, 2, -2, -2, 0, -1], dtype=dt)
        with np.errstate(all="ignore"):
            hx, hy = cp.asnumpy(x), cp.asnumpy(y)
            np.testing.assert_array_equal(cp.asnumpy(cupylab.add(x, y)), hx + hy)
            np.testing.assert_array_equal(cp.asnumpy(cupylab.sub(x, y)), hx - hy)
            np.testing.assert_array_equal(cp.asnumpy(cupylab.mul(x, y)), hx * hy)
            np.testing.assert_array_equal(cp.asnumpy(cupylab.floor_divide(x, y)),
                                          np.floor_divide(hx, hy))


def test_float_division_by_zero_is_ieee():
    import cupy as cp

    x = cp.asarray([1.0, -1.0, 0.0], cp.float32)
    r = cp.asnumpy(cupylab.div(x, cp.zeros(3, cp.float32)))
    assert r[0] == np.inf and r[1] == -np.inf and np.isnan(r[2])


def test_exact_in_place_and_partial_overlap_as_numpy():
    """In place is one pass; a partial overlap gives NumPy's answer (through a temporary)."""
    import cupy as cp

    x = cp.arange(1000, dtype=cp.float32)
    y = cp.ones(1000, dtype=cp.float32)
    r = cupylab.add(x, y, out=x)
    assert r is x and float(x[0]) == 1.0 and float(x[-1]) == 1000.0
    for make in (lambda h: (h[1:], h[:-1]), lambda h: (h[::-1], h), lambda h: (h[:-2], h[2:])):
        h = np.arange(1000, dtype=np.float32)
        hx, hout = make(h)
        ref = h.copy()
        rx, rout = make(ref)
        np.add(rx, 1, out=rout)
        d = cp.asarray(h)
        dx, dout = make(d)
        cupylab.add(dx, 1, out=dout)
        np.testing.assert_array_equal(cp.asnumpy(d), ref)


def test_large_tensor_uses_64bit_indexing():
    import cupy as cp

    n = 2**31 + 7
    try:
        x = cp.empty(n, dtype=cp.float16)
    except cp.cuda.memory.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element test")
    x[:8] = cp.arange(8, dtype=cp.float16)
    x[-8:] = cp.arange(8, dtype=cp.float16)
    x[2**31 - 4:2**31 + 4] = 3
    one = cp.ones((1,), dtype=cp.float16)  # broadcast: the strided path, 64-bit indices
    out = cupylab.add(x, one)
    assert float(out[5]) == 6.0 and float(out[-1]) == 8.0 and float(out[2**31 + 1]) == 4.0
    out2 = cupylab.mul(x, 2.0, out=out)  # contiguous path
    assert float(out2[-2]) == 12.0 and float(out2[2**31]) == 6.0
    del x, out, out2, one
    cp.get_default_memory_pool().free_all_blocks()


# -- zero-copy ---------------------------------------------------------------------------------
def test_zero_copy_pointer_identity_cupy_torch():
    import cupy as cp

    x = cp.arange(10, dtype=cp.float32)
    assert as_view(x).ptr == x.data.ptr
    assert as_view(x[3:]).ptr == x.data.ptr + 12
    z = cp.empty_like(x)
    assert cupylab.add(x, x, out=z) is z
    torch = pytest.importorskip("torch")
    t = torch.arange(10.0, device="cuda")
    assert as_view(t).ptr == t.data_ptr() and as_view(t[2:]).ptr == t.data_ptr() + 8
    zt = torch.empty_like(t)
    assert cupylab.add(t, t, out=zt).data_ptr() == zt.data_ptr()


def test_zero_copy_jax():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    x = jnp.arange(1000, dtype=jnp.float32) + 1
    v = as_view(x)
    assert v.ptr == x.unsafe_buffer_pointer() and v.readonly
    r = cupylab.mul(x, x)
    assert isinstance(r, jax.Array)
    np.testing.assert_allclose(np.asarray(r), np.asarray(x) ** 2)
    xb = (jnp.arange(999, dtype=jnp.float32) / 7).astype(jnp.bfloat16)
    rb = cupylab.fused_add_mul(xb, xb, 0.5)
    assert rb.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(rb).astype(np.float64),
                               np.asarray(xb).astype(np.float64), rtol=8e-3)
    with pytest.raises(ValueError, match=r"add: out is read-only \(jax array\)"):
        cupylab.add(x, x, out=x)


def test_zero_copy_numba():
    cuda = pytest.importorskip("numba.cuda")
    x = cuda.to_device(np.arange(100, dtype=np.float64))
    assert as_view(x).ptr == x.device_ctypes_pointer.value
    r = cupylab.add(x, 1.0)
    assert hasattr(r, "copy_to_host") and "numba" in type(r).__module__
    np.testing.assert_allclose(r.copy_to_host(), np.arange(100) + 1.0)
    out = cuda.device_array(100, dtype=np.float64)
    assert cupylab.mul(x, x, out=out) is out
    np.testing.assert_allclose(out.copy_to_host(), np.arange(100.0) ** 2)


def test_mixed_frameworks_follow_first_array():
    import cupy as cp

    torch = pytest.importorskip("torch")
    t = torch.arange(6.0, device="cuda")
    c = cp.arange(6, dtype=cp.float32)
    assert isinstance(cupylab.add(t, c), torch.Tensor)
    assert isinstance(cupylab.add(c, t), cp.ndarray)
    assert isinstance(cupylab.add(2.0, c), cp.ndarray)  # scalars do not lead
    np.testing.assert_allclose(cp.asnumpy(cupylab.add(c, t)), np.arange(6.0) * 2)


# -- errors that need real arrays ----------------------------------------------------------
def test_torch_bad_inputs():
    torch = pytest.importorskip("torch")
    x = torch.ones(4, device="cuda", requires_grad=True)
    with pytest.raises(TypeError, match="add: x1 is a torch tensor that requires grad"):
        cupylab.add(x, x)
    c = torch.ones(4, dtype=torch.complex64, device="cuda").conj()
    with pytest.raises(TypeError, match="lazy conj/neg bit"):
        cupylab.add(c, c)
    with pytest.raises(TypeError, match="add: x2 must be a CUDA device array .*torch.Tensor"):
        cupylab.add(torch.ones(4, device="cuda"), torch.ones(4))


def test_different_gpus_refused():
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(0):
        a = cp.ones(4, cp.float32)
    with cp.cuda.Device(1):
        b = cp.ones(4, cp.float32)
    with pytest.raises(ValueError, match="arrays are on different GPUs"):
        cupylab.add(a, b)


# -- streams -------------------------------------------------------------------------------
def test_torch_side_stream_no_manual_sync():
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    n = 1 << 22
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a long kernel queued ahead of the producers
        x = torch.full((n,), 2.0, device="cuda")
        y = torch.full((n,), 3.0, device="cuda")
        z = cupylab.fused_add_mul(x, y, x)  # on side: the caller's current stream
        w = cupylab.add(z, 1.0)
    side.synchronize()
    assert float(z.min()) == 10.0 and float(z.max()) == 10.0 and float(w[123]) == 11.0


def test_stream_argument_overrides():
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    n = 1 << 20
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        x = torch.full((n,), 4.0, device="cuda")
    z = cupylab.mul(x, 0.5, stream=side)  # called from the default stream, runs on side
    side.synchronize()
    assert float(z.sum()) == 2.0 * n


def test_cai_v3_stream_is_waited_on():
    torch = pytest.importorskip("torch")
    import cupy as cp

    side = torch.cuda.Stream()
    n = 1 << 20
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x = torch.full((n,), 5.0, device="cuda")

    class Producer:  # a CAI v3 producer whose pending work is on `side`
        @property
        def __cuda_array_interface__(self):
            return {"shape": (n,), "typestr": "<f4", "data": (x.data_ptr(), False),
                    "version": 3, "stream": side.cuda_stream}

    r = cupylab.add(Producer(), 1.0)  # CuPy's default stream waits on side via an event
    assert isinstance(r, cp.ndarray)
    assert float(r.min()) == 6.0 and float(r.max()) == 6.0


def test_cupy_stream():
    import cupy as cp

    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.full(1 << 20, 1.5, dtype=cp.float32)
        r = cupylab.add(x, x)
    s.synchronize()
    assert float(r.min()) == 3.0


# -- graph capture -------------------------------------------------------------------------
def test_torch_graph_capture():
    torch = pytest.importorskip("torch")
    a = torch.randn(100_003, device="cuda")
    b = torch.randn(100_003, device="cuda")
    out = torch.empty_like(a)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cupylab.fused_add_mul(a, b, 2.0, out=out)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cupylab.fused_add_mul(a, b, 2.0, out=out)
        fresh = cupylab.add(out, a)  # allocates from the graph's pool
    a.copy_(torch.randn_like(a))
    b.copy_(torch.randn_like(b))
    g.replay()
    torch.cuda.synchronize()
    ref = (a.double() + b.double()) * 2
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(fresh.double(), ref + a.double(), rtol=1e-5, atol=1e-5)


def test_cupy_graph_capture():
    import cupy as cp

    x = cp.random.rand(5003, dtype=cp.float32)
    y = cp.random.rand(5003, dtype=cp.float32)
    z = cp.empty_like(x)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        cupylab.mul(x, y, out=z)
        s.begin_capture()
        cupylab.mul(x, y, out=z)
        cupylab.add(z, 1.0, out=z)
        g = s.end_capture()
    x[...] = cp.random.rand(5003, dtype=cp.float32)  # on the null stream, which s does not wait for
    cp.cuda.Device().synchronize()
    g.launch(s)
    s.synchronize()
    np.testing.assert_allclose(cp.asnumpy(z), cp.asnumpy(x) * cp.asnumpy(y) + 1, rtol=1e-6)


# -- threads -------------------------------------------------------------------------------
def test_two_threads_first_call_compile_once(tmp_path):
    code = r"""
import threading, cupy as cp, cupylab
from cupylab import _compile
x = cp.arange(1000, dtype=cp.float64)
barrier = threading.Barrier(2)
res, errs = [None, None], []
def work(i):
    try:
        barrier.wait()
        res[i] = float(cupylab.add(x, x).sum())
    except Exception as e:
        errs.append(repr(e))
ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
[t.start() for t in ts]; [t.join() for t in ts]
print(_compile.stats["compiled"], res, errs)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUPYLAB_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.strip()
    assert out == "1 [999000.0, 999000.0] []", out


def test_first_launch_from_a_fresh_thread():
    """A thread whose first CUDA work is a cupylab launch into preallocated memory (no runtime
    call has bound a context to it: what a Dask worker thread sees) launches correctly, for
    the operators, their lean path and users' kernels."""
    import threading

    import cupy as cp

    x = cp.arange(4099, dtype=cp.float32)
    z = cp.empty_like(x)
    k = cupylab.load_kernels(source=
        'extern "C" __global__ void twice(const float* a, float* b, int n) {'
        ' int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) b[i] = 2 * a[i]; }')["twice"]
    w = cp.empty_like(x)
    cupylab.add(x, x, out=z)  # compiled and loaded here; the threads only launch
    k(x, w, x.size, grid=17, block=256)
    cp.cuda.Device().synchronize()
    z.fill(0)
    w.fill(0)
    cp.cuda.Device().synchronize()
    errs = []

    def work(f):
        try:
            f()
            cp.cuda.get_current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(repr(e))

    for f in (lambda: cupylab.add(x, x, out=z), lambda: k(x, w, x.size, grid=17, block=256)):
        t = threading.Thread(target=work, args=(f,))
        t.start()
        t.join()
    assert not errs, errs
    np.testing.assert_array_equal(cp.asnumpy(z), 2 * np.arange(4099, dtype=np.float32))
    np.testing.assert_array_equal(cp.asnumpy(w), 2 * np.arange(4099, dtype=np.float32))


def test_new_process_loads_from_disk_cache(tmp_path):
    code = ("import cupy as cp, cupylab; from cupylab import _compile; "
            "x = cp.arange(10, dtype=cp.int64); cupylab.add(x, x); "
            "print(_compile.stats['compiled'], _compile.stats['disk_hits'])")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUPYLAB_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           check=True).stdout.split()
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            check=True).stdout.split()
    assert first == ["1", "0"] and second == ["0", "1"]


# -- the lean path, prepared calls and the graph helper ------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_kernel_every_head_and_tail(dtype):
    """ew_contig's peeled head and tail: every start offset inside a 16-byte vector and every
    size up to three vectors (and two larger ones), array and scalar operands; nothing is
    written outside the output view (the poison around it survives)."""
    from gpu_util import np_dtype, poison_value

    rng = np.random.default_rng()
    vw = 16 // np.dtype(np_dtype(dtype)).itemsize
    for off in range(vw):
        for n in list(range(3 * vw + 2)) + [257, 1000]:
            size = off + n + 9
            hs = [host_data(rng, (size,), dtype) for _ in range(3)]
            a, b, s = (from_host("cupy", h) for h in hs)
            sl = slice(off, off + n)
            for op, args, hargs in (
                    ("add", (a[sl], b[sl]), (hs[0][sl], hs[1][sl])),
                    ("mul", (a[sl], 3), (hs[0][sl], 3)),
                    ("fused_add_mul", (a[sl], b[sl], s[sl]), (hs[0][sl], hs[1][sl], hs[2][sl])),
                    ("fused_add_mul", (a[sl], b[sl], 2), (hs[0][sl], hs[1][sl], 2))):
                ref = reference.reference(op, *[
                    to_f64(h) if isinstance(h, np.ndarray) else
                    (np.float64(h) if dtype in FLOATS else np.int64(h)) for h in hargs],
                                          dtype=dtype if dtype in INTS else None)
                rtol, atol = reference.tolerance(dtype)
                poison = to_f64(np.asarray([poison_value(dtype)]).astype(np_dtype(dtype)))
                for kw in ({}, {"stream": 0}):  # the lean path, then the general one
                    out = empty_poisoned("cupy", (size,), dtype)
                    getattr(cupylab, op)(*args, out=out[sl], **kw)
                    got = to_f64(to_host(out))
                    msg = f"{op} offset {off} n {n} {kw}"
                    np.testing.assert_allclose(got[sl], ref, rtol=rtol, atol=atol, err_msg=msg)
                    outside = np.concatenate([got[:off], got[off + n:]])
                    np.testing.assert_array_equal(outside, np.full_like(outside, poison[0]),
                                                  err_msg=f"{msg}: wrote outside the view")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_large_launches_with_the_residency_cap(dtype):
    """Launches of at least STREAM_MIN_GRID blocks run with the shared-memory residency cap
    (on compute capability 9.x: checked to be in force) and stay correct: an odd-sized offset
    view, array and scalar operands, through the lean path, the general path (stream=0) and
    a prepared call; nothing written outside the view."""
    import cupy as cp

    from cupylab import _launch
    from gpu_util import np_dtype, poison_value

    rng = np.random.default_rng()
    vw = 16 // np.dtype(np_dtype(dtype)).itemsize
    n = _launch.STREAM_MIN_GRID * 256 * vw + 3
    off, size = 1, n + 6
    sl = slice(off, off + n)
    hs = [host_data(rng, (size,), dtype) for _ in range(3)]
    a, b, s = (from_host("cupy", h) for h in hs)
    rtol, atol = reference.tolerance(dtype)
    poison = to_f64(np.asarray([poison_value(dtype)]).astype(np_dtype(dtype)))[0]
    for op, args, hargs in (("add", (a[sl], b[sl]), (hs[0][sl], hs[1][sl])),
                            ("fused_add_mul", (a[sl], b[sl], s[sl]),
                             (hs[0][sl], hs[1][sl], hs[2][sl])),
                            ("fused_add_mul", (a[sl], b[sl], 2), (hs[0][sl], hs[1][sl], 2))):
        ref = reference.reference(op, *[to_f64(h) if isinstance(h, np.ndarray) else np.float64(h)
                                        for h in hargs])
        for how in ("lean", "general", "prepared"):
            out = empty_poisoned("cupy", (size,), dtype)
            if how == "prepared":
                cupylab.prepare(getattr(cupylab, op), *args, out=out[sl])()
            else:
                getattr(cupylab, op)(*args, out=out[sl], **({"stream": 0} if how == "general"
                                                            else {}))
            got = to_f64(to_host(out))
            msg = f"{op} {dtype} n {n} {how}"
            np.testing.assert_allclose(got[sl], ref, rtol=rtol, atol=atol, err_msg=msg)
            outside = np.concatenate([got[:off], got[off + n:]])
            np.testing.assert_array_equal(outside, np.full_like(outside, poison),
                                          err_msg=f"{msg}: wrote outside the view")
    if cp.cuda.Device().compute_capability.startswith("9"):
        assert _launch._stream_smem[cp.cuda.Device().id] > 0


def test_rows_kernel_more_rows_than_grid_y():
    """More than 65535 rows: the row kernel spreads rows over grid y and z (the choice is
    checked on CPU in test_ufunc_cpu.py; here the results)."""
    import cupy as cp

    rows = 70001
    x = cp.random.standard_normal((rows, 128), dtype=cp.float32)
    bias = cp.random.standard_normal(128, dtype=cp.float32)
    col = cp.random.standard_normal((rows, 1), dtype=cp.float32)
    out = cp.full((rows, 128), cp.nan, dtype=cp.float32)
    cupylab.add(x, bias, out=out)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(x) + cp.asnumpy(bias))
    res = cupylab.fused_add_mul(x, bias, col)
    ref = (cp.asnumpy(x).astype(np.float64) + cp.asnumpy(bias)) * cp.asnumpy(col)
    np.testing.assert_allclose(cp.asnumpy(res), ref, rtol=1e-6, atol=1e-6)


def test_fast_path_taken_for_plain_contiguous_calls_only():
    import cupy as cp

    from cupylab.ops import _fast

    def lean(op, x, y, z=_fast.ABSENT, out=None, allow=None):
        return _fast.handler(type(x))(op, x, y, z, out, allow)

    x = cp.arange(1000, dtype=cp.float32)
    assert lean(0, x, x) is not _fast.MISS
    assert lean(0, x[::2], x[::2]) is _fast.MISS  # strided: general path
    r = lean(0, x, x.astype(cp.float64))  # mixed dtypes: the lean mixed path
    assert r.dtype == cp.float64 and float(r[999]) == 1998.0
    xi = cp.arange(1, 1001, dtype=cp.int32)
    r = lean(3, xi, xi + 1)  # integer true division: float64, through the lean mixed path
    assert r.dtype == cp.float64 and float(r[0]) == 0.5
    assert lean(0, x, 2.0j) is _fast.MISS  # a complex scalar: general path
    assert lean(1, xi.astype(cp.bool_), xi.astype(cp.bool_)) is _fast.MISS  # refused: general
    torch = pytest.importorskip("torch")
    t = torch.arange(1000.0, device="cuda")
    r = lean(5, t, t, 2.0, None, (False, False, True))
    assert r is not _fast.MISS and torch.equal(r, (t + t) * 2)
    g = t.clone().requires_grad_()
    assert lean(0, g, t) is _fast.MISS
    assert lean(0, t, t, out=t[1:].clone()) is _fast.MISS  # bad out shape


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_prepare(fw):
    if fw == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    ha, hb = host_data(rng, (100_001,), "float32"), host_data(rng, (100_001,), "float32")
    a, b = from_host(fw, ha), from_host(fw, hb)
    d = empty_poisoned(fw, (100_001,), "float32")
    call = cupylab.prepare(cupylab.fused_add_mul, a, b, 0.5, out=d)
    assert call() is d
    np.testing.assert_allclose(to_f64(to_host(d)), (to_f64(ha) + to_f64(hb)) * 0.5, rtol=1e-6)
    a[...] = 1.0  # new values in the same storage are seen by the next call
    call()
    np.testing.assert_allclose(to_f64(to_host(d)), (1.0 + to_f64(hb)) * 0.5, rtol=1e-6)
    c2 = cupylab.prepare(cupylab.sub, a[::2], b[::2])  # strided, allocating
    r = c2()
    assert r is c2.out
    np.testing.assert_allclose(to_f64(to_host(r)), 1.0 - to_f64(hb[::2]), rtol=1e-6)
    c3 = cupylab.prepare(cupylab.multiply, a, 2, out=empty_poisoned(fw, (100_001,), "float64"))
    np.testing.assert_allclose(to_f64(to_host(c3())), 2.0, rtol=0)  # float32 * 2 into float64


def test_graph_helper_with_jax_inputs():
    """JAX arrays (DLPack producers) read inside a capture: JAX is asked for no stream (None:
    it waits on the host; it takes DLPack's -1 for a handle), so it adds no wait on an event of
    its own stream, which would end the capture. Their data is ready before the capture, as
    the README asks."""
    pytest.importorskip("jax")
    import jax.numpy as jnp

    rng = np.random.default_rng()
    ha, hb = host_data(rng, (4099,), "float32"), host_data(rng, (4099,), "float32")
    a, b = jnp.asarray(ha), jnp.asarray(hb)
    a.block_until_ready()
    b.block_until_ready()
    d = empty_poisoned("cupy", (4099,), "float32")
    cupylab.fused_add_mul(a, b, 2.0, out=d)  # warm-up: compile and load outside the capture
    g = cupylab.Graph()
    with g.capture():
        cupylab.fused_add_mul(a, b, 2.0, out=d)
    d[...] = 0.0
    g.replay()
    np.testing.assert_allclose(to_f64(to_host(d)), (to_f64(ha) + to_f64(hb)) * 2, rtol=1e-6)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_graph_helper(fw):
    if fw == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    ha, hb = host_data(rng, (4099,), "float32"), host_data(rng, (4099,), "float32")
    a, b = from_host(fw, ha), from_host(fw, hb)
    d = empty_poisoned(fw, (4099,), "float32")
    cupylab.fused_add_mul(a, b, 2.0, out=d)  # warm-up
    cupylab.add(d, a, out=d)
    g = cupylab.Graph()
    with g.capture():
        cupylab.fused_add_mul(a, b, 2.0, out=d)
        cupylab.add(d, a, out=d)
    a[...] = 3.0
    g.replay()
    if fw == "torch":
        import torch

        torch.cuda.synchronize()
    np.testing.assert_allclose(to_f64(to_host(d)), (3.0 + to_f64(hb)) * 2 + 3.0, rtol=1e-6)
