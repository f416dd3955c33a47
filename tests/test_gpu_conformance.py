"""Conformance of the arithmetic operators with NumPy (CuPy callers) and torch (torch callers),
on the GPU: every dtype pair, Python and NumPy scalars on either side, out= with every casting
rule, broadcasting, strided and overlapping views, size 0. The device data is made from host
NumPy arrays and the answer is NumPy's (or torch's) own result on host copies: the same dtype,
the same values (exactly for integers and bools; within one rounding of the result dtype for
floats, where NumPy and the GPU may contract differently)."""
import numpy as np
import pytest

import cupylab

from gpu_util import BF16, cupy_from_host, cupy_to_host

pytestmark = pytest.mark.gpu
ml_dtypes = pytest.importorskip("ml_dtypes")

DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
UFUNCS = {"add": np.add, "subtract": np.subtract, "multiply": np.multiply,
          "divide": np.divide, "floor_divide": np.floor_divide}
RTOL = {"float16": 1e-3, "bfloat16": 8e-3, "float32": 2e-6, "float64": 1e-13,
        "complex64": 2e-6, "complex128": 1e-13}


def npdt(name):
    return np.dtype(BF16) if name == "bfloat16" else np.dtype(name)


def host(rng, name, n):
    """Random host data over the dtype's range (integers: every value, zeros included)."""
    d = npdt(name)
    if name == "bool":
        return rng.random(n) < 0.5
    if d.kind in "iu":
        info = np.iinfo(d)
        v = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=d)
        k = min(n, 4)
        v[:k] = [0, 1, info.max, info.min][:k]
        return v
    if d.kind == "c":
        return ((rng.standard_normal(n) + 1j * rng.standard_normal(n)) * 4).astype(d)
    v = (rng.standard_normal(n) * 8).astype(d)
    v[:min(n, 2)] = 0
    return v


def dev(h):
    return cupy_from_host(np.ascontiguousarray(h)) if h.ndim else cupy_from_host(h)


def numpy_answer(uf, *args, **kw):
    try:
        with np.errstate(all="ignore"):
            return uf(*args, **kw)
    except (TypeError, OverflowError) as e:
        return e


def bf16_weak(want, ha, s):
    """NumPy's answer in bfloat16 for a bfloat16 array with a Python bool, int or float: NEP
    50, which cupylab follows for bfloat16 whatever the ml_dtypes version (README, differences
    from NumPy); older ml_dtypes versions' ufunc loops give float32 there."""
    if (isinstance(want, np.ndarray) and ha.dtype == npdt("bfloat16")
            and type(s) in (bool, int, float)):
        return want.astype(ha.dtype)
    return want


def check(got, want, where):
    """Same dtype and values as NumPy's answer."""
    g = cupy_to_host(got)
    assert g.dtype == want.dtype, f"{where}: dtype {g.dtype} (NumPy {want.dtype})"
    assert g.shape == want.shape, where
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(g, want, err_msg=where)
        return
    name = "bfloat16" if want.dtype == npdt("bfloat16") else want.dtype.name
    wide = np.complex128 if want.dtype.kind == "c" else np.float64
    g, w = g.astype(wide), want.astype(wide)
    fin = np.isfinite(w)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"{where}: nan positions")
    np.testing.assert_array_equal(g[~fin & ~np.isnan(w)], w[~fin & ~np.isnan(w)], err_msg=where)
    scale = max(1.0, float(np.abs(w[fin]).max(initial=0)))
    np.testing.assert_allclose(g[fin], w[fin], rtol=RTOL[name], atol=RTOL[name] * scale,
                               err_msg=where)


def run_both(op, hargs, dargs, **kw):
    """Call NumPy and cupylab; either both refuse (TypeError) or both give the same result."""
    want = numpy_answer(UFUNCS[op], *hargs, **kw)
    where = f"{op}{tuple(getattr(a, 'dtype', type(a).__name__) for a in hargs)} {kw}"
    if isinstance(want, Exception):
        with pytest.raises(type(want) if isinstance(want, OverflowError) else TypeError):
            getattr(cupylab, op)(*dargs, **kw)
        return
    got = getattr(cupylab, op)(*dargs, **kw)
    check(got, np.asarray(want), where)


@pytest.mark.parametrize("op", list(UFUNCS))
@pytest.mark.parametrize("a", DTYPES)
def test_every_dtype_pair(op, a):
    rng = np.random.default_rng()
    ha = host(rng, a, 1003)
    da = dev(ha)
    for b in DTYPES:
        hb = host(rng, b, 1003)
        run_both(op, (ha, hb), (da, dev(hb)))


SCALARS = [True, 3, -2, 2.5, 1.5 - 0.5j, np.float32(0.75), np.int64(5), np.uint8(7),
           np.float16(1.5), np.array(2.0)]


