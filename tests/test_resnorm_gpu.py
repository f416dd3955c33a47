"""add_rms_norm over a float32 residual stream (cupylab/ops/resnorm.py) on the GPU against
float64 references: every branch and output dtype, row lengths from 1 to past the register
classes, contiguous / strided / offset / column-strided rows, in place, out=, the backward with
and without the residual's own gradient and a weight, and torch (autograd, torch.compile)."""
import numpy as np
import pytest

import cupylab

from gpu_util import cupy_from_host, np_dtype, to_host
from test_rowwise_gpu import place

pytestmark = pytest.mark.gpu

TYPES = ("float16", "bfloat16", "float32")
# rows x cols: empty, one element, odd lengths (the generic kernel), each register class
# (64, 256, 512, 2,048, 8,192 forward; 4,096 and 8,192 backward), past them
SHAPES = [(0, 8), (1, 4), (5, 1), (3, 30), (7, 64), (33, 256), (65, 512), (9, 1000),
          (5, 2048), (3, 4096), (2, 8192), (2, 8200)]
EPS = 1e-6
_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-5}


def _ref_fwd(x, r, w, eps=EPS):
    h = r.astype(np.float64) + x.astype(np.float64)
    h32 = h.astype(np.float32)  # one float32 rounding of the exact sum
    hd = h32.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(hd * hd, axis=-1, keepdims=True) + eps)
    y = hd * rstd * (1.0 if w is None else w.astype(np.float64))
    return y, h32, rstd[..., 0]


def _ref_bwd(dy, h, w, rstd, dh):
    g = dy.astype(np.float64) * (1.0 if w is None else w.astype(np.float64))
    hd = h.astype(np.float64)
    rs = rstd.astype(np.float64)[..., None]
    m = np.mean(g * hd, axis=-1, keepdims=True)
    dres = rs * (g - hd * rs * rs * m) + (0.0 if dh is None else dh.astype(np.float64))
    dw = None if w is None else np.sum((dy.astype(np.float64) * hd * rs).reshape(
        -1, h.shape[-1]), axis=0)
    return dres, dw


def _close(got, ref, dt, what, scale=None):
    got = to_host(got).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    tol = _TOL[dt]
    atol = tol * (1.0 if scale is None else scale)
    np.testing.assert_allclose(got, ref, rtol=tol, atol=atol, err_msg=what)


def _data(rows, cols, xdt, seed=0):
    rng = np.random.default_rng(rows * 131 + cols + seed)
    x = (rng.standard_normal((rows, cols)) * 2).astype(np_dtype(xdt))
    r = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(cols)).astype(np.float32)
    return rng, x, r, w


@pytest.mark.parametrize("ydt", TYPES)
@pytest.mark.parametrize("xdt", TYPES)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("layout", ["contig", "strided", "offset", "transposed"])
def test_forward(layout, rows, cols, xdt, ydt):
    if xdt == ydt == "float32" and layout != "contig":
        pytest.skip("one dtype throughout: the same-dtype row kernels (tests/test_rowwise_gpu)")
    _, x, r, w = _data(rows, cols, xdt)
    _, xd = place("cupy", x, layout)
    _, rd = place("cupy", r, "offset" if layout == "strided" else layout)
    wd = cupy_from_host(w)
    y, h, rstd = cupylab.add_rms_norm(xd, rd, wd, EPS, dtype=ydt, return_stats=True)
    yr, hr, sr = _ref_fwd(x, r, w)
    assert str(y.dtype) == ydt and str(h.dtype) == "float32" and str(rstd.dtype) == "float32"
    np.testing.assert_array_equal(to_host(h), hr)  # the float32 sum, exactly rounded
    _close(rstd, sr, "float32", "rstd")
    _close(y, yr, ydt, "y", scale=4.0)


@pytest.mark.parametrize("xdt", ["bfloat16", "float16"])
@pytest.mark.parametrize("rows,cols", [(3, 30), (65, 512), (5, 2048), (2, 8200)])
def test_float32_residual_dispatch_without_dtype(rows, cols, xdt):
    """A float32 residual under a 16-bit x without dtype=: h and y float32, no weight."""
    _, x, r, _ = _data(rows, cols, xdt, seed=1)
    y, h = cupylab.add_rms_norm(cupy_from_host(x), cupy_from_host(r), None, EPS)
    yr, hr, _ = _ref_fwd(x, r, None)
    assert str(y.dtype) == "float32"
    np.testing.assert_array_equal(to_host(h), hr)
    _close(y, yr, "float32", "y", scale=4.0)


