"""The lean path of the row-wise operators (cupylab.ops._rowfast) against the general path:
the same kernels with the same arguments, the same bits, taken for plain contiguous torch
tensors and CuPy arrays (also at addresses off 16 bytes), and left for everything it does not
handle. The general path is reached by passing ``stream=`` (the lean path takes only calls
without it)."""
import numpy as np
import pytest

import cupylab
from cupylab import _arrays, _launch
from cupylab.ops import _rowcore, _rowfast

from gpu_util import FLOATS, from_host, host_data, to_host

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (1, 4096), (3, 5, 7), (199, 33), (64, 1000), (8, 4097), (2, 70000)]


def _fw(name):
    if name == "torch":
        pytest.importorskip("torch")
    return name


def _stream(fw):
    if fw == "torch":
        import torch

        return torch.cuda.current_stream()
    import cupy as cp

    return cp.cuda.get_current_stream()


def _arr(rng, fw, shape, dt, offset=False):
    """A C-contiguous array; ``offset``: starting one element into its buffer (so its address
    is off 16 bytes)."""
    n = int(np.prod(shape))
    h = host_data(rng, (n + 1,), dt)
    d = from_host(fw, h)
    return d[1:].reshape(shape) if offset else d[:n].reshape(shape)


def _weight(rng, fw, cols, dt, f32):
    return from_host(fw, host_data(rng, (cols,), "float32" if f32 else dt))


def _same(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    ha, hb = to_host(a), to_host(b)
    assert ha.shape == hb.shape and ha.dtype == hb.dtype
    np.testing.assert_array_equal(ha.view(np.uint8), hb.view(np.uint8))


def _lean_only(m):
    """Make the general path fail (in a ``monkeypatch.context()``): a call that still
    succeeds took the lean path."""
    m.setattr(_rowcore, "gather", lambda *a, **k: pytest.fail("the general path was taken"))


def _tuple(r):
    return r if isinstance(r, tuple) else (r,)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [False, True])
def test_forward_lean_matches_general(fw, dt, shape, offset, monkeypatch):
    _fw(fw)
    rng = np.random.default_rng(7)
    cols = shape[-1]
    x = _arr(rng, fw, shape, dt, offset)
    r = _arr(rng, fw, shape, dt, offset)
    w = _weight(rng, fw, cols, dt, f32=dt in ("float16", "bfloat16"))
    b = _weight(rng, fw, cols, dt, f32=dt in ("float16", "bfloat16"))
    calls = [
        lambda **k: cupylab.softmax(x, **k),
        lambda **k: cupylab.log_softmax(x, axis=len(shape) - 1, **k),
        lambda **k: cupylab.rms_norm(x, w, 1e-5, return_stats=True, **k),
        lambda **k: cupylab.rms_norm(x, None, **k),
        lambda **k: cupylab.layer_norm(x, w, b, return_stats=True, **k),
        lambda **k: cupylab.layer_norm(x, None, b, **k),
        lambda **k: cupylab.add_rms_norm(x, r, w, 1e-6, return_stats=True, **k),
    ]
    for f in calls:
        lean = _tuple(f())
        with monkeypatch.context() as m:  # the second lean call runs a stored plan
            _lean_only(m)
            lean2 = _tuple(f())
        gen = _tuple(f(stream=_stream(fw)))
        assert len(lean) == len(gen) == len(lean2)
        for u, u2, v in zip(lean, lean2, gen):
            _same(u, v)
            _same(u2, v)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", FLOATS)
def test_add_rms_norm_inplace_lean(fw, dt, monkeypatch):
    _fw(fw)
    rng = np.random.default_rng(3)
    hx, hr = host_data(rng, (37, 300), dt), host_data(rng, (37, 300), dt)
    x, r = from_host(fw, hx), from_host(fw, hr)
    r0 = from_host(fw, hr)
    with monkeypatch.context() as m:
        _lean_only(m)
        y, h = cupylab.add_rms_norm(x, r, None, 1e-6, inplace=True)
    assert h is r
    y_ref, h_ref = cupylab.add_rms_norm(x, r0, None, 1e-6, stream=_stream(fw))
    _same(y, y_ref)
    _same(r, h_ref)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weight", ["none", "same", "f32"])
@pytest.mark.parametrize("offset", [False, True])
def test_backward_lean_matches_general(fw, dt, shape, weight, offset, monkeypatch):
    _fw(fw)
    if weight == "f32" and dt not in ("float16", "bfloat16"):
        pytest.skip("a float32 weight goes with 16-bit x only")
    rng = np.random.default_rng(11)
    cols = shape[-1]
    x, dy = _arr(rng, fw, shape, dt), _arr(rng, fw, shape, dt, offset)
    y = cupylab.softmax(x)
    w = None if weight == "none" else _weight(rng, fw, cols, dt, weight == "f32")
    _, rstd = cupylab.rms_norm(x, w, return_stats=True)
    _, mean, rstd2 = cupylab.layer_norm(x, w, w, return_stats=True)
    calls = [
        lambda **k: cupylab.softmax_backward(y, dy, **k),
        lambda **k: cupylab.log_softmax_backward(y, dy, **k),
        lambda **k: cupylab.rms_norm_backward(dy, x, w, rstd, **k),
        lambda **k: cupylab.layer_norm_backward(dy, x, w, mean, rstd2, **k),
    ]
    for f in calls:
        with monkeypatch.context() as m:
            _lean_only(m)
            lean = _tuple(f())
            lean2 = _tuple(f())
        gen = _tuple(f(stream=_stream(fw)))
        for u, u2, v in zip(lean, lean2, gen):
            _same(u, v)
            _same(u2, v)  # the weight gradient is deterministic on both paths