@pytest.mark.parametrize("op", ["add", "multiply", "divide", "subtract", "floor_divide"])
def test_scalars_on_either_side(op):
    rng = np.random.default_rng()
    for a in DTYPES:
        ha = host(rng, a, 257)
        da = dev(ha)
        for s in SCALARS:
            want_l = bf16_weak(numpy_answer(UFUNCS[op], ha, s), ha, s)
            if isinstance(want_l, Exception) or not isinstance(want_l, np.ndarray):
                with pytest.raises((TypeError, OverflowError)):
                    getattr(cupylab, op)(da, s)
            else:
                check(getattr(cupylab, op)(da, s), want_l, f"{op}({a}, {s!r})")
            want_r = bf16_weak(numpy_answer(UFUNCS[op], s, ha), ha, s)
            if isinstance(want_r, Exception):
                with pytest.raises((TypeError, OverflowError)):
                    getattr(cupylab, op)(s, da)
            else:
                check(getattr(cupylab, op)(s, da), want_r, f"{op}({s!r}, {a})")


def test_python_int_out_of_range_is_numpys_overflow_error():
    import cupy as cp

    x = cp.zeros(4, cp.int8)
    with pytest.raises(OverflowError, match="out of bounds for int8"):
        cupylab.add(x, 300)
    np.testing.assert_array_equal(cp.asnumpy(cupylab.add(x, 2**40 + 0.5)), np.add(
        np.zeros(4, np.int8), 2**40 + 0.5))  # a float scalar promotes instead


@pytest.mark.parametrize("casting", ["no", "equiv", "safe", "same_kind", "unsafe"])
def test_out_every_casting(casting):
    rng = np.random.default_rng()
    hx, hy = host(rng, "float32", 513), host(rng, "int16", 513)
    dx, dy = dev(hx), dev(hy)
    for o in DTYPES:
        hout = np.zeros(513, npdt(o))
        want = numpy_answer(np.add, hx, hy, out=hout, casting=casting)
        dout = dev(np.zeros(513, npdt(o)))
        if isinstance(want, Exception):
            with pytest.raises(TypeError, match="Cannot cast ufunc 'add' (input|output)"):
                cupylab.add(dx, dy, out=dout, casting=casting)
            continue
        r = cupylab.add(dx, dy, out=(dout,), casting=casting)
        assert r is dout
        if o.startswith(("int", "uint")) or o == "bool":  # float -> int casts of finite values
            np.testing.assert_array_equal(cupy_to_host(dout), hout)
        else:
            check(dout, hout, f"out {o} {casting}")


def test_dtype_keyword():
    rng = np.random.default_rng()
    hx, hy = host(rng, "float64", 300), host(rng, "float64", 300)
    for dt in ("float16", "float32", "complex64"):
        run_both("add", (hx, hy), (dev(hx), dev(hy)), dtype=npdt(dt))
        run_both("multiply", (hx, 3), (dev(hx), 3), dtype=npdt(dt))
    run_both("add", (hx, hy), (dev(hx), dev(hy)), dtype=np.int32)  # refused: same_kind
    hi = host(rng, "int32", 300)
    run_both("divide", (hi, hi), (dev(hi), dev(hi)), dtype=np.float32)


PAIRS = [("float32", "float16"), ("int64", "int32"), ("uint8", "float64"), ("complex64", "float32"),
         ("bool", "int8"), ("bfloat16", "float32"), ("uint64", "int64")]


@pytest.mark.parametrize("a,b", PAIRS)
def test_layouts_broadcast_strided_overlap_empty(a, b):
    rng = np.random.default_rng()
    ops = ["add", "multiply", "divide"]
    shapes = [((65, 1, 7), (1, 33, 7)), ((300, 256), (256,)), ((300, 256), (300, 1)),
              ((0,), (0,)), ((3, 0), (1,)), ((), ()), ((5000,), (1,)), ((), (17,))]
    for sa, sb in shapes:
        ha, hb = host(rng, a, int(np.prod(sa))).reshape(sa), host(rng, b, int(np.prod(sb))).reshape(sb)
        for op in ops:
            run_both(op, (ha, hb), (dev(ha), dev(hb)))
    # strided, negative and transposed views
    ha, hb = host(rng, a, 64 * 130).reshape(64, 130), host(rng, b, 64 * 130).reshape(64, 130)
    da, db = dev(ha), dev(hb)
    for view in (lambda x: x[:, ::2], lambda x: x[::-1, 3:67], lambda x: x.T, lambda x: x[1:, 5:]):
        for op in ops:
            run_both(op, (view(ha), view(hb)), (view(da), view(db)))
    # out= a view overlapping an input (NumPy: as if through a temporary), into a strided out
    for shift in (1, -1, 3):
        h = host(rng, a, 1000)
        d = dev(h)
        hy = host(rng, b, 1000 - abs(shift))
        want = h.copy()
        src, dst = (slice(shift, None), slice(None, -shift)) if shift > 0 else (
            slice(None, shift), slice(-shift, None))
        res = numpy_answer(np.add, want[src], hy, out=want[dst])
        if isinstance(res, Exception):  # the result does not cast into a's dtype
            continue
        cupylab.add(d[src], dev(hy), out=d[dst])
        check(d, want, f"overlap shift {shift} {a}+{b}")