@pytest.mark.parametrize("rows,cols", [(7, 64), (65, 512), (2, 8200)])
def test_inplace_and_out(rows, cols):
    _, x, r, w = _data(rows, cols, "bfloat16", seed=2)
    xd, rd, wd = cupy_from_host(x), cupy_from_host(r), cupy_from_host(w)
    out = cupy_from_host(np.full((rows, cols), np.nan, dtype=np_dtype("bfloat16")))
    y, h = cupylab.add_rms_norm(xd, rd, wd, EPS, inplace=True, out=out, dtype="bfloat16")
    yr, hr, _ = _ref_fwd(x, r, w)
    assert h is rd and y is out
    np.testing.assert_array_equal(to_host(rd), hr)
    _close(out, yr, "bfloat16", "y", scale=4.0)
    # y over x itself (same dtype, exactly in place)
    xd2 = cupy_from_host(x)
    y2, _ = cupylab.add_rms_norm(xd2, cupy_from_host(r), wd, EPS, out=xd2, dtype="bfloat16")
    assert y2 is xd2
    _close(xd2, yr, "bfloat16", "y over x", scale=4.0)


@pytest.mark.parametrize("cols", [512, 30])
def test_broadcast_branch(cols):
    """x a broadcast view (batch stride 0: a position embedding added to every sequence), the
    residual of the full shape: the leading dimensions stay two strided levels."""
    import cupy as cp

    rng = np.random.default_rng(cols)
    pos = rng.standard_normal((5, cols)).astype(np.float32)
    r = (rng.standard_normal((3, 5, cols)) * 3).astype(np.float32)
    xd = cp.broadcast_to(cupy_from_host(pos), (3, 5, cols))
    y, h, rstd = cupylab.add_rms_norm(xd, cupy_from_host(r), None, EPS, dtype="bfloat16",
                                      return_stats=True)
    yr, hr, _ = _ref_fwd(np.broadcast_to(pos, (3, 5, cols)), r, None)
    np.testing.assert_array_equal(to_host(h), hr)
    _close(y, yr, "bfloat16", "y", scale=4.0)
    dy = rng.standard_normal((3, 5, cols)).astype(np_dtype("bfloat16"))
    g, gx, _ = cupylab.add_rms_norm_backward(cupy_from_host(dy), h, None, rstd)
    gr, _ = _ref_bwd(dy, to_host(h), None, to_host(rstd), None)
    _close(g, gr, "float32", "dresidual", scale=8.0)


@pytest.mark.parametrize("rows,cols", [(65, 512), (3, 4096), (1, 64)])
def test_lean_and_general_paths_agree(rows, cols):
    """Plain contiguous CuPy arrays take the lean path (cupylab/ops/_resfast.py); stream=
    forces the general one: the same kernels, bit for bit."""
    import cupy as cp

    rng, x, r, w = _data(rows, cols, "float16", seed=9)
    xd, rd, wd = cupy_from_host(x), cupy_from_host(r), cupy_from_host(w)
    s = cp.cuda.get_current_stream()
    a = cupylab.add_rms_norm(xd, rd, wd, EPS, dtype=np.dtype("float16"), return_stats=True)
    b = cupylab.add_rms_norm(xd, rd, wd, EPS, dtype=np.dtype("float16"), return_stats=True,
                             stream=s)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(to_host(u), to_host(v))
    dy = cupy_from_host(rng.standard_normal((rows, cols)).astype(np.float16))
    dh = cupy_from_host(rng.standard_normal((rows, cols)).astype(np.float32))
    ga = cupylab.add_rms_norm_backward(dy, a[1], wd, a[2], dh, x_dtype=np.dtype("float16"))
    gb = cupylab.add_rms_norm_backward(dy, a[1], wd, a[2], dh, x_dtype=np.dtype("float16"),
                                       stream=s)
    for u, v in zip(ga, gb):
        np.testing.assert_array_equal(to_host(u), to_host(v))


def test_same_dtype_with_dtype_takes_the_row_kernels():
    _, x, _, _ = _data(9, 256, "bfloat16", seed=3)
    r = x[::-1].copy()
    xd, rd = cupy_from_host(x), cupy_from_host(r)
    y1, h1 = cupylab.add_rms_norm(xd, rd, None, EPS, dtype="bfloat16")
    y2, h2 = cupylab.add_rms_norm(xd, rd, None, EPS)
    assert str(h1.dtype) == "bfloat16"
    np.testing.assert_array_equal(to_host(y1), to_host(y2))
    np.testing.assert_array_equal(to_host(h1), to_host(h2))