def _record(monkeypatch):
    seen = []
    real = _launch.Kernel.launch

    def rec(self, device, grid, block, stream, args, shared_mem=0, **kw):
        seen.append((self.name_expression, grid, block, shared_mem, tuple(args)))
        return real(self, device, grid, block, stream, args, shared_mem=shared_mem, **kw)

    monkeypatch.setattr(_launch.Kernel, "launch", rec)
    return seen


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_lean_launches_what_the_general_path_launches(fw, monkeypatch):
    """Kernel, grid, block, shared memory and every argument but the fresh outputs' and
    partial sums' addresses are the same on both paths."""
    _fw(fw)
    rng = np.random.default_rng(5)
    x = _arr(rng, fw, (300, 2048), "bfloat16")
    dy = _arr(rng, fw, (300, 2048), "bfloat16")
    w = _weight(rng, fw, 2048, "bfloat16", True)
    _, rstd = cupylab.rms_norm(x, w, return_stats=True)
    seen = _record(monkeypatch)
    for f in (lambda **k: cupylab.rms_norm(x, w, return_stats=True, **k),
              lambda **k: cupylab.softmax(x, **k),
              lambda **k: cupylab.rms_norm_backward(dy, x, w, rstd, **k)):
        seen.clear()
        f()
        lean = list(seen)
        seen.clear()
        f(stream=_stream(fw))
        gen = list(seen)
        assert len(lean) == len(gen) >= 1
        inputs = {_arrays.as_view(a).ptr for a in (x, dy, w, rstd)}
        for a, b in zip(lean, gen):
            assert a[:4] == b[:4]
            mask = [v if (v in inputs or not isinstance(v, int) or v < 1 << 20) else "new"
                    for v in a[4]]
            assert mask == [v if (v in inputs or not isinstance(v, int) or v < 1 << 20)
                            else "new" for v in b[4]]


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_lean_path_leaves_what_it_does_not_handle(fw):
    """Strided rows, mixed frameworks, empty arrays and every error go to the general path,
    which gives its documented results and errors."""
    _fw(fw)
    rng = np.random.default_rng(1)
    x = from_host(fw, host_data(rng, (6, 10), "float32"))
    assert tuple(cupylab.softmax(x[:, :7]).shape) == (6, 7)  # strided rows
    assert tuple(cupylab.rms_norm(x[:0]).shape) == (0, 10)
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        cupylab.rms_norm(x, None, -1.0)
    with pytest.raises(ValueError, match="weight must have shape"):
        cupylab.rms_norm(x, x[0, :3])
    with pytest.raises(TypeError, match="dy must have the dtype"):
        cupylab.softmax_backward(x, from_host(fw, host_data(rng, (6, 10), "float64")))
    with pytest.raises(ValueError, match="one value per row"):
        cupylab.rms_norm_backward(x, x, None, x[0])
    with pytest.raises(TypeError, match="rstd must be float32"):
        cupylab.rms_norm_backward(x, x, None, from_host(fw, np.ones(6, np.float64)))
    xi = from_host(fw, np.ones((3, 4), np.int32))
    with pytest.raises(TypeError, match="must be float16"):
        cupylab.softmax(xi)


def test_lean_torch_refuses_grad_like_the_general_path():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with pytest.raises(TypeError, match="requires grad"):
        cupylab.rms_norm(x)


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_plans_are_kept_per_signature(fw, monkeypatch):
    """One plan per (operator, dtype, shape, input alignment ...): an offset input gets its own
    plan (its rows are not 16-byte aligned), a repeated call reuses the stored one."""
    _fw(fw)
    monkeypatch.setattr(_rowfast, "_plans", {})
    rng = np.random.default_rng(2)
    a, b = _arr(rng, fw, (9, 40), "float32"), _arr(rng, fw, (9, 40), "float32", offset=True)
    for _ in range(3):
        cupylab.softmax(a)
    assert len(_rowfast._plans) == 1
    cupylab.softmax(b)
    assert len(_rowfast._plans) == 2
    (k1, p1), (k2, p2) = _rowfast._plans.items()
    assert k1[:3] == k2[:3] and k1[3] == 0 and k2[3] == 4
    assert p1.k is not p2.k  # the register kernel for a, the generic one for b