def test_integer_and_float_division_edge_values():
    import cupy as cp

    for d in ("int8", "int32", "int64", "uint16", "uint64"):
        info = np.iinfo(d)
        hx = np.array([info.max, info.min, 7, 7, 5, info.min, 0, 9], d)
        if info.min < 0:
            hy = np.array([1, -1, 2, -2, 0, 3, 0, -4], d)
        else:
            hy = np.array([1, 3, 2, 5, 0, 3, 0, 4], d)
        for op in ("floor_divide", "divide", "add", "subtract", "multiply"):
            run_both(op, (hx, hy), (cp.asarray(hx), cp.asarray(hy)))
    for d in ("float16", "bfloat16", "float32", "float64"):
        hx = np.array([1, -1, 0, 7, -7, 7, -7, 0.5, np.inf, -np.inf, np.nan, 1e-30], npdt(d))
        hy = np.array([0, 0, 0, 2, 2, -2, -2, 0.25, 3, np.inf, 1, 3], npdt(d))
        for op in ("floor_divide", "divide"):
            run_both(op, (hx, hy), (dev(hx), dev(hy)))
    for d in ("complex64", "complex128"):
        hx = np.array([1 + 1j, 0, 1e30 + 1e30j, 3 - 4j, np.inf, 1j], d)
        hy = np.array([0, 0, 1e30 - 1e-30j, 1e-30 + 1e-30j, 1 + 1j, np.inf], d)
        run_both("divide", (hx, hy), (dev(hx), dev(hy)))


def test_all_scalar_call_gives_a_0d_cupy_array():
    import cupy as cp

    r = cupylab.add(2, 2.0)
    assert isinstance(r, cp.ndarray) and r.shape == () and r.dtype == np.float64
    assert float(r) == 4.0
    out = cp.zeros((3, 2), cp.float32)
    assert cupylab.multiply(3, 0.5, out=out) is out and float(out.sum()) == 9.0


# -- torch callers: torch's own results ------------------------------------------------------
TORCH_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128"]
TORCH_OPS = {"add": "add", "subtract": "sub", "multiply": "mul", "divide": "div",
             "floor_divide": "floor_divide"}


def _torch_host(rng, name, n, divisor=False):
    """Small integers (no zero divisors: torch's CUDA integer division by zero is undefined)."""
    import torch

    d = npdt(name)
    if d.kind in "iu":
        lo = 0 if d.kind == "u" else -50
        h = rng.integers(lo, 100, size=n).astype(d)
        if divisor:
            h[h == 0] = 1
    elif name == "bool" and divisor:
        h = np.ones(n, bool)
    else:
        h = host(rng, name, n)
    if name == "bfloat16":
        return torch.from_numpy(h.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(h)


def _torch_compare(torch, got, want, where):
    assert got.dtype == want.dtype, f"{where}: {got.dtype} (torch {want.dtype})"
    g, w = got.cpu(), want.cpu()
    if w.dtype.is_floating_point or w.dtype.is_complex:
        wide = torch.complex128 if w.dtype.is_complex else torch.float64
        torch.testing.assert_close(g.to(wide), w.to(wide), equal_nan=True,
                                   rtol=RTOL.get(str(w.dtype)[6:], 1e-6) * 2,
                                   atol=RTOL.get(str(w.dtype)[6:], 1e-6) * 64, msg=where)
    else:
        assert torch.equal(g, w), where


@pytest.mark.parametrize("op", list(TORCH_OPS))
def test_torch_callers_get_torch_results(op):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    for a in TORCH_DTYPES:
        ta = _torch_host(rng, a, 517)
        for b in TORCH_DTYPES:
            tb = _torch_host(rng, b, 517, divisor=op == "floor_divide")
            f = getattr(torch, TORCH_OPS[op])
            try:
                want = f(ta.cuda(), tb.cuda())
            except RuntimeError:
                with pytest.raises(TypeError):
                    getattr(cupylab, op)(ta.cuda(), tb.cuda())
                continue
            got = getattr(cupylab, op)(ta.cuda(), tb.cuda())
            assert isinstance(got, torch.Tensor)
            _torch_compare(torch, got, want, f"{op}({a}, {b})")
        for s in (2, 0.5, True):
            try:
                want = getattr(torch, TORCH_OPS[op])(ta.cuda(), s)
            except RuntimeError:
                continue
            _torch_compare(torch, getattr(cupylab, op)(ta.cuda(), s), want, f"{op}({a}, {s})")