def test_errors():
    x = cupy_from_host(np.zeros((2, 8), dtype=np_dtype("bfloat16")))
    r = cupy_from_host(np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(TypeError, match="add_rms_norm: residual must have x's dtype"):
        cupylab.add_rms_norm(x, cupy_from_host(np.zeros((2, 8), dtype=np.float16)), None,
                             dtype="float32")
    with pytest.raises(TypeError, match="add_rms_norm: dtype must be float16, bfloat16 or "
                                        "float32"):
        cupylab.add_rms_norm(x, r, None, dtype="float64")
    with pytest.raises(TypeError, match="add_rms_norm: weight must be float32"):
        cupylab.add_rms_norm(x, r, x[0], dtype="bfloat16")
    with pytest.raises(ValueError, match="add_rms_norm: residual must have the shape"):
        cupylab.add_rms_norm(x, r[:1], None, dtype="bfloat16")
    with pytest.raises(TypeError, match="add_rms_norm: x must be float16, bfloat16 or float32"):
        cupylab.add_rms_norm(cupy_from_host(np.zeros((2, 8))), r, None)
    with pytest.raises(TypeError, match="add_rms_norm: out has dtype float32, expected "
                                        "bfloat16"):
        cupylab.add_rms_norm(x, r, None, out=r, dtype="bfloat16")
    with pytest.raises(ValueError, match="add_rms_norm: the last axis of x is empty"):
        cupylab.add_rms_norm(x[:, :0], r[:, :0], None, dtype="bfloat16")
    h = cupy_from_host(np.ones((2, 8), dtype=np.float32))
    s = cupy_from_host(np.ones(2, dtype=np.float32))
    with pytest.raises(TypeError, match="add_rms_norm_backward: h must be float32"):
        cupylab.add_rms_norm_backward(x, x, None, s)
    with pytest.raises(TypeError, match="add_rms_norm_backward: rstd is required"):
        cupylab.add_rms_norm_backward(x, h, None, None)
    with pytest.raises(ValueError, match="add_rms_norm_backward: rstd must hold one value"):
        cupylab.add_rms_norm_backward(x, h, None, s[:1])
    with pytest.raises(TypeError, match="add_rms_norm_backward: x_dtype must be"):
        cupylab.add_rms_norm_backward(x, h, None, s, x_dtype="int32")
    with pytest.raises(ValueError, match="add_rms_norm_backward: dy must have the shape"):
        cupylab.add_rms_norm_backward(x[:1], h, None, s)


@pytest.mark.parametrize("xdt", TYPES)
@pytest.mark.parametrize("dydt", TYPES)
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("layout", ["contig", "offset", "transposed"])
@pytest.mark.parametrize("extras", ["dh+w", "w", "dh", "none"])
def test_backward(extras, layout, rows, cols, dydt, xdt):
    if extras != "dh+w" and (layout != "contig" or xdt != "bfloat16"):
        pytest.skip("the optional operands: contiguous bfloat16 rows")
    rng, x, r, w = _data(rows, cols, xdt, seed=4)
    y, h, rstd = cupylab.add_rms_norm(cupy_from_host(x), cupy_from_host(r), cupy_from_host(w),
                                      EPS, dtype=dydt, return_stats=True)
    dy = rng.standard_normal((rows, cols)).astype(np_dtype(dydt))
    dh = rng.standard_normal((rows, cols)).astype(np.float32)
    use_w, use_dh = "w" in extras, "dh" in extras
    _, dyd = place("cupy", dy, layout)
    _, dhd = place("cupy", dh, layout)
    g, gx, dw = cupylab.add_rms_norm_backward(
        dyd, h, cupy_from_host(w) if use_w else None, rstd, dhd if use_dh else None,
        x_dtype=xdt)
    gr, dwr = _ref_bwd(dy, to_host(h), w if use_w else None, to_host(rstd),
                       dh if use_dh else None)
    assert str(g.dtype) == "float32" and str(gx.dtype) == xdt
    if xdt == "float32":
        assert gx is g
    _close(g, gr, "float32", "dresidual", scale=8.0)
    np.testing.assert_array_equal(to_host(gx), to_host(g).astype(np_dtype(xdt)))
    if use_w:
        _close(dw, dwr, "float32", "dweight", scale=8.0 * max(1, rows) ** 0.5)
    else:
        assert dw is None


def test_backward_without_weight_grad_and_empty_rows():
    _, x, r, w = _data(4, 64, "bfloat16", seed=5)
    y, h, rstd = cupylab.add_rms_norm(cupy_from_host(x), cupy_from_host(r), cupy_from_host(w),
                                      EPS, dtype="bfloat16", return_stats=True)
    g, gx, dw = cupylab.add_rms_norm_backward(y, h, cupy_from_host(w), rstd, weight_grad=False)
    assert dw is None and gx is g
    z = cupy_from_host(np.zeros((0, 64), dtype=np.float32))
    g, gx, dw = cupylab.add_rms_norm_backward(z, z, cupy_from_host(w),
                                              cupy_from_host(np.zeros(0, np.float32)))
    assert g.shape == (0, 64) and float(abs(to_host(dw)).max()) == 0.0


# -- torch ------------------------------------------------------------------------------------
def _torch_case(xdt, rows=37, cols=512, seed=6):
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, xdt)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dt).requires_grad_()
    r = (torch.randn(rows, cols, device="cuda", generator=g) * 3).requires_grad_()
    w = (1 + 0.5 * torch.randn(cols, device="cuda", generator=g)).requires_grad_()
    dy = torch.randn(rows, cols, device="cuda", generator=g)
    dh = torch.randn(rows, cols, device="cuda", generator=g)
    return torch, x, r, w, dy, dh


def _torch_ref(torch, x, r, w, dy, dh, ydt):
    xs, rs, ws = (t.detach().double().requires_grad_() for t in (x, r, w))
    h = rs + xs
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * ws
    (y * dy.to(ydt).double()).sum().backward(inputs=[xs, rs, ws], retain_graph=True)
    (h * dh.double()).sum().backward(inputs=[xs, rs, ws])
    return y, h, xs.grad, rs.grad, ws.grad


@pytest.mark.parametrize("xdt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("compiled", [False, True])
def test_torch_autograd(xdt, compiled):
    torch, x, r, w, dy, dh = _torch_case(xdt)
    from cupylab.torch import functional as CF

    def f(x, r, w):
        return CF.add_rms_norm(x, r, w, EPS, out_dtype=torch.bfloat16)

    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True)
    y, h = f(x, r, w)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    ((y.float() * dy.to(torch.bfloat16).float()).sum() + (h * dh).sum()).backward()
    ry, rh, gx, gr, gw = _torch_ref(torch, x, r, w, dy, dh, torch.bfloat16)
    torch.testing.assert_close(h.double(), rh.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), ry.detach(), rtol=1.6e-2, atol=1.6e-2)
    assert x.grad.dtype == x.dtype and r.grad.dtype == torch.float32
    torch.testing.assert_close(r.grad.double(), gr, rtol=1e-4, atol=1e-4)
    tol = {"bfloat16": 1.6e-2, "float16": 2e-3, "float32": 1e-4}[xdt]
    torch.testing.assert_close(x.grad.double(), gx, rtol=tol, atol=tol)
    torch.testing.assert_close(w.grad.double(), gw, rtol=1e-4, atol=1e-3)


def test_torch_broadcast_branch_gradient_sums():
    """A position embedding expanded over the batch as the branch: its gradient is the
    residual's gradient summed over the batch (autograd's expand backward)."""
    torch = pytest.importorskip("torch")
    from cupylab.torch import functional as CF

    g = torch.Generator(device="cuda").manual_seed(8)
    pos = torch.randn(5, 64, device="cuda", generator=g).requires_grad_()
    tok = torch.randn(3, 5, 64, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(3, 5, 64, device="cuda", generator=g).to(torch.bfloat16)
    y, h = CF.add_rms_norm(pos.expand(3, 5, 64), tok, None, EPS, out_dtype=torch.bfloat16)
    (y.float() * dy.float()).sum().backward()
    p2, t2 = (t.detach().double().requires_grad_() for t in (pos, tok))
    h2 = t2 + p2
    y2 = h2 * torch.rsqrt(h2.pow(2).mean(-1, keepdim=True) + EPS)
    (y2 * dy.double()).sum().backward()
    torch.testing.assert_close(tok.grad.double(), t2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pos.grad.double(), p2.grad, rtol=1e-4, atol=1e-4)


def test_torch_h_only_and_no_grad():
    torch, x, r, w, dy, dh = _torch_case("bfloat16", seed=7)
    from cupylab.torch import functional as CF

    _, h = CF.add_rms_norm(x, r, w, EPS, out_dtype=torch.bfloat16)
    (h * dh).sum().backward()  # y unused: the gradient passes through h
    torch.testing.assert_close(r.grad, dh)
    torch.testing.assert_close(x.grad, dh.to(torch.bfloat16))
    assert w.grad is None
    with torch.no_grad():
        y, h = CF.add_rms_norm(x, r, w, EPS, out_dtype=torch.float16)
    assert y.dtype == torch.float16 and not y.requires_grad and not h.requires_grad
